"""What one block keeps for its backward: ``jax.ad_checkpoint`` saved residuals, traced on the CPU.

Prints the residual bytes of one double and one single block (BF16 compute, float32 params, no
remat), by dtype and by the source line that made each residual, at a small shape by default:

    python benchmarks/residuals.py                       # width 384, 3 heads, 2 x 64 + 64 tokens
    python benchmarks/residuals.py --width 3072 --heads 24 --batch 4 --img 1024 --txt 512 --top 20
    python benchmarks/residuals.py --compiled   # also XLA's temp bytes of each block's jitted gradient

Jaxpr-level residuals: what autodiff would keep before XLA fuses or recomputes anything; the GPU's
allocator peak (``benchmarks/step.py``) is the figure that counts, this says where it comes from.
"""

import argparse
import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax._src.ad_checkpoint import saved_residuals

from flux_jax.layers import DoubleStreamBlock, SingleStreamBlock
from flux_jax.math import embed_nd


def block_inputs(args) -> dict:
    rng = np.random.default_rng(0)
    length = args.txt + args.img
    ids = np.zeros((args.batch, length, 3), np.float32)
    ids[:, args.txt :, 1] = np.arange(args.img) // 32
    ids[:, args.txt :, 2] = np.arange(args.img) % 32
    head_dim = args.width // args.heads
    axes = (head_dim - 2 * (3 * head_dim // 8), 3 * head_dim // 8, 3 * head_dim // 8)
    act = lambda n: jnp.asarray(rng.normal(size=(args.batch, n, args.width)), jnp.bfloat16)  # noqa: E731
    return dict(
        img=act(args.img),
        txt=act(args.txt),
        vec=jnp.asarray(rng.normal(size=(args.batch, args.width)), jnp.bfloat16),
        pe=embed_nd(jnp.asarray(ids), axes, 10000.0),
    )


def block_loss(block: nn.Module, inputs: tuple):
    """(loss(params, acts), abstract params): the sum of the block's outputs, differentiated w.r.t. its
    params and its inputs but the last (pe, which comes from the positions)."""
    params = nn.unbox(jax.eval_shape(lambda: block.init(jax.random.key(0), *inputs))["params"])

    def loss(p, acts):
        out = block.apply({"params": p}, *acts, inputs[-1])
        return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(out))

    return loss, params


def residuals(block: nn.Module, inputs: tuple) -> list:
    """(aval, source) of each residual the block's backward keeps."""
    loss, params = block_loss(block, inputs)
    return saved_residuals(loss, params, inputs[:-1])


def compiled_temp_bytes(block: nn.Module, inputs: tuple) -> int:
    """XLA's temp buffer bytes of the block's jitted gradient on the default backend."""
    loss, params = block_loss(block, inputs)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, inputs[:-1]).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def summarize(name: str, found: list, top: int) -> dict:
    by_dtype, by_source = collections.Counter(), collections.Counter()
    for aval, source in found:
        size = int(np.prod(aval.shape)) * aval.dtype.itemsize
        by_dtype[str(aval.dtype)] += size
        by_source[f"{aval.dtype}{list(aval.shape)} {source}"] += size
    total = sum(by_dtype.values())
    print(f"{name}: {len(found)} residuals, {total / 2**20:.3f} MiB")
    for dtype, size in by_dtype.most_common():
        print(f"  {dtype:10s} {size / 2**20:9.3f} MiB")
    for source, size in by_source.most_common(top):
        print(f"    {size / 2**20:9.3f} MiB  {source}")
    return dict(total=total, **by_dtype)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--img", type=int, default=64)
    parser.add_argument("--txt", type=int, default=64)
    parser.add_argument("--top", type=int, default=12, help="largest residual sources to list")
    parser.add_argument("--compiled", action="store_true", help="also compile each block's gradient")
    args = parser.parse_args()
    x = block_inputs(args)
    common = dict(hidden_size=args.width, num_heads=args.heads, mlp_ratio=4.0, dtype=jnp.bfloat16)
    joint = jnp.concatenate([x["txt"], x["img"]], axis=1)
    blocks = {
        "double block": (DoubleStreamBlock(**common), (x["img"], x["txt"], x["vec"], x["pe"])),
        "single block": (SingleStreamBlock(**common), (joint, x["vec"], x["pe"])),
    }
    for name, (block, inputs) in blocks.items():
        summarize(name, residuals(block, inputs), args.top)
        if args.compiled:
            temp = compiled_temp_bytes(block, inputs)
            print(f"  compiled gradient on {jax.default_backend()}: temp {temp / 2**20:.3f} MiB")


if __name__ == "__main__":
    main()
