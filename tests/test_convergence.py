import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from configs import toy as toy_config
from flux_jax import convergence as cv
from flux_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _runs(bf16_train, fp8_train, bf16_val=(), fp8_val=()):
    def points(values):
        return [(i + 1, float(v)) for i, v in enumerate(values)]

    return {
        "bf16": {"train": points(bf16_train), "val": list(bf16_val)},
        "fp8": {"train": points(fp8_train), "val": list(fp8_val)},
    }


def test_moving_average():
    np.testing.assert_allclose(cv.moving_average([1, 2, 3, 4], 2), [1, 1.5, 2.5, 3.5])
    np.testing.assert_allclose(cv.moving_average([1, 2, 3, 4, 5], 3), [1.5, 2, 3, 4, 4.5])
    ramp = np.arange(100.0)  # centred: a straight line is reproduced away from the ends, no lag
    np.testing.assert_allclose(cv.moving_average(ramp, 11)[5:-5], ramp[5:-5])
    np.testing.assert_allclose(cv.moving_average([1, 5], 1), [1, 5])
    assert cv.moving_average([], 5).size == 0


def test_final_train_loss_mean_of_last_steps():
    every_step = [(s, float(s)) for s in range(1, 101)]
    assert cv.final_train_loss(every_step, 10) == pytest.approx(95.5)
    # Logged every 10 steps: the last 50 steps are the points at 60..100.
    every_ten = [(s, float(s)) for s in range(10, 101, 10)]
    assert cv.final_train_loss(every_ten, 50) == pytest.approx(80.0)
    assert cv.final_train_loss(every_ten, 5) == 100.0  # fewer steps than one interval: the last point
    assert cv.final_train_loss([], 10) is None


def test_summarize_ratios_and_verdict():
    s = cv.summarize(_runs([9.0] * 10 + [0.5] * 10, [9.0] * 10 + [0.52] * 10, [(20, 0.6)], [(20, 0.63)]), 10)
    assert s["baseline"] == "bf16"
    assert s["runs"]["bf16"] == {"train_loss": 0.5, "steps": 20, "val_loss": 0.6, "val_step": 20}
    assert s["ratios"]["fp8"]["train"] == pytest.approx(1.04)
    assert s["ratios"]["fp8"]["val"] == pytest.approx(1.05)
    assert s["within"] and s["verdict"].startswith("Verdict: MET") and "+4.00%" in s["verdict"]

    over = cv.summarize(_runs([0.5] * 5, [0.5] * 5, [(5, 0.6)], [(5, 0.64)]), 5)
    assert not over["within"] and "NOT MET" in over["verdict"] and "+6.67%" in over["verdict"]
    under = cv.summarize(_runs([0.5] * 5, [0.46] * 5), 5)  # "within 5%" is two-sided
    assert not under["within"] and under["ratios"]["fp8"]["val"] is None
    assert cv.summarize(_runs([0.5] * 5, [0.49] * 5), 5, tolerance=0.05)["within"]  # no val pass: train only
    assert not cv.summarize(_runs([0.5] * 5, [math.nan] * 5), 5)["within"]
    assert not cv.summarize(_runs([0.5] * 5, []), 5)["within"]


def test_markdown_table():
    s = cv.summarize(_runs([0.5] * 4, [0.51] * 4, [(4, 0.6)], [(4, 0.6)]), 2)
    md = cv.to_markdown(s, {"wall time (s)": {"bf16": 12, "fp8": 34}})
    lines = md.splitlines()
    assert lines[0] == "|  | bf16 | fp8 | fp8/bf16 |"
    assert lines[2] == "| final train loss (mean of last 2 steps, to step 4) | 0.5000 | 0.5100 | 1.0200 |"
    assert lines[3] == "| final val loss (step 4) | 0.6000 | 0.6000 | 1.0000 |"
    assert lines[4] == "| wall time (s) | 12 | 34 |  |"
    assert lines[-1].startswith("Verdict: MET")


