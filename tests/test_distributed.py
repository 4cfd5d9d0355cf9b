"""Multi-process start-up: environment parsing, and a real 2-process CPU run via launch/local.sh."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from flux_jax import distributed
from flux_jax.errors import UserError

REPO = pathlib.Path(__file__).resolve().parents[1]

# A sharded jitted computation whose result does not depend on how many processes hold the data.
WORKER = """
import json, sys
from flux_jax import distributed
distributed.initialize()
import jax, jax.numpy as jnp, numpy as np, ml_collections
from flux_jax import sharding
mesh = sharding.make_mesh(ml_collections.ConfigDict({"mesh": {"data": -1, "fsdp": 1, "tensor": 1}}))
global_x = np.arange(4 * 6, dtype=np.float32).reshape(4, 6) / 10.0
per_host = global_x.shape[0] // jax.process_count()
local = global_x[jax.process_index() * per_host : (jax.process_index() + 1) * per_host]
x = sharding.host_local_batch_to_global({"x": local}, mesh)["x"]
w = jnp.linspace(-1.0, 1.0, 6 * 3, dtype=jnp.float32).reshape(6, 3)
loss, grad = jax.jit(jax.value_and_grad(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)))(w, x)
# A device check that fails on the last process only: every process must take its error.
check = distributed.first_error("no kernel" if jax.process_index() == 1 else None, "check")
passed = distributed.first_error(None, "check")
print("CHECK " + json.dumps([jax.process_index(), check, passed]))
if jax.process_index() == 0:
    print("RESULT " + json.dumps({"n": jax.process_count(), "devices": jax.device_count(),
                                  "loss": float(loss), "grad": np.asarray(grad).tolist()}))
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run(num_processes, local_devices, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX_JAX_", "SLURM_"))}
    env.update(
        FLUX_JAX_PORT=str(_free_port()),
        FLUX_JAX_LOCAL_DEVICES=str(local_devices),
        XLA_FLAGS="",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        PYTHON=sys.executable,
    )
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "local.sh"), str(num_processes), str(script)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout
    checks = [
        json.loads(line[len("CHECK ") :]) for line in proc.stdout.splitlines() if line.startswith("CHECK ")
    ]
    return json.loads(lines[0][len("RESULT ") :]) | {"checks": sorted(checks)}


def test_two_processes_match_one(tmp_path):
    one = _run(1, 2, tmp_path)
    two = _run(2, 2, tmp_path)
    assert (one["n"], one["devices"]) == (1, 2)
    assert (two["n"], two["devices"]) == (2, 4)
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-6)
    np.testing.assert_allclose(two["grad"], one["grad"], rtol=1e-5, atol=1e-7)
    # distributed.first_error: one outcome on every process, naming the process that failed.
    assert one["checks"] == [[0, None, None]]
    assert two["checks"] == [[0, "process 1: no kernel", None], [1, "process 1: no kernel", None]]


def test_single_process_without_env():
    assert distributed.settings_from_env({}) is None
    assert distributed.initialize({}) is False


def test_explicit_env():
    s = distributed.settings_from_env(
        {
            "FLUX_JAX_COORDINATOR": "node0:1234",
            "FLUX_JAX_NUM_PROCESSES": "4",
            "FLUX_JAX_PROCESS_ID": "3",
            "FLUX_JAX_LOCAL_DEVICE_IDS": "0,1",
            "FLUX_JAX_HEARTBEAT_TIMEOUT": "15",
        }
    )
    assert s == distributed.DistributedSettings("node0:1234", 4, 3, (0, 1), heartbeat_timeout_s=15)


def _slurm(procid, nodes=2, tasks=2, **extra):
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NODELIST": "mi300x-[017-018]",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid % (tasks // nodes)),
    }
    return env | extra


