"""Attention kernels forward+backward: XLA, cuDNN and JAX's Pallas flash attention (several tiles).

    PYTHONPATH=. python benchmarks/attention.py [--iters 20] [--out attention.json]

Times ``jax.grad`` of ``sum(attention(q, k, v) * g)`` (the forward and the backward to q, k, v, what a
train step runs) on bf16 random inputs at the Flux block shape (B4, 1536 tokens, 24 heads, D128) and
at 1024x1024 images (B1, 4096 + 512 tokens), median of ``--iters`` calls, and checks each kernel's
values and gradients against the XLA attention (relative error, max over out/dq/dk/dv). The Pallas
tiles are ``math.FLASH_BLOCKS`` keys (forward q x k, backward q x kv for dK/dV and dQ).
"""

import argparse
import json
import sys

import jax
import jax.numpy as jnp

from benchmarks.timing import median_seconds
from flux_jax import math as fmath

SHAPES = {"block": (4, 1536, 24, 128), "1024px": (1, 4608, 24, 128)}
# (forward block_q, block_k, backward block): the kernel's defaults (128, 128, 32) and neighbours.
TILES = [(128, 128, 32), (128, 64, 64), (128, 128, 64), (64, 64, 64), (128, 64, 32)]


def blocks(fwd_q: int, fwd_k: int, bwd: int) -> dict:
    backward = dict(block_q_dkv=bwd, block_kv_dkv=bwd, block_q_dq=bwd, block_kv_dq=bwd)
    return dict(block_q=fwd_q, block_k=fwd_k, **backward)


def pallas(tile):
    tiles = blocks(*tile)
    return lambda q, k, v: fmath.flash_attention(q, k, v, tiles)


def fwd_bwd(attend):
    def f(q, k, v, g):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, *vjp(g)

    return jax.jit(f)


def rel_err(got, want) -> float:
    got, want = (jnp.asarray(x, jnp.float32) for x in (got, want))
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    kernels = {
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"),
    }
    for tile in TILES:
        kernels["pallas_{}x{}_bwd{}".format(*tile)] = pallas(tile)
    rows = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        q, k, v, g = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in range(4))
        # The float32 XLA attention is the reference the bf16 kernels are compared with.
        ref = fwd_bwd(kernels["xla"])(*(x.astype(jnp.float32) for x in (q, k, v, g)))
        for kernel, attend in kernels.items():
            row = {"shape": name, "dims": shape, "kernel": kernel}
            try:
                f = fwd_bwd(attend)
                row["rel_err"] = max(rel_err(a, b) for a, b in zip(f(q, k, v, g), ref))
                row["ms"] = 1e3 * median_seconds(f, (q, k, v, g), args.iters, warmup=2)
            except Exception as err:  # a tile the kernel rejects is reported, not fatal
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    for name in args.shapes.split(","):
        base = next(r for r in rows if r["shape"] == name and r["kernel"] == "xla")
        print(f"{name} {SHAPES[name]}: forward+backward ms, x XLA, rel. error vs float32")
        for r in (r for r in rows if r["shape"] == name):
            if "ms" in r:
                r["speedup_vs_xla"] = base["ms"] / r["ms"]
                print(f"  {r['kernel']:<24} {r['ms']:8.3f}  {r['speedup_vs_xla']:5.2f}x  {r['rel_err']:.1e}")
            else:
                print(f"  {r['kernel']:<24} {r['error']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
