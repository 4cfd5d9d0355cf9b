"""Full train-step benchmark: BF16 and each FP8 recipe side by side in one process.

Times the real jitted train step of flux_jax.steps (forward, backward, AdamW, FP8 state update) on
synthetic device-resident batches, after warm-up, as the median of many synchronised steps.

    python benchmarks/step.py --shape block --recipes bf16,delayed,tensorwise --out results.json
    python benchmarks/step.py --recipes "bf16,delayed,delayed@fp8_cast_kernel=xla"   # config variants

FP8 recipes take the flux-535m config's FP8 fields, so ``fp8_cast_kernel="auto"`` (the Triton cast on
NVIDIA); ``@field=value;field=value`` overrides any config field for one variant.

``--as-rocm`` adds, for every variant, its twin ``rocm:VARIANT``: what an MI300X run of the same config
would run (``flux_jax.choices`` on a gfx942 description: the ROCm attention, the FP8 cast ``auto`` takes
there after its device check, the same FP8 recipe), on this GPU. Its speedup is against ``rocm:bf16``.
The dtypes stay OCP E4M3/E5M2 (as on gfx950; gfx942's fnuz formats have the same bit widths and no FP8
GEMM here).

Shapes (benchmarks/shapes.py, shared with the PyTorch peer benchmarks/torch_peer.py):
  block  width 3072, 2 double + 4 single blocks, batch 4, 512x512 (1024 image tokens), 512 text tokens
  1024px the same blocks, batch 1, 1024x1024 (4096 image tokens), 512 text tokens
  mlperf width 3072, --depth/--single blocks of the 12B model, 256x256 (256 image tokens), 256 text tokens
  535m   flux-535m (1 + 1 blocks), 256x256, 256 text tokens, Primus micro batch 2 (BF16) / 4 (FP8)
  tiny   the "tiny" preset (a few thousand parameters), 4 image + 4 text tokens: tests the bench

``--micro N`` steps over N micro batches of the shape's batch (gradient accumulation, as the train
loop does when global_batch_size > micro_batch_size): images/s and TFLOP/s count all N.

Model TFLOP/s uses flux_jax.metrics.train_flops_per_sample (6 * dense params touched per token *
tokens + attention); MFU is against the GEMM rate measured after the steps (8192^3 on random data,
bf16 for the BF16 step, e4m3 for FP8 steps); off GPU or with --no-measure-peak, against the
datasheet peak.

Memory is reported twice: XLA's compiled estimate of the step (arguments + outputs - donated + temp)
and the allocator's peak (``peak_bytes_in_use``, GPU only). The allocator cannot reset its peak, so
by default each variant runs in a fresh child process (``--no-isolate``: one process, where the
peak of later variants includes the earlier ones and is not compared).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import trace_summary
from benchmarks.shapes import SHAPES, preset_for
from benchmarks.timing import median_seconds
from configs import flux_535m
from flux_jax import choices, config_cli, doctor, fp8, metrics, setup, sharding, steps

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# What flux_jax.choices resolves on an MI300X; "rocm:" variants take its attention and FP8 cast.
MI300X = fp8.DeviceDescription("rocm", "AMD Instinct MI300X", "gfx942")
ROCM_PREFIX = "rocm:"


def bench_config(shape: str, variant: str, args) -> tuple:
    as_rocm = variant.startswith(ROCM_PREFIX)
    recipe, overrides = config_cli.split_variant(variant.removeprefix(ROCM_PREFIX), "--recipes")
    depth, single, batch, side, txt_len = SHAPES[shape]
    if shape == "mlperf":
        depth, single, batch = args.depth, args.single, args.batch or batch
    if shape == "535m" and recipe != "bf16":
        batch = 4
    batch = args.batch or batch
    c = flux_535m.get_config()
    c.model.preset = preset_for(shape)
    c.model.depth, c.model.depth_single_blocks = depth, single
    c.model.attention = args.attention
    c.model.scan_blocks = args.scan
    c.recompute_granularity = args.remat
    c.micro_batch_size = batch
    c.global_batch_size = batch * args.micro
    c.data.image_size, c.data.txt_len = side * 16, txt_len  # the model inputs' shapes (init, FLOPs)
    if recipe != "bf16":
        c.fp8 = args.format
        c.fp8_recipe = recipe
        c.fp8_amax_compute_algo = "max"
    if as_rocm:
        c.model.attention, c.fp8_cast_kernel, c.fp8_format_family = "auto", "auto", "ocp"
        choices.resolve(c, setup.flux_params(c), MI300X)
    # Dotted fields ("model.attention") reach into sub-configs.
    config_cli.apply_overrides(c, overrides, f"--recipes {recipe}@")
    return c, batch, side, txt_len


def synthetic_batch(fp, batch: int, side: int, txt_len: int, rng: np.random.Generator):
    rows, cols = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    ids = np.stack([np.zeros_like(rows), rows, cols], -1).reshape(1, side * side, 3)
    return {
        "img": rng.standard_normal((batch, side * side, fp.in_channels), np.float32),
        "img_ids": np.repeat(ids, batch, 0).astype(np.float32),
        "txt": rng.standard_normal((batch, txt_len, fp.context_in_dim), np.float32),
        "txt_ids": np.zeros((batch, txt_len, 3), np.float32),
        "y": rng.standard_normal((batch, fp.vec_in_dim), np.float32),
    }


def gemm_calls(hlo: str) -> list[str]:
    """The HLO lines of GEMM custom calls (cuBLAS/cuBLASLt/hipBLASLt and cuDNN matmuls)."""
    return [
        ln
        for ln in hlo.splitlines()
        if "custom-call" in ln and ("gemm" in ln.lower() or "matmul" in ln.lower())
    ]


def count_gemms(hlo: str) -> dict[str, int]:
    """All GEMMs (library custom calls plus XLA's Triton GEMM fusions, which the autotuner may pick
    for FP8 dots too), and the FP8 GEMMs among them (``doctor.count_fp8_gemms``)."""
    return {
        "gemm_custom_calls": len(gemm_calls(hlo)) + doctor.count_triton_gemms(hlo),
        "fp8_gemm_custom_calls": doctor.count_fp8_gemms(hlo),
    }


def non_fp8_gemms(hlo: str) -> list[str]:
    """Shapes and source op of each 16-bit GEMM custom call: which dots XLA kept out of FP8."""
    out = []
    for ln in gemm_calls(hlo):
        if "f8" in ln.lower():
            continue
        shapes = re.findall(r"\b(?:bf16|f16|f32)\[[0-9,]*\]", ln)
        op = re.search(r'op_name="([^"]*)"', ln)
        out.append(f"{' '.join(shapes[:4])}  {op.group(1)[-140:] if op else ''}")
    return out


def measured_peak(fp8_operands: bool, n: int = 8192, iters: int = 10) -> float:
    """FLOP/s of one n^3 GEMM on random data (bf16, or e4m3 x e4m3 into bf16), median of iters."""
    dtype = jnp.float8_e4m3fn if fp8_operands else jnp.bfloat16
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.float32).astype(dtype) for i in (0, 1))
    dims = (((1,), (0,)), ((), ()))
    f = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.bfloat16))
    return 2 * n**3 / median_seconds(f, (a, b), iters)


def memory_breakdown(compiled) -> dict:
    """XLA's compiled memory: bytes of arguments + outputs - aliased (donated) + temporaries, and
    each part in GiB.

    Arguments are the train state (float32 params, AdamW moments, fp8_meta) and the batch; temp
    holds the gradients and everything saved for the backward pass: the part FP8 can shrink.
    """
    mem = compiled.memory_analysis()
    if mem is None:
        return {"compiled_memory_bytes": None}
    parts = {
        "arguments": mem.argument_size_in_bytes,
        "outputs": mem.output_size_in_bytes,
        "aliased": getattr(mem, "alias_size_in_bytes", 0),
        "temp": mem.temp_size_in_bytes,
    }
    total = parts["arguments"] + parts["outputs"] - parts["aliased"] + parts["temp"]
    return {
        "compiled_memory_bytes": int(total),
        "memory_gib": {k: round(v / 2**30, 3) for k, v in parts.items()},
    }


def jitted_step(config, net, tx, use_fp8):
    """The jitted train step, donating its state, over global_batch_size / micro_batch_size micro batches."""
    num_micro = config.global_batch_size // config.micro_batch_size
    return jax.jit(steps.make_train_step(config, net, tx, num_micro, use_fp8), donate_argnums=0)


def compile_only(run, recipe: str, shape: str, host: dict) -> dict:
    """Lowers and compiles the step on the abstract state (nothing allocated): compile time and memory."""
    abstract, _ = setup.abstract_state(run)
    replicated = jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec())
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated) for k, v in host.items()}
    step = jitted_step(run.config, run.net, run.tx, run.use_fp8)
    t0 = time.perf_counter()
    with jax.set_mesh(run.mesh):
        compiled = step.lower(abstract, batch).compile()
    return {
        "shape": shape,
        "recipe": recipe,
        "compile_only": True,
        "depth": run.fp.depth,
        "depth_single_blocks": run.fp.depth_single_blocks,
        "scan_blocks": run.net.scan_blocks,
        "params": setup.parameter_count(abstract),
        "compile_s": time.perf_counter() - t0,
        **memory_breakdown(compiled),
        **count_gemms(compiled.as_text()),
    }


def run_one(shape: str, recipe: str, args) -> dict:
    config, batch, side, txt_len = bench_config(shape, recipe, args)
    run = setup.build(config)
    fp, mesh, use_fp8 = run.fp, run.mesh, run.use_fp8
    host = synthetic_batch(fp, batch * args.micro, side, txt_len, np.random.default_rng(0))
    if args.compile_only:
        return compile_only(run, recipe, shape, host)
    _, shardings = setup.abstract_state(run)
    state = setup.init_state(run, jax.random.key(0), jax.random.key(1), shardings)
    batch_dev = jax.device_put(host, sharding.batch_sharding(mesh))
    step = jitted_step(config, run.net, run.tx, use_fp8)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = step.lower(state, batch_dev).compile()
    compile_s = time.perf_counter() - t0
    hlo = compiled.as_text()
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{shape}_{recipe}")
        with open(os.path.join(args.hlo_dir, f"{name}.hlo.txt"), "w") as f:
            f.write(hlo)
    memory = memory_breakdown(compiled)
    for _ in range(args.warmup):
        state, m = compiled(state, batch_dev)
    jax.block_until_ready(state)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m = compiled(state, batch_dev)
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t0)
    prof = None
    if args.profile:
        box = [state]

        def run_step():
            box[0], out = compiled(box[0], batch_dev)
            jax.block_until_ready((box[0], out))

        prof = trace_summary.profile(run_step, args.profile, args.top)
    ms = 1e3 * statistics.median(times)
    flops = metrics.train_flops_per_sample(fp, side * side, txt_len) * batch * args.micro
    return {
        "shape": shape,
        "recipe": recipe,
        "batch": batch,
        "micro_batches": args.micro,
        "image_tokens": side * side,
        "text_tokens": txt_len,
        "depth": fp.depth,
        "depth_single_blocks": fp.depth_single_blocks,
        "ms_per_step": ms,
        "ms_min": 1e3 * min(times),
        "images_per_sec": batch * args.micro / (ms / 1e3),
        "model_tflops": flops / (ms / 1e3) / 1e12,
        "fp8": use_fp8,
        "attention": choices.attention_for(config, fp),
        "fp8_cast_kernel": fp8.resolve_cast_kernel(config.fp8_cast_kernel) if use_fp8 else None,
        "compile_s": compile_s,
        **memory,
        "process_peak_bytes": allocator_peak(),
        "loss": float(m["loss"]),
        "finite": bool(m["finite"]),
        "device": jax.devices()[0].device_kind,
        **count_gemms(hlo),
        "non_fp8_gemms": non_fp8_gemms(hlo) if use_fp8 else [],
        **({"profile": prof} if prof else {}),
    }


def allocator_peak() -> int | None:
    """The device allocator's highest bytes in use since this process started (None off GPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def gemm_only_bound(base: dict, r: dict) -> float | None:
    """Speedup over BF16 if this variant changed only the GEMM kernels (both profiled, else None).

    The BF16 step's wall time with its GEMM time replaced by this variant's: every other kernel
    (optimizer, attention, norms, launch gaps) costs what it costs in BF16 and the FP8 casts are
    free. The most FP8 can give at this shape; the gap to the measured speedup is FP8's own overhead.
    """
    if "profile" not in base or "profile" not in r:
        return None
    gemm = lambda p: sum(p["by_category_ms"].get(c, 0.0) for c in ("gemm", "fp8_gemm"))  # noqa: E731
    return base["ms_per_step"] / (base["ms_per_step"] - gemm(base["profile"]) + gemm(r["profile"]))