def test_slurm_env():
    # One task per node: every GPU of the node, coordinator on the first node, port from the job id.
    assert distributed.settings_from_env(_slurm(1)) == distributed.DistributedSettings(
        "mi300x-017:" + str(4242 % 4096 + 61440), 2, 1, None
    )
    # Eight tasks per node: one GPU each; FLUX_JAX_PORT picks the port.
    s = distributed.settings_from_env(_slurm(13, tasks=16, FLUX_JAX_PORT="5555"))
    assert (s.coordinator_address, s.num_processes, s.process_id, s.local_device_ids) == (
        "mi300x-017:5555",
        16,
        13,
        (5,),
    )
    assert distributed.settings_from_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    assert distributed.first_host("gpu[003-004,9],cpu1") == "gpu003"
    assert distributed.first_host("node7,node8") == "node7"


def test_initialize_passes_settings_and_disables_cluster_detection(monkeypatch):
    import jax

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr("jax._src.xla_bridge.backends_are_initialized", lambda: False)
    monkeypatch.setattr(distributed, "quiet_logging", lambda: None)
    assert distributed.initialize(_slurm(0, FLUX_JAX_HEARTBEAT_TIMEOUT="12"))
    (kw,) = calls
    assert kw["cluster_detection_method"] == "deactivate" and kw["heartbeat_timeout_seconds"] == 12
    assert (kw["num_processes"], kw["process_id"], kw["local_device_ids"]) == (2, 0, None)


def _env(coordinator="h:1", num="2", pid="0"):
    return {"FLUX_JAX_COORDINATOR": coordinator, "FLUX_JAX_NUM_PROCESSES": num, "FLUX_JAX_PROCESS_ID": pid}


@pytest.mark.parametrize(
    "env, field",
    [
        ({"FLUX_JAX_COORDINATOR": "h:1"}, "FLUX_JAX_NUM_PROCESSES"),
        (_env(pid="2"), "PROCESS_ID"),
        (_env(coordinator="h"), "host:port"),
        (_env(num="x"), "FLUX_JAX_NUM_PROCESSES='x' must be an integer"),
        (_env() | {"FLUX_JAX_LOCAL_DEVICE_IDS": "0;1"}, "FLUX_JAX_LOCAL_DEVICE_IDS"),
        (_env() | {"FLUX_JAX_HEARTBEAT_TIMEOUT": "0"}, "FLUX_JAX_HEARTBEAT_TIMEOUT=0 must be >= 1"),
        (_slurm(0, SLURM_STEP_NUM_TASKS="two"), "SLURM_STEP_NUM_TASKS"),
    ],
)
def test_bad_env_raises(env, field):
    with pytest.raises(UserError, match=field):
        distributed.settings_from_env(env)


def test_replica_digests_find_the_leaf_that_differs():
    import jax.numpy as jnp

    digests = distributed.leaf_digests({"a": jnp.ones(3), "b": np.zeros(2, np.float32)})
    assert set(digests) == {"['a']", "['b']"}
    other = distributed.leaf_digests({"a": jnp.ones(3), "b": np.asarray([0.0, 1e-30], np.float32)})
    names = sorted(digests)
    table = np.asarray([[digests[n] for n in names], [other[n] for n in names]])
    assert distributed.disagreements(names, table) == ["['b']"]
    assert distributed.disagreements(names, table[[0, 0]]) == []