def test_read_metrics_keeps_last_line_of_a_repeated_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 1, "split": "train", "loss": 1.0, "steps_per_sec": 0.1},
        {"step": 2, "split": "train", "loss": 2.0, "steps_per_sec": 2.0},
        {"step": 2, "split": "val", "loss": 3.0, "loss_t0": 9.0},
        {"step": 2, "split": "train", "loss": 2.5, "steps_per_sec": 4.0},  # resumed from step 1
        {"step": 4, "split": "train", "loss": 1.5, "steps_per_sec": 1.0},  # logged every 2 steps
        {"step": 3, "split": "other", "loss": 7.0},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = cv.read_metrics(str(path))
    assert m["train"] == [(1, 1.0), (2, 2.5), (4, 1.5)] and m["val"] == [(2, 3.0)]
    assert m["seconds"] == pytest.approx(10 + 0.25 + 2)


def test_variant_config_changes_only_fp8_fields():
    base = toy_config.get_config()
    base.lock()
    fp8_fields = ("fp8", "fp8_recipe")

    def rest(c):
        return {k: v for k, v in c.to_dict().items() if k not in fp8_fields}

    assert cv.variant_config(toy_config.get_config("fp8"), "bf16").fp8 is None
    fp8 = cv.variant_config(base, "fp8")
    assert (fp8.fp8, fp8.fp8_recipe) == ("e4m3", "delayed") and rest(fp8) == rest(base)
    hybrid = cv.variant_config(base, "hybrid:tensorwise")
    assert (hybrid.fp8, hybrid.fp8_recipe) == ("hybrid", "tensorwise") and rest(hybrid) == rest(base)
    assert base.fp8 is None and base.fp8_recipe == "delayed"
    with pytest.raises(ValueError, match="Unknown recipe"):
        cv.variant_config(base, "fp4")


def test_variant_config_sets_the_fields_after_at_with_their_types(tmp_path):
    base = toy_config.get_config()
    c = cv.variant_config(base, "hybrid@adam_moments_dtype=bfloat16;model.dtype=float32;lr=3e-4")
    assert (c.fp8, c.adam_moments_dtype, c.model.dtype, c.lr) == ("hybrid", "bfloat16", "float32", 3e-4)
    assert base.adam_moments_dtype == "float32" and base.fp8 is None
    with pytest.raises(
        UserError, match=r"--recipes bf16@adam_moments_dtpe: unknown field.*bf16@adam_moments_dtype"
    ):
        cv.variant_config(base, "bf16@adam_moments_dtpe=bfloat16")
    with pytest.raises(UserError, match="not FIELD=VALUE"):
        cv.variant_config(base, "bf16@adam_moments_dtype")
    sub = cv.run_dir(str(tmp_path), "hybrid:rowwise@adam_moments_dtype=bfloat16;fp8_wgrad=false")
    assert sub == str(tmp_path / "hybrid_rowwise_adam_moments_dtype_bfloat16_fp8_wgrad_false")


@pytest.mark.parametrize("lo,hi", [(0, 300), (0.21, 1.42), (0.0, 3.0), (5.0, 5.0), (0.011, 0.0135)])
def test_nice_ticks(lo, hi):
    ticks = cv.nice_ticks(lo, hi)
    steps = np.diff(ticks)
    assert 3 <= len(ticks) <= 11 and np.allclose(steps, steps[0])
    mantissa = steps[0] / 10 ** math.floor(math.log10(steps[0]))
    assert any(math.isclose(mantissa, m) for m in (1, 2, 2.5, 5))
    assert ticks[0] >= lo - 1e-12 and ticks[0] - steps[0] < lo
    assert ticks[-1] <= max(hi, lo + 1) + 1e-12


def _count(img, color, box):
    a = np.asarray(img.crop(box))
    return int(np.all(a == color, axis=-1).sum())