def add_mfu(r: dict, peaks: dict) -> None:
    """MFU against the measured GEMM rate for the step's operand type, else the datasheet peak."""
    peak = peaks.get(r["fp8"]) or metrics.peak_flops(r["device"], r["fp8"])
    r["mfu"] = r["model_tflops"] * 1e12 / peak if peak else None
    r["mfu_peak_tflops"] = peak / 1e12 if peak else None


def compare_to_bf16(base: dict | None, results: list[dict], isolated: bool) -> None:
    """Adds each result's speedup and memory against ``base`` (the BF16 step of the same path)."""
    if base is None:
        return
    for r in results:
        r["speedup_vs_bf16"] = base["ms_per_step"] / r["ms_per_step"]
        if base["compiled_memory_bytes"] and r["compiled_memory_bytes"]:
            r["memory_vs_bf16"] = r["compiled_memory_bytes"] / base["compiled_memory_bytes"]
            r["temp_memory_vs_bf16"] = r["memory_gib"]["temp"] / base["memory_gib"]["temp"]
        if isolated and base["process_peak_bytes"] and r["process_peak_bytes"]:
            r["peak_memory_vs_bf16"] = r["process_peak_bytes"] / base["process_peak_bytes"]
        if r is not base and (bound := gemm_only_bound(base, r)) is not None:
            r["gemm_only_bound_vs_bf16"] = bound


