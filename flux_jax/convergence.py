"""BF16 vs FP8 from one seed: ``python -m flux_jax.convergence --config configs/X.py --workdir DIR``.

Trains one variant per ``--recipes`` entry (default ``bf16,fp8``) with train.train_and_evaluate in
DIR/<recipe>, then writes DIR/convergence.png (train-loss curves, raw and moving average, and the
validation points), DIR/convergence.md and DIR/convergence.json (final losses, ratios to the first
recipe, and a verdict against the Primus claim "FP8 loss within 5% of BF16").

Recipes: ``bf16`` sets config.fp8=None; ``fp8`` uses config.fp8 (``e4m3`` when unset); ``e4m3`` and
``hybrid`` pick the format; a ``:RECIPE`` suffix sets config.fp8_recipe (``fp8:tensorwise``); an
``@FIELD=VALUE;FIELD=VALUE`` suffix sets any other fields, typed as ``--config.FIELD=VALUE`` would be
(``hybrid@adam_moments_dtype=bfloat16`` against ``hybrid``: bf16 AdamW moments against float32). Nothing
else differs between variants, so they share init, data order, timesteps and noise. "bf16" means FP8
off: the rest of the model computes in config.model.dtype. Rerunning on a finished DIR resumes each run
at its last step and only rewrites the report.
"""

import argparse
import json
import logging
import math
import os
import re
import sys

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from flux_jax import cli, config_check, config_cli, console, fp8, preemption, train
from flux_jax.errors import UserError

log = logging.getLogger("flux_jax.convergence")  # also when run as __main__

BACKGROUND = (255, 255, 255)
COLORS = [(31, 119, 180), (230, 100, 0), (44, 160, 44), (214, 39, 40), (148, 103, 189)]


# ---- Variants and metrics ------------------------------------------------------------------------
def variant_config(config, recipe: str):
    """A copy of config for one recipe: config.fp8 and config.fp8_recipe, plus the fields an
    ``@field=value;field=value`` suffix names (``hybrid@adam_moments_dtype=bfloat16``)."""
    spec, overrides = config_cli.split_variant(recipe, "--recipes")
    fmt, _, scaling = spec.partition(":")
    c = config.copy_and_resolve_references()
    if fmt == "bf16" and not scaling:
        c.fp8 = None
    elif fmt == "fp8" or fmt in fp8.FORMATS:
        c.fp8 = fmt if fmt in fp8.FORMATS else (config.fp8 or "e4m3")
        if scaling:
            c.fp8_recipe = scaling
    else:
        raise UserError(
            f"Unknown recipe {recipe!r} in --recipes: use bf16, fp8, {', '.join(fp8.FORMATS)}, "
            "optionally with ':RECIPE' (fp8:tensorwise) and '@FIELD=VALUE;...' "
            "(bf16@adam_moments_dtype=bfloat16)."
        )
    config_cli.apply_overrides(c, overrides, f"--recipes {spec}@")
    return c


def run_dir(workdir: str, recipe: str) -> str:
    """workdir/<recipe>, the recipe spelled with file-name-safe characters."""
    return os.path.join(workdir, re.sub(r"[^A-Za-z0-9._-]+", "_", recipe))


def read_metrics(path: str) -> dict:
    """metrics.jsonl -> {"train": [(step, loss)], "val": [(step, loss)], "seconds": float}.

    Points are sorted by step; a step logged twice (a resumed run repeats the steps after its last
    checkpoint) keeps its last line. "seconds" adds up the logged intervals (steps / steps_per_sec): the
    train loop's time including compiles and validation, also when a finished run is only resumed.
    """
    splits: dict[str, dict[int, float]] = {"train": {}, "val": {}}
    rates: dict[int, float] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row.get("split") in splits and "loss" in row:
                splits[row["split"]][int(row["step"])] = float(row["loss"])
            if row.get("split") == "train" and row.get("steps_per_sec"):
                rates[int(row["step"])] = float(row["steps_per_sec"])
    steps = sorted(rates)
    seconds = sum((s - p) / rates[s] for p, s in zip([0] + steps[:-1], steps))
    return {k: sorted(v.items()) for k, v in splits.items()} | {"seconds": seconds}


