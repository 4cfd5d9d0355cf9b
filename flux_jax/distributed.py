"""Multi-process start-up (jax.distributed.initialize from the environment) and cross-process checks.

How the job is described, checked in order:
  * explicit: FLUX_JAX_COORDINATOR (host:port), FLUX_JAX_NUM_PROCESSES, FLUX_JAX_PROCESS_ID, optionally
    FLUX_JAX_LOCAL_DEVICE_IDS ("0,1"); set by launch/local.sh, or by hand;
  * SLURM: a job step with more than one task (SLURM_STEP_NUM_TASKS or SLURM_NTASKS): process id
    SLURM_PROCID, coordinator the step's first node on port FLUX_JAX_PORT (default derived from the
    job id, as JAX does). One task per node drives every GPU of its node; with several tasks per node
    each takes GPU SLURM_LOCALID unless FLUX_JAX_LOCAL_DEVICE_IDS says otherwise;
  * otherwise a single process, and nothing is initialised.
JAX's own cluster detection is switched off: with one task per node it would give each task one GPU.

Failure detection: every process sends heartbeats to the coordinator; one that misses them for
FLUX_JAX_HEARTBEAT_TIMEOUT seconds (default 100) is declared dead and every other process stops with
an error instead of waiting in a collective until the job's wall clock runs out.
FLUX_JAX_INIT_TIMEOUT (default 300) bounds the wait for all processes at start-up.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import os
import re
import zlib
from collections.abc import Mapping

import jax
import numpy as np

from flux_jax.errors import UserError

log = logging.getLogger(__name__)

ENV_COORDINATOR = "FLUX_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "FLUX_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "FLUX_JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "FLUX_JAX_LOCAL_DEVICE_IDS"
ENV_PORT = "FLUX_JAX_PORT"
ENV_HEARTBEAT = "FLUX_JAX_HEARTBEAT_TIMEOUT"
ENV_INIT_TIMEOUT = "FLUX_JAX_INIT_TIMEOUT"
_EXPLICIT = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """Arguments for jax.distributed.initialize."""

    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None
    heartbeat_timeout_s: int = 100
    init_timeout_s: int = 300


def _int_env(env: Mapping[str, str], name: str, minimum: int = 0) -> int:
    try:
        value = int(env[name])
    except ValueError:
        raise UserError(f"environment variable {name}={env[name]!r} must be an integer.") from None
    if value < minimum:
        raise UserError(f"environment variable {name}={value} must be >= {minimum}.")
    return value


def _local_ids(env: Mapping[str, str]) -> tuple[int, ...] | None:
    if not env.get(ENV_LOCAL_DEVICE_IDS):
        return None
    try:
        return tuple(int(i) for i in env[ENV_LOCAL_DEVICE_IDS].split(","))
    except ValueError:
        raise UserError(
            f"{ENV_LOCAL_DEVICE_IDS}={env[ENV_LOCAL_DEVICE_IDS]!r} must be comma-separated integers (0,1)."
        ) from None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu[003-004,9],cpu1" -> "gpu003"."""
    match = re.match(r"([^,\[]+)(\[([^\]]*)\])?", nodelist.strip())
    if not match or not match.group(1):
        raise UserError(f"SLURM node list {nodelist!r} has no host name (SLURM_STEP_NODELIST).")
    prefix, ranges = match.group(1), match.group(3)
    return prefix + (re.split(r"[,-]", ranges)[0] if ranges else "")


def _slurm_settings(env: Mapping[str, str], timeouts: dict) -> DistributedSettings | None:
    tasks_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    if "SLURM_JOB_ID" not in env or tasks_var not in env or _int_env(env, tasks_var, 1) == 1:
        return None
    num = _int_env(env, tasks_var, 1)
    for name in ("SLURM_PROCID", "SLURM_LOCALID"):
        if name not in env:
            raise UserError(f"{tasks_var}={num} but {name} is unset: start each task with srun.")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise UserError(f"{tasks_var}={num} but SLURM_STEP_NODELIST is unset: start each task with srun.")
    if ENV_PORT in env:
        port = _int_env(env, ENV_PORT, 1)
    else:  # the ephemeral range, one port per job id (JAX's own choice)
        port = _int_env(env, "SLURM_JOB_ID") % 4096 + 61440
    coordinator = env.get(ENV_COORDINATOR) or f"{first_host(nodelist)}:{port}"
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or num)
    local_ids = _local_ids(env)
    if local_ids is None and num > nodes:
        local_ids = (_int_env(env, "SLURM_LOCALID"),)
    return DistributedSettings(coordinator, num, _int_env(env, "SLURM_PROCID"), local_ids, **timeouts)