def _cli(args, env_extra, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX_JAX_", "SLURM_"))}
    env.update(
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu", **env_extra
    )
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_entry_points_start_no_device_before_initialize():
    code = (
        "import flux_jax.train, flux_jax.sample, flux_jax.convergence, flux_jax.checkpoint\n"
        "import flux_jax.prepare, flux_jax.convert, flux_jax.doctor, configs.toy, configs.flux_12b\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge.backends_are_initialized()\n"
        "print('clean')"
    )
    proc = _cli(["-c", code], {})
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("module", ["flux_jax.train", "flux_jax.sample"])
def test_launcher_variable_set_wrongly_is_one_clear_error(module, tmp_path):
    args = ["-m", module, "--config", "configs/toy.py", "--workdir", str(tmp_path)]
    args += ["--out", str(tmp_path)] if module == "flux_jax.sample" else []
    proc = _cli(args, _env(pid="5"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: FLUX_JAX_PROCESS_ID=5 must lie in [0, FLUX_JAX_NUM_PROCESSES=2)."
    ]


# A fake srun: starts each task of SLURM_NNODES x 1 with the variables real srun sets, records its
# own arguments; the fake python records each task's arguments, environment and distributed settings.
FAKE_SRUN = """#!/usr/bin/env bash
echo "$@" > "$FAKE_OUT/srun_args"
while [[ "$1" == --* ]]; do shift; done
for ((i = 0; i < SLURM_NNODES; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_NODEID=$i SLURM_STEP_NUM_TASKS=$SLURM_NNODES \\
    SLURM_STEP_NUM_NODES=$SLURM_NNODES SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST "$@" &
done
wait
"""
FAKE_PYTHON = """#!{python}
import json, os, sys
from flux_jax import distributed
s = distributed.settings_from_env(os.environ)
out = {{"argv": sys.argv[1:], "env": dict(os.environ), "settings": s and s.__dict__}}
with open(os.path.join(os.environ["FAKE_OUT"], "task_" + os.environ["SLURM_PROCID"] + ".json"), "w") as f:
    json.dump(out, f, default=list)
"""


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_slurm_sbatch_two_nodes_of_eight_gpus(platform, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "python").write_text(FAKE_PYTHON.format(python=sys.executable))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX_JAX_", "SLURM_", "XLA_"))}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        PYTHONPATH=str(REPO),
        PYTHON=str(bin_dir / "python"),
        FAKE_OUT=str(tmp_path),
        FLUX_JAX_PLATFORM=platform,
        SLURM_JOB_ID="4242",
        SLURM_NNODES="2",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NTASKS="2",
        SLURM_JOB_NODELIST="mi300x-[017-018]",
        SLURM_SUBMIT_DIR=str(tmp_path),
        SLURM_GPUS_ON_NODE="8",
    )
    cmd = ["bash", str(REPO / "launch" / "slurm.sbatch"), "configs/flux_12b.py", "--config.mesh.fsdp=-1"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    srun = (tmp_path / "srun_args").read_text().split()
    assert "--kill-on-bad-exit=1" in srun and "--ntasks-per-node=1" in srun
    workdir = str(tmp_path / "runs" / "4242")
    expected_argv = ["-m", "flux_jax.train", "--config", "configs/flux_12b.py", "--workdir", workdir]
    port = 4242 % 4096 + 61440
    for rank in range(2):
        task = json.loads((tmp_path / f"task_{rank}.json").read_text())
        assert task["argv"] == expected_argv + ["--config.mesh.fsdp=-1"]
        # Every task: process `rank` of 2, coordinator on the first node, all 8 GPUs of its node.
        assert task["settings"] == {
            "coordinator_address": f"mi300x-017:{port}",
            "num_processes": 2,
            "process_id": rank,
            "local_device_ids": None,
            "heartbeat_timeout_s": 100,
            "init_timeout_s": 300,
        }
        tenv = task["env"]
        assert "--xla_gpu_enable_latency_hiding_scheduler=true" in tenv["XLA_FLAGS"]
        assert float(tenv["XLA_PYTHON_CLIENT_MEM_FRACTION"]) > 0.75
        if platform == "rocm":
            assert tenv["HSA_FORCE_FINE_GRAIN_PCIE"] == "1" and "CUDA_DEVICE_MAX_CONNECTIONS" not in tenv
        else:
            assert tenv["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and "HSA_FORCE_FINE_GRAIN_PCIE" not in tenv
    bad = subprocess.run(
        cmd, env=env | {"FLUX_JAX_PLATFORM": "tpu"}, cwd=REPO, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "FLUX_JAX_PLATFORM must be rocm or cuda" in bad.stderr
