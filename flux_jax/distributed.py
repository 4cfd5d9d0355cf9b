"""Multi-process start-up: jax.distributed.initialize from the environment.

Three cases, checked in order:
  * explicit: FLUX_JAX_COORDINATOR (host:port), FLUX_JAX_NUM_PROCESSES, FLUX_JAX_PROCESS_ID
    (set by launch/local.sh, or by hand), optionally FLUX_JAX_LOCAL_DEVICE_IDS ("0,1");
  * SLURM: more than one task in the step (SLURM_NTASKS / SLURM_STEP_NUM_TASKS) -> JAX's own
    SLURM cluster detection picks coordinator, process count and id;
  * otherwise a single process, and nothing is initialised.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax

ENV_COORDINATOR = "FLUX_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "FLUX_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "FLUX_JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "FLUX_JAX_LOCAL_DEVICE_IDS"


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """Arguments for jax.distributed.initialize; ``auto`` leaves them to cluster detection."""

    auto: bool
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None


def _int_env(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} must be an integer.") from None


def settings_from_env(env: Mapping[str, str]) -> DistributedSettings | None:
    """Decides how to start from environment variables; None means a single process."""
    explicit = [name for name in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID) if name in env]
    if explicit:
        missing = sorted({ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID} - set(explicit))
        if missing:
            raise ValueError(
                f"{', '.join(explicit)} set but {', '.join(missing)} missing; set all three of "
                f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} (launch/local.sh does)."
            )
        num_processes = _int_env(env, ENV_NUM_PROCESSES)
        process_id = _int_env(env, ENV_PROCESS_ID)
        if not 0 <= process_id < num_processes:
            raise ValueError(
                f"{ENV_PROCESS_ID}={process_id} must lie in [0, {ENV_NUM_PROCESSES}={num_processes})."
            )
        if ":" not in env[ENV_COORDINATOR]:
            raise ValueError(f"{ENV_COORDINATOR}={env[ENV_COORDINATOR]!r} must be host:port.")
        local_ids = None
        if env.get(ENV_LOCAL_DEVICE_IDS):
            try:
                local_ids = tuple(int(i) for i in env[ENV_LOCAL_DEVICE_IDS].split(","))
            except ValueError:
                raise ValueError(
                    f"{ENV_LOCAL_DEVICE_IDS}={env[ENV_LOCAL_DEVICE_IDS]!r} must be comma-separated integers."
                ) from None
        if num_processes == 1:
            return None
        return DistributedSettings(
            auto=False,
            coordinator_address=env[ENV_COORDINATOR],
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_ids,
        )
    slurm_tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if slurm_tasks and "SLURM_JOB_ID" in env and int(slurm_tasks) > 1:
        return DistributedSettings(auto=True)
    return None


def initialize(env: Mapping[str, str] | None = None) -> bool:
    """Calls jax.distributed.initialize when the environment asks for several processes.

    Must run before anything touches a device. Returns True when it initialised.
    """
    settings = settings_from_env(os.environ if env is None else env)
    if settings is None:
        return False
    if settings.auto:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(
            coordinator_address=settings.coordinator_address,
            num_processes=settings.num_processes,
            process_id=settings.process_id,
            local_device_ids=settings.local_device_ids,
        )
    return True
