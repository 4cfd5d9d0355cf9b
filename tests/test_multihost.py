"""Multi-process training through the real CLI: ``launch/local.sh 2`` (2 CPU devices each) against one
process with 4 devices, on the tiny preset: losses, data, outputs, checkpoints across process counts,
SIGTERM and kill -9. One-process runs share a JAX compilation cache (local.sh drops it for CPU jobs of
several processes, where cached executables can deadlock the first collective)."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
HEARTBEAT_S = 10
TINY = (
    "--config=configs/toy.py",
    "--config.model.preset=tiny",
    "--config.data.image_size=32",
    "--config.data.txt_len=4",
    "--config.global_batch_size=8",
    "--config.micro_batch_size=2",
    "--config.lr_warmup_iters=1",
    "--config.log_interval=1",
    "--config.eval_interval=0",
    "--config.data.log_ids=True",
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    # Under xdist the workers share the session directory above their own.
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / "jax_compilation_cache"
    path.mkdir(exist_ok=True)
    return path


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(cache_dir, devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX_JAX_", "SLURM_", "JAX_", "XLA_"))}
    env.update(
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        PYTHON=sys.executable,
        JAX_PLATFORMS="cpu",
        FLUX_JAX_PORT=str(_free_port()),
        FLUX_JAX_LOCAL_DEVICES=str(devices),
        FLUX_JAX_HEARTBEAT_TIMEOUT=str(HEARTBEAT_S),
    )
    if cache_dir is not None:
        env.update(
            JAX_COMPILATION_CACHE_DIR=str(cache_dir),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
    return env


def start(cache_dir, workdir, num: int, devices: int, *args, logs=None, command="flux_jax.train"):
    """launch/local.sh NUM -m COMMAND ...; each process's output in ``logs``/process_<i>.log."""
    env = _env(cache_dir, devices)
    if logs is not None:
        env["FLUX_JAX_LOG_DIR"] = str(logs)
    cmd = ["bash", str(REPO / "launch" / "local.sh"), str(num), "-m", command]
    cmd += ["--workdir", str(workdir), *TINY, *args] if command == "flux_jax.train" else list(args)
    proc = subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    proc.logs = logs
    return proc


def finish(proc, timeout=300) -> str:
    """Waits for a launch; its output, or a failure showing every process's last lines."""
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0 and proc.logs is not None:
        out += "".join(f"\n--- {p.name}\n" + p.read_text()[-3000:] for p in sorted(Path(proc.logs).iterdir()))
    assert proc.returncode == 0, out[-8000:]
    return out


def one_process(cache_dir, workdir, *args) -> str:
    """The reference: plain ``python -m flux_jax.train`` (no launcher variables) on 4 CPU devices."""
    env = _env(cache_dir, 4)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    cmd = [sys.executable, "-m", "flux_jax.train", "--workdir", str(workdir), *TINY, *args]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc.stderr


def metrics(workdir, split="train") -> dict[int, dict]:
    """metrics.jsonl by step (a resumed run repeats the steps after its checkpoint: the last wins)."""
    rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["split"] == split}


def losses(workdir, split="train") -> dict[int, float]:
    return {step: r["loss"] for step, r in metrics(workdir, split).items()}


def ids_by_step(workdir, num: int) -> dict[int, list[str]]:
    """The global batch of every step all ``num`` processes logged: their id blocks in process order
    (a resumed run repeats the steps after its checkpoint: the last line wins)."""
    per_process = []
    for p in range(num):
        lines = (Path(workdir) / "data_ids" / f"process_{p}.jsonl").read_text().splitlines()
        per_process.append({r["step"]: r["ids"] for r in map(json.loads, lines)})
    steps = sorted(set.intersection(*(set(d) for d in per_process)))
    return {step: sum((d[step] for d in per_process), []) for step in steps}


def assert_losses_equal(got: dict, want: dict, steps) -> None:
    steps = list(steps)
    assert all(s in got for s in steps), (sorted(got), steps)
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-5)


def read_state(workdir, step=None):
    """The saved train state of a step (default latest) as numpy arrays, and its data position."""
    import jax
    import orbax.checkpoint as ocp

    root = Path(workdir) / "checkpoints"
    step = step if step is not None else max(int(p.name) for p in root.iterdir() if p.name.isdigit())
    checkpointer = ocp.PyTreeCheckpointer()
    meta = checkpointer.metadata(root / str(step) / "state").item_metadata.tree
    args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    state = checkpointer.restore(root / str(step) / "state", args=ocp.args.PyTreeRestore(restore_args=args))
    data_state = json.loads((root / str(step) / "data" / "metadata").read_text())
    return step, state, data_state


