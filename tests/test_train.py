import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flux_jax import metrics, model, optim, setup, train


def _lines(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_train_bf16_end_to_end_and_resume(tiny_config, tmp_path):
    workdir = str(tmp_path)
    result = train.train_and_evaluate(tiny_config(), workdir)
    assert result["steps"] == 3 and np.isfinite(result["train_loss"]) and np.isfinite(result["val_loss"])
    lines = _lines(workdir)
    train_lines = [x for x in lines if x["split"] == "train"]
    assert [x["step"] for x in train_lines] == [1, 2, 3]
    for key in ("loss", "grad_norm", "lr", "steps_per_sec", "images_per_sec", "nonfinite_skipped"):
        assert key in train_lines[-1]
    # Host memory everywhere; device allocator peaks where the backend keeps them (GPU).
    assert 0.05 < train_lines[-1]["host_peak_rss_gib"] < 64
    if jax.default_backend() == "gpu":
        assert 0 < train_lines[-1]["peak_memory_gib"] <= train_lines[-1]["memory_limit_gib"]
    val = [x for x in lines if x["split"] == "val"][-1]
    assert all(f"loss_t{k}" in val for k in range(8))
    assert json.load(open(os.path.join(workdir, "config.json")))["model"]["preset"] == "tiny"
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "3"))
    # Resuming continues from the saved step instead of starting over.
    resumed = train.train_and_evaluate(tiny_config(train_iters=4), workdir)
    assert resumed["steps"] == 4
    assert [x["step"] for x in _lines(workdir) if x["split"] == "train"][3:] == [4]


def test_train_fp8_end_to_end(tiny_config, tmp_path):
    # On a data=2 x fsdp=4 mesh with two micro batches per step: the kernel casts made once per step
    # (fp8_cache_weights, the config default) are sharded like the params they come from.
    config = tiny_config(
        fp8="e4m3", train_iters=2, eval_interval=0, global_batch_size=16, **{"mesh.data": 2, "mesh.fsdp": 4}
    )
    assert config.fp8_cache_weights
    result = train.train_and_evaluate(config, str(tmp_path))
    assert result["fp8"] and np.isfinite(result["train_loss"])
    last = _lines(str(tmp_path))[-1]
    assert last["scale_min"] > 0 and last["amax_max"] > 0


def test_metrics_read_one_step_late_match_every_step_reads(tiny_config, tmp_path):
    # log_interval 2 reads steps 1 and 3 only after the next step is queued; the logged means
    # must equal those of a run that reads every step at once (log_interval 1).
    every = dict(train_iters=5, eval_interval=0, save_interval=0)
    train.train_and_evaluate(tiny_config(**every), str(tmp_path / "a"))
    train.train_and_evaluate(tiny_config(**every, log_interval=2), str(tmp_path / "b"))
    a = [x["loss"] for x in _lines(str(tmp_path / "a")) if x["split"] == "train"]
    b = [x for x in _lines(str(tmp_path / "b")) if x["split"] == "train"]
    assert [x["step"] for x in b] == [2, 4, 5]
    np.testing.assert_allclose([x["loss"] for x in b], [np.mean(a[0:2]), np.mean(a[2:4]), a[4]], rtol=1e-6)


def _nan_pipeline(monkeypatch):
    real = setup.make_pipeline

    def pipeline(config, split, *args, **kwargs):
        it = real(config, split, *args, **kwargs)
        if split != "train":
            return it

        class Poisoned:
            get_state, set_state = it.get_state, it.set_state

            def __next__(self):
                b = next(it)
                return b | {"img": np.full_like(b["img"], np.nan)}

        return Poisoned()

    monkeypatch.setattr(setup, "make_pipeline", pipeline)


def test_nonfinite_steps_switch_fp8_to_bf16_then_stop(tiny_config, tmp_path, monkeypatch, caplog):
    _nan_pipeline(monkeypatch)
    config = tiny_config(
        fp8="e4m3", on_nonfinite="bf16", max_nonfinite_steps=2, train_iters=10, log_interval=10
    )
    config.eval_interval = config.save_interval = 0
    with caplog.at_level("WARNING"), pytest.raises(FloatingPointError, match=r"2 consecutive .*\(3\.\.4\)"):
        train.train_and_evaluate(config, str(tmp_path))
    assert "Non-finite steps 1-2 under FP8: switching to BF16" in caplog.text


def test_signal_saves_the_step_and_resume_continues(tiny_config, tmp_path, monkeypatch):
    from flux_jax import preemption

    class SignalAtStep3(preemption.PreemptionGuard):
        calls = 0

        def preempted(self, can_sync=True):
            SignalAtStep3.calls += 1
            return SignalAtStep3.calls == 3

    monkeypatch.setattr(preemption, "install_handler", lambda: SignalAtStep3())
    config = tiny_config(train_iters=6, log_interval=5, eval_interval=0, save_interval=0)
    result = train.train_and_evaluate(config, str(tmp_path))
    assert result["preempted"] and result["steps"] == 3
    assert os.path.isdir(os.path.join(tmp_path, "checkpoints", "3"))
    monkeypatch.setattr(preemption, "install_handler", preemption.PreemptionGuard)
    assert train.train_and_evaluate(config, str(tmp_path))["steps"] == 6