def settings_from_env(env: Mapping[str, str]) -> DistributedSettings | None:
    """Decides how to start from environment variables; None means a single process.

    Raises UserError naming the variable when a launcher set one wrongly.
    """
    timeouts = {
        "heartbeat_timeout_s": _int_env(env, ENV_HEARTBEAT, 1) if ENV_HEARTBEAT in env else 100,
        "init_timeout_s": _int_env(env, ENV_INIT_TIMEOUT, 1) if ENV_INIT_TIMEOUT in env else 300,
    }
    explicit = [name for name in _EXPLICIT if name in env]
    if len(explicit) == 1 and explicit == [ENV_COORDINATOR] and "SLURM_JOB_ID" in env:
        return _slurm_settings(env, timeouts)  # a coordinator override for a SLURM step
    if not explicit:
        return _slurm_settings(env, timeouts)
    missing = [name for name in _EXPLICIT if name not in env]
    if missing:
        raise UserError(
            f"{', '.join(explicit)} set but {', '.join(missing)} missing; set all three of "
            f"{', '.join(_EXPLICIT)} (launch/local.sh does)."
        )
    num_processes = _int_env(env, ENV_NUM_PROCESSES, 1)
    process_id = _int_env(env, ENV_PROCESS_ID)
    if process_id >= num_processes:
        raise UserError(
            f"{ENV_PROCESS_ID}={process_id} must lie in [0, {ENV_NUM_PROCESSES}={num_processes})."
        )
    host, _, port = env[ENV_COORDINATOR].rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"{ENV_COORDINATOR}={env[ENV_COORDINATOR]!r} must be host:port, e.g. node0:12355.")
    local_ids = _local_ids(env)
    if num_processes == 1:
        return None
    return DistributedSettings(env[ENV_COORDINATOR], num_processes, process_id, local_ids, **timeouts)


def initialize(env: Mapping[str, str] | None = None) -> bool:
    """Calls jax.distributed.initialize when the environment asks for several processes.

    Must run before anything touches a device. Returns True when it initialised.
    """
    settings = settings_from_env(os.environ if env is None else env)
    if settings is None:
        return False
    if settings.process_id != 0:
        quiet_logging()
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "flux_jax.distributed.initialize() ran after JAX had already started its devices; call it "
            "first (flux_jax.cli.run does, before the command's main)."
        )
    try:
        jax.distributed.initialize(
            coordinator_address=settings.coordinator_address,
            num_processes=settings.num_processes,
            process_id=settings.process_id,
            local_device_ids=settings.local_device_ids,
            cluster_detection_method="deactivate",
            initialization_timeout=settings.init_timeout_s,
            heartbeat_timeout_seconds=settings.heartbeat_timeout_s,
        )
    except Exception as err:  # the runtime raises its own types (deadline exceeded, connection refused)
        raise UserError(
            f"process {settings.process_id} of {settings.num_processes} could not join the job at "
            f"coordinator {settings.coordinator_address} within {settings.init_timeout_s} s ({err}). Fix: "
            f"start every process with the same {ENV_COORDINATOR} (host:port of process 0, reachable "
            f"from all nodes) and {ENV_NUM_PROCESSES}, each with its own {ENV_PROCESS_ID}."
        ) from None
    return True


def quiet_logging() -> None:
    """Errors only from the Python and absl loggers: what processes other than 0 print."""
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)
    logging.getLogger("jax").setLevel(logging.ERROR)


def leaf_digests(tree) -> dict[str, int]:
    """crc32 of this process's copy of every fully replicated leaf, by path (sharded leaves skipped)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_replicated:
            continue
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[jax.tree_util.keystr(path)] = zlib.crc32(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return out


def disagreements(names: list[str], digests: np.ndarray) -> list[str]:
    """Leaves whose digests differ between processes; ``digests`` is (processes, leaves)."""
    return [name for name, column in zip(names, np.asarray(digests).T) if len(set(column.tolist())) > 1]


# Waits in the coordination service are bounded by the heartbeat (a dead process stops the job), not
# by these: a process may legitimately be late by a long compile or checkpoint write.
_WAIT_MS = 7 * 24 * 3600 * 1000
_calls: dict[str, itertools.count] = collections.defaultdict(itertools.count)


def _client():
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def exchange(name: str, value: str) -> list[str]:
    """Every process's ``value``, in process order (every process must call this in the same order).

    Goes through the coordination service, not a device collective, so it never queues behind (or
    interleaves with) computations still running on the devices.
    """
    if jax.process_count() == 1:
        return [value]
    n = next(_calls[name])
    client = _client()
    client.key_value_set(f"flux_jax/{name}/{n}/{jax.process_index()}", value)
    return [
        client.blocking_key_value_get(f"flux_jax/{name}/{n}/{p}", _WAIT_MS)
        for p in range(jax.process_count())
    ]


def any_process(flag: bool, name: str) -> bool:
    """True on every process when ``flag`` is True on any of them (a collective decision)."""
    return any(v == "1" for v in exchange(name, "1" if flag else "0"))


def first_error(error: str | None, name: str) -> str | None:
    """A device check's outcome every process shares: None when it passed on all of them, else the
    first failing process's error (naming the process when there are several). Every process must call
    it, so a choice such as a kernel that failed on one node is given up on all (one SPMD program)."""
    errors = exchange(name, error or "")
    for p, e in enumerate(errors):
        if e:
            return e if len(errors) == 1 else f"process {p}: {e}"
    return None


def check_replicas_agree(tree, what: str) -> None:
    """Raises when a replicated leaf of ``tree`` differs between processes (a no-op on one process).

    Replicated state such as fp8_meta is computed by every process for itself; a reduction that
    missed a process would let the copies drift apart without any other sign.
    """
    if jax.process_count() == 1:
        return
    local = leaf_digests(tree)
    names = sorted(local)
    values = exchange("digests", json.dumps([local[n] for n in names]))
    bad = disagreements(names, np.asarray([json.loads(v) for v in values], np.int64))
    if bad:
        raise RuntimeError(
            f"{what} differs between the {jax.process_count()} processes in {len(bad)} entries: "
            + ", ".join(bad[:10])
        )
    log.info("%s agrees on all %d processes (%d replicated entries).", what, jax.process_count(), len(names))