def assert_states_equal(a, b) -> None:
    import jax

    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = dict(jax.tree_util.tree_flatten_with_path(b)[0])
    assert len(flat_a) == len(flat_b)
    for path, x in flat_a:
        np.testing.assert_allclose(x, flat_b[path], rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


_GLOO_NOTE = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks is : "
)


def quiet_log(path) -> list[str]:
    """Lines of a non-zero process's log other than the CPU collectives' (gloo's) connection notes.

    gloo writes those notes from several threads at once, so one can be cut by another and end on a
    line of its own (its peer count, e.g. "3"); what is left of such a line is dropped too."""
    lines = (_GLOO_NOTE.sub("", line).strip() for line in Path(path).read_text().splitlines())
    return [line for line in lines if line and not line.isdigit()]


def test_data_parallel_matches_one_process_and_writes_outputs_once(cache_dir, tmp_path):
    args = (
        "--config.mesh.data=4",
        "--config.data.log_ids=True",  # in TINY too: the ids below are what this field writes
        "--config.train_iters=3",
        "--config.eval_interval=3",
        "--config.eval_iters=1",
    )
    one_process(cache_dir, tmp_path / "one", *args)
    two = tmp_path / "two"
    finish(start(cache_dir, two, 2, 2, *args, logs=tmp_path / "logs"))

    assert_losses_equal(losses(two), losses(tmp_path / "one"), [1, 2, 3])
    assert_losses_equal(losses(two, "val"), losses(tmp_path / "one", "val"), [3])
    # Toy data: the two processes' blocks of each step make the one-process global batch.
    ids = ids_by_step(two, 2)
    assert ids == ids_by_step(tmp_path / "one", 1)
    flat = sum(ids.values(), [])
    assert len(flat) == 3 * 8 and len(set(flat)) == len(flat)
    # Outputs once: one line per step and split, every line whole; one TensorBoard file; a config.
    lines = (two / "metrics.jsonl").read_text().splitlines()
    assert [(r["split"], r["step"]) for r in map(json.loads, lines)] == [
        ("train", 1),
        ("train", 2),
        ("train", 3),
        ("val", 3),
    ]
    assert len(list((two / "tensorboard").iterdir())) == 1
    assert json.loads((two / "config.json").read_text())["mesh"]["data"] == 4
    assert quiet_log(tmp_path / "logs" / "process_1.log") == []
    log0 = (tmp_path / "logs" / "process_0.log").read_text()
    assert "validation loss" in log0 and "agrees on all 2 processes" in log0
    # Sampling as a two-process job: process 0 writes the images and reports once.
    out = finish(
        start(cache_dir, None, 2, 2, "--workdir", str(two), "--config", "configs/toy.py", "--out",
              str(tmp_path / "samples"), "--num_steps", "2", "--num_images", "2", command="flux_jax.sample")
    )  # fmt: skip
    assert out.count("step 3: 2 samples") == 1, out
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == [
        "000.png",
        "001.png",
        "grid.png",
        "prompts.txt",
    ]


def test_fsdp_tensor_fp8_hybrid_matches_one_process(cache_dir, tmp_path):
    # tensor=2 within each process, fsdp=2 across the two; two micro batches per step.
    args = ("--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.tensor=2", "--config.fp8=hybrid")
    args += ("--config.train_iters=3",)
    one_process(cache_dir, tmp_path / "one", *args)
    finish(start(cache_dir, tmp_path / "two", 2, 2, *args, logs=tmp_path / "logs"))
    assert_losses_equal(losses(tmp_path / "two"), losses(tmp_path / "one"), [1, 2, 3])
    assert (
        "the train state at step 3 agrees on all 2 processes"
        in (tmp_path / "logs" / "process_0.log").read_text()
    )
    _, two, _ = read_state(tmp_path / "two")
    _, one, _ = read_state(tmp_path / "one")
    assert two["fp8_meta"] and two["fp8_meta"].keys() == one["fp8_meta"].keys()
    assert_states_equal(two["fp8_meta"], one["fp8_meta"])