def run_in_process(variants: list[str], args) -> list[dict]:
    results = [run_one(args.shape, recipe, args) for recipe in variants]
    if args.compile_only:
        return results
    peaks = {}
    if jax.default_backend() == "gpu" and not args.no_measure_peak:
        # After the steps, so the allocator peak is the step's own.
        peaks = {False: measured_peak(False), True: measured_peak(True)}
        print(f"measured GEMM peak: bf16 {peaks[False] / 1e12:.0f}, fp8 {peaks[True] / 1e12:.0f} TFLOP/s")
    for r in results:
        add_mfu(r, peaks)
    return results


def run_isolated(variants: list[str], argv: list[str]) -> list[dict]:
    """Each variant in a fresh child process (a fresh allocator peak); this one never touches the
    device. The children get this command line with one variant (argparse keeps the last value)."""
    results = []
    for variant in variants:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            cmd = [sys.executable, "-m", "benchmarks.step", *argv]
            cmd += ["--recipes", variant, "--out", out, "--no-isolate", "--quiet"]
            path = os.pathsep.join(filter(None, (_ROOT, os.environ.get("PYTHONPATH"))))
            rc = subprocess.run(cmd, cwd=_ROOT, env=os.environ | {"PYTHONPATH": path}).returncode
            if rc != 0:
                raise SystemExit(f"benchmarks/step.py: variant {variant!r} failed (exit {rc}); see above.")
            with open(out) as f:
                results += json.load(f)
    return results