def test_resume_drops_what_was_logged_after_the_restored_step(tiny_config, tmp_path, caplog):
    # A run that logged step 5 but died before saving it resumes from step 4: metrics.jsonl and
    # TensorBoard must hold each step once, from the run that trained it last.
    import shutil

    workdir = str(tmp_path)
    config = tiny_config(train_iters=5, save_interval=2, eval_interval=0, log_interval=1)
    first = train.train_and_evaluate(config, workdir)
    shutil.rmtree(os.path.join(workdir, "checkpoints", "5"))
    resumed = train.train_and_evaluate(config, workdir)
    assert resumed["steps"] == 5
    assert [x["step"] for x in _lines(workdir)] == [1, 2, 3, 4, 5]
    assert _lines(workdir)[-1]["loss"] == pytest.approx(first["train_loss"], rel=1e-5)
    events = metrics.read_events(os.path.join(workdir, "tensorboard"))
    loss_steps = [e.step for e in events for v in e.summary.value if v.tag == "train/loss"]
    assert sorted(loss_steps) == [1, 2, 3, 4, 5]
    assert len(os.listdir(os.path.join(workdir, "tensorboard"))) == 2
    # A finished workdir trains nothing and says so.
    with caplog.at_level("INFO", logger="flux_jax.train"):
        again = train.train_and_evaluate(config, workdir)
    assert again["steps"] == 5 and "already holds a finished run: checkpoint at step 5" in caplog.text
    assert [x["step"] for x in _lines(workdir)] == [1, 2, 3, 4, 5]


def test_truncate_keeps_lines_and_events_up_to_the_step(tmp_path):
    from tensorboardX import SummaryWriter

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": float(s)} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')  # cut mid-write
    assert metrics.truncate_jsonl(str(path), 2) == 2
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    writer = SummaryWriter(str(tmp_path / "tb"))
    for s in (1, 2, 3):
        writer.add_scalar("train/loss", float(s), s)
    writer.close()
    assert metrics.truncate_events(str(tmp_path / "tb"), 2) == 1
    events = metrics.read_events(str(tmp_path / "tb"))
    scalars = [(e.step, e.summary.value[0].simple_value) for e in events if e.summary.value]
    assert scalars == [(1, 1.0), (2, 2.0)]


@pytest.mark.parametrize(
    "field,value",
    [
        ("fp8_recipe", "fancy"),
        ("fp8_amax_history_len", 0),
        ("global_batch_size", 12),
        ("lr_decay_style", "linear"),
        ("timestep_sampling", "cosine"),
        ("model.preset", "huge"),
        ("data.source", "web"),
        ("on_nonfinite", "ignore"),
        ("adam_beta2", 1.0),
        ("data.cfg_dropout_prob", 1.5),
    ],
)
def test_invalid_config_names_field(tiny_config, field, value, tmp_path):
    overrides = {field: value} | ({"fp8": "e4m3"} if field.startswith("fp8_") else {})
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        train.train_and_evaluate(tiny_config(**overrides), str(tmp_path))
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


def test_validation_fields_steer_the_loop(tiny_config, tmp_path, monkeypatch):
    # eval_interval=2 validates after step 2 with eval_iters=3 batches; a target_val_loss above any
    # loss stops the run there, with a checkpoint, instead of running all 6 steps.
    drawn = []
    real = setup.make_pipeline

    def pipeline(config, split, *args, **kwargs):
        it = real(config, split, *args, **kwargs)

        class Counting:
            get_state, set_state = it.get_state, it.set_state

            def __next__(self):
                drawn.append(split)
                return next(it)

        return Counting()

    monkeypatch.setattr(setup, "make_pipeline", pipeline)
    config = tiny_config(train_iters=6, eval_interval=2, eval_iters=3, save_interval=0, target_val_loss=100.0)
    result = train.train_and_evaluate(config, str(tmp_path))
    assert result["steps"] == 2 and result["val_loss"] <= 100.0
    assert drawn.count("val") == 1 + 3  # the start-up check, then eval_iters batches
    assert [x["step"] for x in _lines(str(tmp_path)) if x["split"] == "val"] == [2]
    assert os.listdir(os.path.join(tmp_path, "checkpoints")) == ["2"]


