"""FP8 operand cast (amax + quantize + transposed copy): XLA vs the jax-triton kernel, per tile shape.

    PYTHONPATH=. python benchmarks/fp8_cast.py [--iters 50] [--out cast.json]

Times ``jit(fp8_cast.cast_xla)`` and ``jit(fp8_cast.cast_triton)`` on bf16 inputs of the Flux block
GEMM operand shapes (activations M = batch x tokens, weights K x N), median of ``--iters`` calls,
and reports effective GB/s (bytes read + written: 2 per element in, 1 per FP8 copy out).

    PYTHONPATH=. python benchmarks/fp8_cast.py --f32-kernels

times instead the cast of a float32 master kernel rounded via bf16 (what the FP8 dots do with their
weights: ``via=bfloat16``, 4 bytes in), XLA against the default Triton tile, at the same shapes.
"""

import argparse
import json
import sys

import jax
import jax.numpy as jnp

from benchmarks.timing import median_seconds
from flux_jax import fp8_cast

SHAPES = [(6144, 3072), (6144, 15360), (4096, 12288), (2048, 3072), (3072, 21504), (12288, 3072)]
TILES = [(64, 128, 4), (128, 128, 4), (128, 128, 8), (64, 256, 4), (128, 64, 4), (32, 128, 4), (64, 64, 4)]


def time_bf16(iters: int, dtype, scale) -> list[dict]:
    rows = []
    for shape in SHAPES:
        x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
        nbytes = x.size * (2 + 2)
        row = {"shape": shape}
        xla = jax.jit(lambda x: fp8_cast.cast_xla(x, dtype, scale, True))
        row["xla_us"] = 1e6 * median_seconds(xla, (x,), iters)
        for bm, bk, warps in TILES:
            f = jax.jit(lambda x, t=(bm, bk, warps): fp8_cast.cast_triton(x, dtype, scale, True, None, *t))
            row[f"triton_{bm}x{bk}w{warps}_us"] = 1e6 * median_seconds(f, (x,), iters)
        best = min((k for k in row if k.startswith("triton")), key=row.get)
        row["best"] = best
        row["best_gb_s"] = nbytes / row[best] / 1e3
        row["xla_gb_s"] = nbytes / row["xla_us"] / 1e3
        rows.append(row)
    return rows


def time_f32_kernels(iters: int, dtype, scale) -> list[dict]:
    rows = []
    for shape in SHAPES:
        x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
        nbytes = x.size * (4 + 2)
        row = {"shape": shape, "input": "float32 via bfloat16"}
        for name, cast in (("xla", fp8_cast.cast_xla), ("triton", fp8_cast.cast_triton)):
            f = jax.jit(lambda x, c=cast: c(x, dtype, scale, True, jnp.bfloat16))
            row[f"{name}_us"] = 1e6 * median_seconds(f, (x,), iters)
            row[f"{name}_gb_s"] = nbytes / row[f"{name}_us"] / 1e3
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="")
    p.add_argument("--f32-kernels", action="store_true", help="float32 inputs rounded via bf16 (see above)")
    args = p.parse_args(argv)
    timer = time_f32_kernels if args.f32_kernels else time_bf16
    rows = timer(args.iters, jnp.float8_e4m3fn, jnp.float32(0.01))
    for row in rows:
        print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