def test_render_draws_curves_points_and_legend(tmp_path):
    zigzag = [1.0 + (0.1 if i % 2 else -0.1) for i in range(200)]  # mean 1.0: the average is flat
    runs = _runs(zigzag, [0.5] * 200, [(100, 1.0)], [(150, 0.5)])
    img, ax = cv.render(runs, "title", smooth=2, size=(900, 500))
    path = tmp_path / "plot.png"
    img.save(path)
    img = Image.open(path).convert("RGB")
    assert img.size == (900, 500)
    blue, orange = cv.COLORS[0], cv.COLORS[1]
    # The plot box spans the data: step 0 at the left edge, the losses inside the vertical range.
    left, top, right, bottom = ax.box
    assert ax.px(0, 0.5)[0] == left and top < ax.px(0, 1.1)[1] < ax.px(0, 0.5)[1] < bottom
    for step in (30, 60, 90):  # left of the legend
        for value, color in ((1.0, blue), (0.5, orange)):
            x, y = map(round, ax.px(step, value))
            assert _count(img, color, (x - 1, y - 3, x + 2, y + 4)) > 0, (step, value)
        # Between the two curves there is only background.
        x, y = map(round, ax.px(step, 0.75))
        assert _count(img, cv.BACKGROUND, (x - 2, y - 20, x + 3, y + 21)) == 5 * 41
    # The raw zigzag is drawn faint around the moving average.
    faint = cv._faint(blue)
    x0, y_hi = map(round, ax.px(40, 1.1))
    _, y_lo = map(round, ax.px(40, 0.9))
    assert _count(img, faint, (x0 - 10, y_hi - 2, x0 + 10, y_lo + 3)) > 20
    # Validation markers: a filled circle for the baseline, a hollow square for the other run.
    x, y = map(round, ax.px(100, 1.0))
    assert tuple(img.getpixel((x, y))) == blue
    x, y = map(round, ax.px(150, 0.5))
    assert _count(img, orange, (x - 8, y - 8, x + 9, y + 9)) > 30
    # Tick labels, axis labels, title and legend put dark pixels outside the plot box.
    dark = np.asarray(img).sum(axis=-1) < 200
    assert dark[bottom + 6 :, left:right].sum() > 100  # x tick labels and "step"
    assert dark[top:bottom, :left].sum() > 100  # y tick labels and "loss"
    assert dark[:top, :].sum() > 20  # title
    assert _count(img, blue, (right - 350, top, right, top + 120)) > 30  # legend swatches


def test_convergence_command_end_to_end(tmp_path):
    workdir = tmp_path / "conv"
    overrides = {
        "model.preset": "tiny",
        "data.image_size": 32,
        "data.txt_len": 4,
        "micro_batch_size": 2,
        "global_batch_size": 2,
        "train_iters": 4,
        "lr_warmup_iters": 1,
        "log_interval": 1,
        "eval_interval": 4,
        "eval_iters": 1,
        "save_interval": 4,
        "checkpoint.async_save": False,
    }
    cmd = [sys.executable, "-m", "flux_jax.convergence", "--config", "configs/toy.py"]
    cmd += ["--workdir", str(workdir), "--last_n=2", "--smooth=2"]
    cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
    env = os.environ | {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}  # one CPU device: compiles faster
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| final train loss (mean of last 2 steps, to step 4) |" in proc.stdout
    assert "Verdict:" in proc.stdout

    summary = json.loads((workdir / "convergence.json").read_text())
    assert list(summary["runs"]) == ["bf16", "fp8"]
    for r in summary["runs"].values():
        assert r["steps"] == 4 and r["val_step"] == 4 and np.isfinite([r["train_loss"], r["val_loss"]]).all()
    assert summary["variants"]["fp8"]["fp8_at_end"] and summary["variants"]["bf16"]["fp8"] is None
    assert np.isfinite(list(summary["ratios"]["fp8"].values())).all()
    assert (workdir / "convergence.md").read_text().splitlines()[0] == "|  | bf16 | fp8 | fp8/bf16 |"
    with Image.open(workdir / "convergence.png") as img:
        assert img.size == (1000, 620)

    # Same seed, same everything but the FP8 fields.
    configs = {r: json.loads((workdir / r / "config.json").read_text()) for r in ("bf16", "fp8")}
    assert configs["bf16"]["fp8"] is None and configs["fp8"]["fp8"] == "e4m3"
    assert {k: v for k, v in configs["bf16"].items() if k != "fp8"} == {
        k: v for k, v in configs["fp8"].items() if k != "fp8"
    }
    assert configs["fp8"]["model"]["preset"] == "tiny" and configs["fp8"]["train_iters"] == 4
    lines = {r: (workdir / r / "metrics.jsonl").read_text().splitlines() for r in ("bf16", "fp8")}
    assert "amax_max" in json.loads(lines["fp8"][0]) and "amax_max" not in json.loads(lines["bf16"][0])
    # adaLN-zero init: the blocks start as identity, so step 1 has the same loss with or without FP8.
    first = [json.loads(lines[r][0])["loss"] for r in ("bf16", "fp8")]
    assert first[1] == pytest.approx(first[0], rel=1e-4)