def _write_shards(path: Path, n: int = 20) -> Path:
    from flux_jax import shards

    rng = np.random.default_rng(0)
    samples = [
        {
            "id": f"rec-{i:02d}",
            "mean": rng.standard_normal((16, 4, 4)).astype(np.float32),
            "logvar": np.full((16, 4, 4), -4.0, np.float32),
            "t5_encodings": rng.standard_normal((4, 32)).astype(np.float32),
            "clip_encodings": rng.standard_normal(32).astype(np.float32),
        }
        for i in range(n)
    ]
    shards.write_shard(path / shards.shard_name(0), samples[: n // 2])
    shards.write_shard(path / shards.shard_name(1), samples[n // 2 :])
    shards.write_empty_encodings(path, np.zeros((4, 32)), np.zeros(32))
    return path


def _children(launcher: subprocess.Popen) -> dict[int, int]:
    """process id -> pid of the processes local.sh started."""
    pids = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    out = {}
    for pid in map(int, pids):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = [e for e in env if e.startswith(b"FLUX_JAX_PROCESS_ID=")]
        out[int(rank[0].split(b"=")[1])] = pid
    return out


def _wait_for_step(workdir, launcher, step: int, timeout=300) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert launcher.poll() is None, launcher.communicate()[0][-6000:]
        done = max(losses(workdir), default=0) if (Path(workdir) / "metrics.jsonl").exists() else 0
        if done >= step:
            return done
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not reached in {timeout} s")


def test_checkpoints_preemption_and_faults_across_process_counts(cache_dir, tmp_path):
    """data=2 x fsdp=2, FP8 (e4m3, delayed), shards. Against one uninterrupted one-process run:
    SIGTERM to both processes -> one agreed checkpoint, exit 0; restart on 2 processes, kill -9 of
    process 1 -> process 0 stops by itself within the heartbeat timeout; restart -> finishes. The
    SIGTERM checkpoint also resumes on 1 process x 4 devices and 4 processes x 1 device."""
    data = _write_shards(tmp_path / "shards")
    args = ("--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.fp8=e4m3", "--config.train_iters=8")
    args += ("--config.save_interval=2", "--config.data.source=shards", f"--config.data.path={data}")
    args += (f"--config.data.val_path={data}",)
    ref = tmp_path / "ref"
    one_process(cache_dir, ref, *args)
    want = losses(ref)
    # No record twice in an epoch (20 records, 8 a step), and every epoch covers them all.
    ref_ids = ids_by_step(ref, 1)
    flat = sum((ref_ids[s] for s in sorted(ref_ids)), [])
    assert sorted(flat[:20]) == sorted(flat[20:40]) == [f"rec-{i:02d}" for i in range(20)]

    # SIGTERM to every process (what SLURM does) once step 2 is done.
    run = tmp_path / "run"
    launcher = start(cache_dir, run, 2, 2, *args, logs=tmp_path / "logs_a")
    _wait_for_step(run, launcher, 2)
    for pid in _children(launcher).values():
        os.kill(pid, signal.SIGTERM)
    finish(launcher)
    stopped, _, data_state = read_state(run)
    assert stopped == max(losses(run)) and 2 <= stopped < 6, stopped
    assert "Stopped by SIGTERM" in (tmp_path / "logs_a" / "process_0.log").read_text()
    assert quiet_log(tmp_path / "logs_a" / "process_1.log") == []
    for copy in ("one", "four"):
        shutil.copytree(run, tmp_path / copy)

    # Restart on 2; kill -9 process 1 once a later checkpoint exists.
    launcher = start(cache_dir, run, 2, 2, *args, logs=tmp_path / "logs_b")
    target = (stopped // 2 + 1) * 2 + 1
    _wait_for_step(run, launcher, target)
    if launcher.poll() is None and max(losses(run)) < 8:
        killed_at = time.time()
        os.kill(_children(launcher)[1], signal.SIGKILL)
        out, _ = launcher.communicate(timeout=HEARTBEAT_S + 120)
        assert launcher.returncode != 0
        assert time.time() - killed_at < HEARTBEAT_S + 60
        assert "stopped sending heartbeats" in (tmp_path / "logs_b" / "process_0.log").read_text()
    else:
        pytest.fail("the restarted run finished before process 1 could be killed")
    finish(start(cache_dir, run, 2, 2, *args, logs=tmp_path / "logs_c"))

    # Every step of the interrupted chain, and of the resumes on 1 x 4 and 4 x 1, equals the reference.
    finish(start(cache_dir, tmp_path / "one", 1, 4, *args))
    finish(start(cache_dir, tmp_path / "four", 4, 1, *args))
    assert_losses_equal(losses(run), want, range(1, 9))
    _, final, final_data = read_state(ref)
    for workdir, num in ((run, 2), (tmp_path / "one", 1), (tmp_path / "four", 4)):
        assert_losses_equal(losses(workdir), want, range(stopped + 1, 9))
        step, state, data_state = read_state(workdir)
        assert step == 8 and data_state == final_data
        assert_states_equal(state, final)
        ids = ids_by_step(workdir, num)
        assert all(ids[s] == ref_ids[s] for s in range(stopped + 1, 9))
