"""FP8 operand cast (amax + quantize + transposed copy): XLA vs the jax-triton kernel, per tile shape.

    PYTHONPATH=. python benchmarks/fp8_cast.py [--iters 50] [--out cast.json]

Times ``jit(fp8_cast.cast_xla)`` and ``jit(fp8_cast.cast_triton)`` on bf16 inputs of the Flux block
GEMM operand shapes (activations M = batch x tokens, weights K x N), median of ``--iters`` calls,
and reports effective GB/s (bytes read + written: 2 per element in, 1 per FP8 copy out).
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    dtype, scale = jnp.float8_e4m3fn, jnp.float32(0.01)
    rows = []
    for shape in SHAPES:
        x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
        nbytes = x.size * (2 + 2)
        row = {"shape": shape}
        xla = jax.jit(lambda x: fp8_cast.cast_xla(x, dtype, scale, True))
        row["xla_us"] = 1e6 * median_seconds(xla, (x,), args.iters)
        for bm, bk, warps in TILES:
            f = jax.jit(lambda x, t=(bm, bk, warps): fp8_cast.cast_triton(x, dtype, scale, True, None, *t))
            row[f"triton_{bm}x{bk}w{warps}_us"] = 1e6 * median_seconds(f, (x,), args.iters)
        best = min((k for k in row if k.startswith("triton")), key=row.get)
        row["best"] = best
        row["best_gb_s"] = nbytes / row[best] / 1e3
        row["xla_gb_s"] = nbytes / row["xla_us"] / 1e3
        rows.append(row)
        print(
            json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}), flush=True
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
