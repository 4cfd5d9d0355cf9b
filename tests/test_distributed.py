"""Multi-process start-up: environment parsing, and a real 2-process CPU run via launch/local.sh."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from flux_jax import distributed

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
    return json.loads(lines[0][len("RESULT ") :])


def test_two_processes_match_one(tmp_path):
    import numpy as np

    one = _run(1, 2, tmp_path)
    two = _run(2, 2, tmp_path)
    assert (one["n"], one["devices"]) == (1, 2)
    assert (two["n"], two["devices"]) == (2, 4)
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-6)
    np.testing.assert_allclose(two["grad"], one["grad"], rtol=1e-5, atol=1e-7)


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
        }
    )
    assert s == distributed.DistributedSettings(False, "node0:1234", 4, 3, (0, 1))


def test_slurm_env_uses_auto_detection():
    s = distributed.settings_from_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"})
    assert s is not None and s.auto
    assert distributed.settings_from_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None


def _env(coordinator="h:1", num="2", pid="0"):
    return {"FLUX_JAX_COORDINATOR": coordinator, "FLUX_JAX_NUM_PROCESSES": num, "FLUX_JAX_PROCESS_ID": pid}


@pytest.mark.parametrize(
    "env, field",
    [
        ({"FLUX_JAX_COORDINATOR": "h:1"}, "FLUX_JAX_NUM_PROCESSES"),
        (_env(pid="2"), "PROCESS_ID"),
        (_env(coordinator="h"), "host:port"),
        (_env(num="x"), "integer"),
    ],
)
def test_bad_env_raises(env, field):
    with pytest.raises(ValueError, match=field):
        distributed.settings_from_env(env)
