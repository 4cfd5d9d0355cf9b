"""FP8 (cuDNN) against BF16 (cuDNN) rotary joint attention, forward + backward, at one shape: time and
error, both against a float32 XLA reference computed from the same bf16 inputs.

    python benchmarks/fp8_attention.py --batch 4 --tokens 1536 --heads 24   # the block shape

Errors are ||x - ref|| / ||ref|| for the output and dq, dk, dv, after ``--steps`` calls that carry the
FP8 backward's delayed-scaling state forward (the first call's gradients use unit scales).
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import median_seconds
from flux_jax import fp8, fp8_attention, math


def inputs(batch, tokens, heads, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    shape = (batch, tokens, heads, 128)
    q, k, v = (jax.random.normal(x, shape, jnp.float32).astype(jnp.bfloat16) for x in ks[:3])
    g = jax.random.normal(ks[3], (batch, tokens, heads * 128), jnp.float32).astype(jnp.bfloat16)
    side = int(np.sqrt(tokens))
    ids = np.stack([np.zeros(tokens), np.arange(tokens) // side, np.arange(tokens) % side], -1)
    pe = math.embed_nd(jnp.broadcast_to(jnp.asarray(ids, jnp.float32), (batch, tokens, 3)), (16, 56, 56), 1e4)
    return (q, k, v), pe, g


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    qkv, pe, g = inputs(args.batch, args.tokens, args.heads)
    spec = fp8.Fp8Spec(jnp.float8_e4m3fn, jnp.float8_e5m2, amax_history_len=16)
    mod = fp8_attention.Fp8Attention(spec)
    meta = mod.init(jax.random.key(0), *qkv, pe)["fp8_meta"]

    def grads_of(attend):
        def f(qkv, meta):
            def loss(qkv, meta):
                out = attend(qkv, meta)
                return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32)), out

            return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(qkv, meta)

        return jax.jit(f)

    fp8_step = grads_of(lambda qkv, m: mod.apply({"fp8_meta": fp8.as_max_grad(m)}, *qkv, pe))
    variants = {
        "xla_f32": grads_of(lambda qkv, m: math.attention(*(x.astype(jnp.float32) for x in qkv), pe, "xla")),
        "cudnn_bf16": grads_of(lambda qkv, m: math.attention(*qkv, pe, "cudnn")),
    }
    ref = None
    results = {}
    for name, f in variants.items():
        (_, out), (d, _) = f(qkv, meta)
        if ref is None:
            ref = (out, d)
        results[name] = {"ms": 1e3 * median_seconds(f, (qkv, meta), args.iters)}
        results[name] |= {"out_err": rel(out, ref[0])} | {
            f"d{n}_err": rel(a, b) for n, a, b in zip("qkv", d, ref[1])
        }
    m = meta
    for _ in range(args.steps):
        (_, out), (d, new) = fp8_step(qkv, m)
        m = fp8.from_max_grad(new)
    results["cudnn_fp8"] = {"ms": 1e3 * median_seconds(fp8_step, (qkv, m), args.iters)}
    results["cudnn_fp8"] |= {"out_err": rel(out, ref[0])} | {
        f"d{n}_err": rel(a, b) for n, a, b in zip("qkv", d, ref[1])
    }
    results["cudnn_fp8"]["amax"] = {n: float(m[f"{n}_amax_history"][0]) for n in fp8_attention.GRAD_OPERANDS}
    results["cudnn_fp8"]["true_amax"] = {
        f"d{n}": float(jnp.max(jnp.abs(x.astype(jnp.float32)))) for n, x in zip("QKV", ref[1])
    }
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"{'variant':<12} fwd+bwd ms  out err  dq err  dk err  dv err")
    for name, r in results.items():
        errs = " ".join(f"{r[k]:7.4f}" for k in ("out_err", "dq_err", "dk_err", "dv_err"))
        print(f"{name:<12} {r['ms']:10.3f} {errs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
