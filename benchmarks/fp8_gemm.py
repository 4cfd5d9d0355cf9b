"""Forward+backward time of the FP8 dense (Fp8DotGeneral) vs a BF16 dot at Flux GEMM shapes.

    python benchmarks/fp8_gemm.py [--smoke] [--recipes delayed,tensorwise] [--out DIR]

Writes fp8_gemm.json to --out (default $OUT or .). Each case times jit(fwd + vjp) with fresh
inputs, block_until_ready per iteration, median over --iters, and counts the FP8 GEMM custom calls
in the compiled HLO (3 per dense when all of forward, data-grad and weight-grad run in FP8).
"""

import argparse
import datetime
import json
import os

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.timing import median_seconds
from flux_jax import doctor, fp8
from flux_jax.fp8_dot import Fp8DotGeneral, Fp8Spec

DIMS = (((1,), (0,)), ((), ()))
# (K, N) of the Flux-dev GEMMs: qkv, MLP up, MLP down, single-block linear1, linear2.
FLUX_KN = ((3072, 9216), (3072, 12288), (12288, 3072), (3072, 21504), (15360, 3072))
FLUX_M = (4 * 1536, 16384)


def _bf16_fwd_bwd(x, w, _meta, g):
    y, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, DIMS, preferred_element_type=a.dtype), x, w)
    return y, vjp(g)


def _fp8_fwd_bwd(module):
    """Forward and backward; the delayed-scaling state update runs inside them (its new value is
    the fp8_meta cotangent), as in one train step."""

    def run(x, w, meta, g):
        y, vjp = jax.vjp(lambda a, b, m: module.apply(m, a, b, DIMS), x, w, meta)
        return y, vjp(g)

    return run


def time_case(fn, args, iters, warmup):
    jitted = jax.jit(fn)
    text = jitted.lower(*args).compile().as_text()
    return median_seconds(jitted, args, iters, warmup), doctor.count_fp8_gemms(text)


def run(shapes, recipes, iters, warmup, on_row=lambda rows: None, cast_kernel="xla"):
    desc = fp8.describe_device()
    fwd, bwd = fp8.fp8_dtypes("hybrid", fp8.format_family(desc))
    rows = []
    key = jax.random.PRNGKey(0)
    for m, k, n in shapes:
        kx, kw, kg, key = jax.random.split(key, 4)
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        g = jax.random.normal(kg, (m, n), jnp.bfloat16)
        flops = 3 * 2 * m * k * n
        t_bf16, _ = time_case(_bf16_fwd_bwd, (x, w, None, g), iters, warmup)
        row = {"M": m, "K": k, "N": n, "bf16_ms": t_bf16 * 1e3, "bf16_tflops": flops / t_bf16 / 1e12}
        for recipe in recipes:
            spec = Fp8Spec(fwd_dtype=fwd, bwd_dtype=bwd, recipe=recipe, cast_kernel=cast_kernel)
            module = Fp8DotGeneral(spec=spec)
            meta = module.init(jax.random.PRNGKey(1), x, w, DIMS)
            t, n_fp8 = time_case(_fp8_fwd_bwd(module), (x, w, meta, g), iters, warmup)
            row[f"{recipe}_ms"] = t * 1e3
            row[f"{recipe}_speedup"] = t_bf16 / t
            row[f"{recipe}_fp8_gemms"] = n_fp8
        rows.append(row)
        print(json.dumps(row), flush=True)
        on_row(rows)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few iterations (CPU check)")
    parser.add_argument("--recipes", default="delayed,tensorwise")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--m", default=",".join(map(str, FLUX_M)), help="comma-separated M values")
    parser.add_argument(
        "--cast-kernel", default="auto", help="xla | triton | auto (Triton on one NVIDIA GPU, as configs)"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    cast_kernel = fp8.resolve_cast_kernel(args.cast_kernel)
    recipes = args.recipes.split(",")
    if args.smoke:
        shapes, iters, warmup = [(32, 64, 48)], 2, 1
    else:
        shapes = [(int(m), k, n) for m in args.m.split(",") for k, n in FLUX_KN]
        iters, warmup = args.iters, args.warmup
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "doctor": doctor.report(),
        "recipes": recipes,
        "cast_kernel": cast_kernel,
        "iters": iters,
    }
    os.makedirs(args.out, exist_ok=True)

    # Written after every case: compiling and autotuning FP8 GEMMs takes minutes on a GPU, and a
    # run cut short by a time limit should still leave its finished rows.
    def write(rows):
        with open(os.path.join(args.out, "fp8_gemm.json"), "w") as f:
            json.dump({**result, "rows": rows}, f, indent=1)

    write(run(shapes, recipes, iters, warmup, write, cast_kernel))


if __name__ == "__main__":
    main()