def save(results: list[dict], path: str) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="block", choices=sorted(SHAPES))
    p.add_argument(
        "--recipes",
        default="bf16,delayed,tensorwise",
        help="comma list of bf16|delayed|tensorwise|rowwise, each optionally @field=value;field=value",
    )
    p.add_argument("--format", default="hybrid", choices=fp8.FORMATS)
    p.add_argument("--attention", default="auto", choices=choices.ATTENTION_CHOICES)
    p.add_argument("--as-rocm", action="store_true", help="add each variant's ROCm-path twin (rocm:VARIANT)")
    p.add_argument("--remat", default=None, choices=(None, "selective", "full"))
    p.add_argument("--scan", action="store_true")
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--single", type=int, default=4)
    p.add_argument("--batch", type=int, default=0, help="micro batch (default: the shape's)")
    p.add_argument("--micro", type=int, default=1, help="micro batches per step (gradient accumulation)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile-only", action="store_true", help="abstract state: compile time and memory")
    p.add_argument("--profile", type=int, default=0, help="trace this many extra steps per recipe")
    p.add_argument("--top", type=int, default=15, help="kernels listed per profiled recipe")
    p.add_argument("--hlo-dir", default="", help="write each recipe's compiled HLO text here")
    p.add_argument("--out", default="")
    p.add_argument("--no-measure-peak", action="store_true", help="MFU against the datasheet peak")
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run each variant in a fresh process, so each has its own allocator peak (default)",
    )
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # children: JSON only
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if args.micro < 1:
        p.error(f"--micro {args.micro}: the number of micro batches per step must be >= 1")
    variants = args.recipes.split(",")
    if args.as_rocm:
        variants += [ROCM_PREFIX + v for v in variants if not v.startswith(ROCM_PREFIX)]
        # The children get the variants one by one and must not add twins again.
        argv = [a for a in argv if a != "--as-rocm"]
    if args.isolate and not args.compile_only and len(variants) > 1:
        results = run_isolated(variants, argv)
    else:
        if args.attention in ("cudnn", "pallas") and jax.default_backend() != "gpu":
            p.error(
                f"--attention {args.attention} needs a GPU; this backend is {jax.default_backend()!r}: "
                "use --attention auto or xla"
            )
        results = run_in_process(variants, args)
    for r in results:
        print(json.dumps(r), flush=True)
    save(results, args.out)
    if args.quiet:
        return 0
    if args.compile_only:
        for r in results:
            mem = (r["compiled_memory_bytes"] or 0) / 2**30
            print(
                f"{r['recipe']:<28} {r['params'] / 1e9:.2f}B params  "
                f"compile {r['compile_s']:.1f} s  {mem:.1f} GiB"
            )
        return 0
    for prefix in ("", ROCM_PREFIX):
        base = next((r for r in results if r["recipe"] == prefix + "bf16"), None)
        path = [r for r in results if r["recipe"].startswith(ROCM_PREFIX) == bool(prefix)]
        compare_to_bf16(base, path, args.isolate)
    print(f"{'recipe':<28} ms/step  img/s  TFLOP/s  MFU   xBF16  mem   fp8 gemms/all  compile s  attention")
    for r in results:
        mfu = f"{r['mfu']:.2f}" if r["mfu"] else "  - "
        print(
            f"{r['recipe']:<28} {r['ms_per_step']:8.2f} {r['images_per_sec']:6.1f} {r['model_tflops']:8.1f} "
            f"{mfu:>5} {r.get('speedup_vs_bf16', 1):6.2f} {r.get('memory_vs_bf16', 1):5.2f} "
            f"{r['fp8_gemm_custom_calls']:>5}/{r['gemm_custom_calls']:<5} {r['compile_s']:8.1f}  "
            f"{r['attention']}"
        )
    for r in results:
        peak = r["process_peak_bytes"]
        peak = f"{peak / 2**30:.2f} GiB" if peak else "n/a"
        ratio = f" ({r['peak_memory_vs_bf16']:.3f}x BF16)" if "peak_memory_vs_bf16" in r else ""
        gib = json.dumps(r.get("memory_gib"))
        print(f"{r['recipe']}: compiled memory GiB {gib}; allocator peak {peak}{ratio}")
    for r in results:
        if "profile" in r:
            prof = r["profile"]
            print(
                f"{r['recipe']}: {prof['kernel_ms_per_step']} kernel ms, {prof['kernels_per_step']} kernels "
                f"per step (wall {r['ms_per_step']:.2f} ms); by category:",
                json.dumps(prof["by_category_ms"]),
            )
            if "gemm_only_bound_vs_bf16" in r:
                print(
                    f"{r['recipe']}: with only the GEMMs changed from BF16's (free casts, the rest as in "
                    f"BF16) the step would be {r['gemm_only_bound_vs_bf16']:.2f}x BF16; measured "
                    f"{r['speedup_vs_bf16']:.2f}x"
                )
            for name, cat, ms in r["profile"]["top_kernels_ms"]:
                print(f"    {ms:8.3f} ms  {cat:<10} {name}")
    for r in results:
        for line in r["non_fp8_gemms"]:
            print(f"{r['recipe']}: 16-bit GEMM {line}")
    save(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