# ---- Summary math --------------------------------------------------------------------------------
def moving_average(values, window: int) -> np.ndarray:
    """Centred mean over `window` points (window // 2 before), shrinking at both ends; no lag."""
    x = np.asarray(values, np.float64)
    if window <= 1 or x.size == 0:
        return x
    csum = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(x.size)
    lo = np.maximum(idx - window // 2, 0)
    hi = np.minimum(idx - window // 2 + window, x.size)
    return (csum[hi] - csum[lo]) / (hi - lo)


def final_train_loss(train_points, last_n: int) -> float | None:
    """Mean loss over the logged points within the last `last_n` steps (at least the last point)."""
    if not train_points:
        return None
    last = train_points[-1][0]
    tail = [loss for step, loss in train_points if step > last - last_n] or [train_points[-1][1]]
    return float(np.mean(tail))


def ratio(value, base) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return float(value) / float(base)


def summarize(runs: dict, last_n: int = 50, tolerance: float = 0.05) -> dict:
    """Final losses per run and ratios to the first run; `within` is |ratio - 1| <= tolerance for all."""
    names = list(runs)
    base = names[0]
    out = {"baseline": base, "last_n": last_n, "tolerance": tolerance, "runs": {}, "ratios": {}}
    for name, m in runs.items():
        val_step, val_loss = m["val"][-1] if m["val"] else (None, None)
        out["runs"][name] = {
            "train_loss": final_train_loss(m["train"], last_n),
            "steps": m["train"][-1][0] if m["train"] else 0,
            "val_loss": val_loss,
            "val_step": val_step,
        }
    b = out["runs"][base]
    checks = []
    for name in names[1:]:
        r = out["runs"][name]
        out["ratios"][name] = {k: ratio(r[f"{k}_loss"], b[f"{k}_loss"]) for k in ("train", "val")}
        checks += [x for x in out["ratios"][name].values() if x is not None]
        if out["ratios"][name]["train"] is None:
            checks.append(math.nan)  # no train loss is a failure, a missing val pass is not
    out["within"] = bool(checks) and all(abs(x - 1.0) <= tolerance + 1e-9 for x in checks)
    out["verdict"] = verdict(out)
    return out


def verdict(summary: dict) -> str:
    pct = f"{summary['tolerance']:.0%}"
    if not summary["ratios"]:
        return "Verdict: nothing to compare (one recipe)."
    parts = []
    for name, r in summary["ratios"].items():
        for k in ("train", "val"):
            if r[k] is not None:
                parts.append(f"{name}/{summary['baseline']} {k} {r[k]:.4f} ({(r[k] - 1) * 100:+.2f}%)")
    head = "MET" if summary["within"] else "NOT MET"
    claim = f"losses within {pct} of {summary['baseline']}'s (Primus's claim for FP8 against BF16)"
    return f"Verdict: {head}: {claim}: " + (", ".join(parts) or "no losses")


def _fmt(x, spec=".4f") -> str:
    return "n/a" if x is None else format(x, spec)


def to_markdown(summary: dict, extra_rows: dict[str, dict] | None = None) -> str:
    """The results table (one column per run, one ratio column per compared run) and the verdict."""
    names, base = list(summary["runs"]), summary["baseline"]
    others = names[1:]
    header = ["", *names, *[f"{n}/{base}" for n in others]]
    runs, ratios = summary["runs"], summary["ratios"]
    steps = runs[base]["steps"]
    val_steps = sorted({r["val_step"] for r in runs.values() if r["val_step"] is not None})
    rows = [
        [f"final train loss (mean of last {summary['last_n']} steps, to step {steps})"]
        + [_fmt(runs[n]["train_loss"]) for n in names]
        + [_fmt(ratios[n]["train"]) for n in others],
        [f"final val loss (step {', '.join(map(str, val_steps)) or 'n/a'})"]
        + [_fmt(runs[n]["val_loss"]) for n in names]
        + [_fmt(ratios[n]["val"]) for n in others],
    ]
    for label, values in (extra_rows or {}).items():
        rows.append([label] + [str(values.get(n, "")) for n in names] + [""] * len(others))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n\n" + summary["verdict"] + "\n"


# ---- Plot ----------------------------------------------------------------------------------------
def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values (steps of 1, 2, 2.5 or 5 x 10^k) covering [lo, hi] with about `target` ticks."""
    if not hi > lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(target - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    n = int(math.floor((hi - first) / step + 1e-9)) + 1
    return [round(first + i * step, 12) for i in range(n)]


class Axes:
    """Maps data (x, y) to pixels inside the box (left, top, right, bottom)."""

    def __init__(self, box, xlim, ylim):
        self.box, self.xlim, self.ylim = box, xlim, ylim

    def px(self, x, y) -> tuple[float, float]:
        (left, top, right, bottom), (x0, x1), (y0, y1) = self.box, self.xlim, self.ylim
        return left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top)


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType sizes
        return ImageFont.load_default()


def _faint(color, alpha=0.3):
    return tuple(int(round(255 - alpha * (255 - c))) for c in color)


def _marker(d, i: int, xy, color, r: int = 6) -> None:
    """Run 0: filled circle; later runs: hollow squares / diamonds, so coincident points stay visible."""
    x, y = xy
    if i == 0:
        d.ellipse([(x - r, y - r), (x + r, y + r)], fill=color, outline=(0, 0, 0))
    elif i % 2:
        d.rectangle([(x - r - 1, y - r - 1), (x + r + 1, y + r + 1)], outline=color, width=3)
    else:
        d.polygon([(x, y - r - 3), (x + r + 3, y), (x, y + r + 3), (x - r - 3, y)], outline=color, width=3)


def render(runs: dict, title: str = "", smooth: int = 20, size=(1000, 620)) -> tuple[Image.Image, Axes]:
    """Train loss per run (raw faint, moving average bold) and validation points, on one pair of axes."""
    img = Image.new("RGB", size, BACKGROUND)
    d = ImageDraw.Draw(img)
    font, small = _font(18), _font(14)
    w, h = size
    box = (80, 50, w - 25, h - 65)
    finite = [
        (s, v) for m in runs.values() for split in ("train", "val") for s, v in m[split] if math.isfinite(v)
    ]
    xs, ys = [s for s, _ in finite] or [0, 1], [v for _, v in finite] or [0, 1]
    pad = 0.05 * ((max(ys) - min(ys)) or 1.0)
    ax = Axes(box, (0, max(max(xs), 1) * 1.02), (min(ys) - pad, max(ys) + pad))
    left, top, right, bottom = box
    for x in nice_ticks(0, max(max(xs), 1), 7):
        px, _ = ax.px(x, 0)
        d.line([(px, top), (px, bottom)], fill=(232, 232, 232))
        d.line([(px, bottom), (px, bottom + 5)], fill=(0, 0, 0))
        d.text((px, bottom + 8), f"{x:g}", fill=(0, 0, 0), font=small, anchor="mt")
    for y in nice_ticks(*ax.ylim, 8):
        if not ax.ylim[0] <= y <= ax.ylim[1]:
            continue
        _, py = ax.px(0, y)
        d.line([(left, py), (right, py)], fill=(232, 232, 232))
        d.line([(left - 5, py), (left, py)], fill=(0, 0, 0))
        d.text((left - 8, py), f"{y:g}", fill=(0, 0, 0), font=small, anchor="rm")
    d.rectangle(box, outline=(0, 0, 0))
    d.text(((left + right) / 2, h - 22), "step", fill=(0, 0, 0), font=font, anchor="mm")
    label = Image.new("RGB", (60, 24), BACKGROUND)
    ImageDraw.Draw(label).text((30, 12), "loss", fill=(0, 0, 0), font=font, anchor="mm")
    img.paste(label.rotate(90, expand=True), (8, (top + bottom) // 2 - 30))
    d.text(((left + right) / 2, 25), title, fill=(0, 0, 0), font=font, anchor="mm")

    legend = []
    for i, (name, m) in enumerate(runs.items()):
        color = COLORS[i % len(COLORS)]
        steps = [s for s, _ in m["train"]]
        losses = [v for _, v in m["train"]]
        if len(steps) > 1:
            d.line([ax.px(s, v) for s, v in zip(steps, losses)], fill=_faint(color), width=1)
            smoothed = moving_average(losses, smooth)
            d.line([ax.px(s, v) for s, v in zip(steps, smoothed)], fill=color, width=3)
        for s, v in m["val"]:
            x, y = ax.px(s, v)
            _marker(d, i, (x, y), color)
        legend.append((f"{name} train, moving average {smooth} (faint: raw)", color, None))
        if m["val"]:
            legend.append((f"{name} val", color, i))
    lw = max(d.textlength(text, font=small) for text, _, _ in legend) + 60 if legend else 0
    lx, ly = right - lw - 10, top + 10
    d.rectangle((lx, ly, right - 10, ly + 22 * len(legend) + 8), fill=BACKGROUND, outline=(120, 120, 120))
    for k, (text, color, kind) in enumerate(legend):
        y = ly + 15 + 22 * k
        if kind is None:
            d.line([(lx + 10, y + 4), (lx + 40, y + 4)], fill=_faint(color), width=1)
            d.line([(lx + 10, y), (lx + 40, y)], fill=color, width=3)
        else:
            _marker(d, kind, (lx + 25, y), color)
        d.text((lx + 50, y), text, fill=(0, 0, 0), font=small, anchor="lm")
    return img, ax


# ---- Command -------------------------------------------------------------------------------------
def run(config, workdir: str, recipes=("bf16", "fp8"), last_n=50, smooth=20, tolerance=0.05) -> dict:
    """Trains every recipe into workdir/<recipe> and writes convergence.{png,md,json}; returns the summary."""
    configs = {r: variant_config(config, r) for r in recipes}
    for c in configs.values():  # fail on a bad variant before any training
        config_check.validate(c)
    results, runs = {}, {}
    for recipe, c in configs.items():
        sub = run_dir(workdir, recipe)
        log.info("Training %s (fp8=%s, fp8_recipe=%s) in %s", recipe, c.fp8, c.fp8_recipe, sub)
        results[recipe] = train.train_and_evaluate(c, sub)
        if results[recipe]["preempted"]:  # no report from a partial run
            log.warning("Stopped while training %s; the same command resumes and writes the report.", recipe)
            return {"signal": results[recipe]["signal"], "stopped_in": recipe}
        runs[recipe] = read_metrics(os.path.join(sub, "metrics.jsonl"))
    summary = summarize(runs, last_n, tolerance)
    summary["variants"] = variants = {
        r: {"fp8": c.fp8, "fp8_recipe": c.fp8_recipe if c.fp8 else None, "model.dtype": c.model.dtype}
        | {k: results[r][k] for k in ("nonfinite_skipped", "params")}
        | {"loop_s": runs[r]["seconds"]}
        | {"fp8_at_end": results[r]["fp8"]}
        for r, c in configs.items()
    }
    dropped = [r for r, v in variants.items() if v["fp8"] and not v["fp8_at_end"]]
    if dropped:  # on_nonfinite="bf16" switched these runs off FP8: their losses are partly not FP8
        summary["verdict"] += f" (NOTE: {', '.join(dropped)} fell back to BF16 after non-finite steps)"
    title = (
        f"{config.model.preset} ({config.model.dtype}), seed {config.seed}, "
        f"batch {config.global_batch_size}: train loss (lines), validation loss (markers)"
    )
    render(runs, title, smooth)[0].save(os.path.join(workdir, "convergence.png"))
    extra = {
        "fp8 / fp8_recipe": {
            r: f"{v['fp8']} / {v['fp8_recipe']}" if v["fp8"] else "off" for r, v in variants.items()
        },
        "model.dtype": {r: v["model.dtype"] for r, v in variants.items()},
        "non-finite steps skipped": {r: v["nonfinite_skipped"] for r, v in variants.items()},
        "train loop time (s, with compile and validation)": {
            r: f"{runs[r]['seconds']:.0f}" for r in variants
        },
    }
    md = to_markdown(summary, extra)
    with open(os.path.join(workdir, "convergence.md"), "w") as f:
        f.write(md)
    with open(os.path.join(workdir, "convergence.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(md)
    return summary


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flux_jax.convergence",
        description="Trains each recipe from one seed and writes convergence.{png,md,json} to --workdir.",
        allow_abbrev=False,
    )
    config_cli.add_config_argument(p)
    p.add_argument(
        "--workdir", required=True, help="report directory; each recipe trains in WORKDIR/<recipe>"
    )
    p.add_argument(
        "--recipes",
        default="bf16,fp8",
        help="comma-separated: bf16, fp8, e4m3, hybrid, optional :RECIPE and @FIELD=VALUE;FIELD=VALUE",
    )
    p.add_argument("--last_n", type=int, default=50, help="final train loss = mean over the last N steps")
    p.add_argument(
        "--smooth", type=int, default=20, help="moving-average window (logged points) of the plots"
    )
    p.add_argument("--tolerance", type=float, default=0.05, help="verdict: |ratio - 1| <= tolerance for all")
    return p


def main(argv=None) -> int:
    args, config = config_cli.parse(parser(), sys.argv[1:] if argv is None else argv)
    console.setup_logging(logging.getLogger("flux_jax"))
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    summary = run(config, args.workdir, recipes, args.last_n, args.smooth, args.tolerance)
    return preemption.exit_status(summary.get("signal"))


if __name__ == "__main__":
    cli.run(main)