def test_steps_compile_at_start_up_and_the_loop_compiles_nothing(tiny_config, tmp_path, caplog):
    # Logging, checkpoints and two validation passes (the first one at step 2, right after start-up)
    # run programs compiled before the first step: no XLA compile happens on the loop's thread.
    config = tiny_config(train_iters=4, eval_interval=2, eval_iters=2, save_interval=2, log_interval=1)
    with caplog.at_level("INFO", logger="flux_jax.train"):
        result = train.train_and_evaluate(config, str(tmp_path))
    assert result["steps"] == 4 and np.isfinite(result["val_loss"])
    # On this 8-device mesh Orbax's replica-parallel save slices each replicated array once per shape
    # at the first checkpoint (jit(slice)); steps, logging and validation compile nothing.
    assert {c.where for c in result["loop_compiles"]} <= {"the checkpoint save after step 2"}
    assert {c.name for c in result["loop_compiles"]} <= {"jit(slice)"}
    assert "Compiled the train step in" in caplog.text
    assert "Compiled the eval step (in the background) in" in caplog.text
    assert "step 2: validation loss" in caplog.text and "step 4: validation loss" in caplog.text
    # The logged learning rate is the schedule's at the step count, as the optimizer applies it.
    lrs = [x["lr"] for x in _lines(str(tmp_path)) if x["split"] == "train"]
    np.testing.assert_allclose(lrs, [float(optim.lr_schedule(config)(s)) for s in range(4)], rtol=1e-6)


def test_train_command_compiles_before_the_loop_and_validates_without_compiling(tmp_path):
    # The real command, FP8, one CPU device: the start-up log names both compiles and the loop
    # (steps, logs, two checkpoints, two validation passes) compiles nothing.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = os.environ | {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    overrides = "model.preset=tiny data.image_size=32 data.txt_len=4 micro_batch_size=1 global_batch_size=2"
    overrides += " train_iters=4 eval_interval=2 eval_iters=2 save_interval=2 log_interval=1"
    cmd = [sys.executable, "-m", "flux_jax.train", "--config", "configs/toy.py:fp8", "--workdir"]
    cmd += [str(tmp_path), *(f"--config.{o}" for o in overrides.split())]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Compiled the FP8 train step in" in proc.stderr
    assert "Compiled the FP8 eval step (in the background) in" in proc.stderr
    assert "step 2: validation loss" in proc.stderr and "step 4: validation loss" in proc.stderr
    assert "XLA compiled inside the train loop" not in proc.stderr, proc.stderr[-3000:]


def test_validation_matches_the_eager_formula(tiny_config, tmp_path):
    # The compiled pass equals the per-batch loss of the eager forward at t = k / 8 with
    # fold_in(eval_rng, i) noise, averaged per timestep: the accumulation moved into the step.
    from flux_jax import checkpoint, flow, sharding, steps

    config = tiny_config(train_iters=1, eval_interval=1, eval_iters=2, save_interval=1)
    result = train.train_and_evaluate(config, str(tmp_path))
    run = setup.build(config)
    ckpt = checkpoint.Checkpointer(str(tmp_path), config)
    state, _ = ckpt.restore(1, setup.abstract_state(run)[0])
    ckpt.close()
    eval_rng = jax.random.split(jax.random.key(config.seed), 3)[2]
    sums = counts = 0.0
    val_iter = setup.make_pipeline(config, "val")
    for i in range(config.eval_iters):
        batch = {k: v for k, v in next(val_iter).items() if k != "id"}
        batch = sharding.host_local_batch_to_global(batch, run.mesh)
        x0 = batch["img"]
        t = flow.validation_timesteps(batch["timestep"])
        x_t, target = flow.noise(x0, jax.random.normal(jax.random.fold_in(eval_rng, i), x0.shape), t)
        pred = steps.forward(run.net, state["params"], {}, batch, t, x_t, config.guidance_scale)
        s, c = flow.accumulate_by_timestep(flow.per_sample_loss(pred, target), batch["timestep"])
        sums, counts = sums + s, counts + c
    np.testing.assert_allclose(result["val_loss"], float(flow.validation_loss(sums, counts)[0]), rtol=1e-5)


def test_lr_schedule_and_decay_mask(tiny_config):
    config = tiny_config(lr=1e-3, min_lr=1e-4, lr_warmup_iters=10, train_iters=110)
    sched = optim.lr_schedule(config)
    np.testing.assert_allclose([sched(0), sched(5), sched(10), sched(110)], [0, 5e-4, 1e-3, 1e-4], rtol=1e-5)
    config.lr_decay_style = "constant"
    np.testing.assert_allclose(optim.lr_schedule(config)(100), 1e-3)
    mask = optim.decay_mask(
        {"a": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}, "norm": {"scale": jnp.ones(2)}}
    )
    assert mask == {"a": {"kernel": True, "bias": False}, "norm": {"scale": False}}


def test_flops_formula_matches_mlperf_figure():
    # MLPerf's MODEL_TFLOP_PER_SAMPLE for FLUX.1-schnell at 256 px is 20.3.
    flops = metrics.train_flops_per_sample(model.PRESETS["flux-schnell"], 256, 256)
    assert abs(flops / 1e12 - 20.3) < 0.5
    assert metrics.peak_flops("NVIDIA H200", fp8=True) == 1979e12
    assert metrics.peak_flops("cpu", fp8=False) is None
