"""Every ``python -m flux_jax.*`` command, run as a user would: bad input gives one error block naming
the field or file and the fix, exit status 2 and no traceback; --help exits 0."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One CPU device compiles faster; the tests run the repository's code.
ENV = os.environ | {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
TINY = [
    "--config.model.preset=tiny",
    "--config.data.image_size=32",
    "--config.data.txt_len=4",
    "--config.micro_batch_size=1",
    "--config.global_batch_size=1",
    "--config.lr_warmup_iters=1",
    "--config.log_interval=1",
    "--config.eval_interval=0",
    "--config.save_interval=0",
    "--config.checkpoint.async_save=false",
]


def _run(module: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"flux_jax.{module}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def _bad_inputs(tmp):
    a_file = os.path.join(tmp, "a_file")  # the test writes it: a file where a directory should be
    train = ["--config", "configs/toy.py", "--workdir", os.path.join(tmp, "w")]
    return {
        "train_typo": (
            "train",
            [*train, "--config.learning_rate=1e-3", "--config.lr=fast"],
            ["--config.learning_rate: unknown field. Did you mean --config.lr?", "--config.lr='fast'"],
        ),
        "train_bad_values_and_fp8": (
            "train",
            [
                *train,
                "--config.lr=-1",
                "--config.data.image_size=100",
                "--config.fp8=e4m3",
                "--config.fp8_recipe=fancy",
                "--config.fp8_margin=-1",
                "--config.fp8_amax_compute_algo=mean",
            ],
            [
                "Invalid config (5 problems):",
                "lr=-1.0",
                "data.image_size=100 must be a multiple of 16",
                "fp8_recipe='fancy' must be one of",
                "fp8_margin=-1 must be >= 0",
                "fp8_amax_compute_algo='mean' is unknown",
            ],
        ),
        "train_missing_config": (
            "train",
            ["--config", "configs/nope.py", "--workdir", tmp],
            ["--config configs/nope.py: no such config file", "configs/toy.py"],
        ),
        "train_unwritable_workdir": (
            "train",
            ["--config", "configs/toy.py", "--workdir", os.path.join(a_file, "w"), *TINY],
            [f"--workdir {os.path.join(a_file, 'w')}: cannot write there"],
        ),
        "train_missing_shards": (
            "train",
            [*train, *TINY, "--config.data.source=shards", f"--config.data.path={tmp}/no_shards"],
            [f"shard directory {tmp}/no_shards does not exist: set data.path"],
        ),
        "train_missing_weights": (
            "train",
            [*train, *TINY, f"--config.init_from={tmp}/flux.safetensors"],
            [f"config.init_from={tmp}/flux.safetensors does not exist"],
        ),
        "convergence_bad_recipe": (
            "convergence",
            [*train, "--recipes=bf16,fp4"],
            ["Unknown recipe 'fp4' in --recipes"],
        ),
        "sample_missing_workdir": (
            "sample",
            ["--workdir", f"{tmp}/nowhere", "--config", "configs/toy.py", "--out", tmp],
            [f"--workdir {tmp}/nowhere does not exist"],
        ),
        "checkpoint_export_missing_workdir": (
            "checkpoint",
            ["export", "--workdir", f"{tmp}/nowhere", "--output", f"{tmp}/x.safetensors"],
            [f"No checkpoint in {tmp}/nowhere/checkpoints (found []). Fix: pass the --workdir"],
        ),
        "convert_missing_input": (
            "convert",
            ["--input", f"{tmp}/flux1.safetensors", "--preset", "tiny", "--output", f"{tmp}/out"],
            [f"--input {tmp}/flux1.safetensors: no .safetensors file found"],
        ),
        "prepare_missing_images": (
            "prepare",
            ["images", f"{tmp}/photos", "--out", f"{tmp}/s", "--vae", "v", "--t5", "t", "--clip", "c"],
            [f"image folder {tmp}/photos does not exist"],
        ),
    }


@pytest.mark.parametrize("case", list(_bad_inputs("TMP")))
def test_bad_input_is_one_error_without_traceback(case, tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    module, args, expected = _bad_inputs(str(tmp_path))[case]
    proc = _run(module, *args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: "), proc.stderr[-3000:]
    for text in expected:
        assert text in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize(
    "module,args,expected",
    [
        ("train", ["--help"], ["--config.FIELD=VALUE", "--workdir"]),
        ("train", ["--config", "configs/toy.py", "--help"], ["--config.lr=0.001", "peak learning rate"]),
        ("convergence", ["--help"], ["--config.FIELD=VALUE", "--recipes", "--tolerance"]),
        ("doctor", ["--help"], ["verdict"]),
        ("prepare", ["--help"], ["--records-per-shard", "samples per shard file", "--empty", "--device"]),
    ],
)
def test_help_exits_zero(module, args, expected):
    proc = _run(module, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in expected:
        assert text in proc.stdout


def test_train_stopped_by_ctrl_c_saves_exits_130_and_a_finished_workdir_is_not_retrained(tmp_path):
    workdir = str(tmp_path / "w")
    cmd = [sys.executable, "-m", "flux_jax.train", "--config", "configs/toy.py", "--workdir", workdir]
    cmd += [*TINY, "--config.train_iters=100000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = os.path.join(workdir, "metrics.jsonl")
    deadline = time.time() + 500  # start-up and the first compile, on shared CI cores
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(metrics) and len(open(metrics).read().splitlines()) >= 2:
            break
        time.sleep(0.2)
    # Ctrl-C, then Ctrl-C again and the terminal closing while the checkpoint is written.
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGHUP):
        proc.send_signal(sig)
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "Training tiny in " in stderr and "(starting at step 0 of 100000)" in stderr
    assert "1 x cpu" in stderr and "FP8 off" in stderr
    assert "Received SIGINT: saving a checkpoint" in stderr
    steps = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")) if s.isdigit())
    assert len(steps) == 1 and f"Stopped by SIGINT after step {steps[0]}" in stderr
    assert f"latest checkpoint: step {steps[0]}" in stderr and "(exit status 130)" in stderr
    logged = [json.loads(line)["step"] for line in open(metrics)]
    assert logged == list(range(1, steps[0] + 1))
    # Log lines start a line of their own (tqdm.write clears the bar first), never glued to the bar.
    assert len(re.findall(r"(?:^|[\r\n])\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", stderr)) >= 4
    assert not re.search(r"[^\r\n]\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", stderr), stderr[-3000:]

    # The same workdir with train_iters at the saved step is a finished run: said so, exit 0.
    again = _run(
        "train", "--config", "configs/toy.py", "--workdir", workdir, *TINY, f"--config.train_iters={steps[0]}"
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{workdir} already holds a finished run: checkpoint at step {steps[0]}" in again.stderr
    assert "Training tiny" not in again.stderr


def test_unreadable_weights_files_are_user_errors(tmp_path):
    from pathlib import Path

    from flux_jax import checkpoint, convert
    from flux_jax.errors import UserError

    bad = tmp_path / "flux1.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match=r"--input .*flux1\.safetensors: unreadable safetensors file"):
        convert._read_safetensors(Path(bad))
    with pytest.raises(UserError, match=r"config\.init_from: .*flux1\.safetensors is not a readable"):
        checkpoint._read_safetensors([bad])
