"""FP8 (cuDNN) against BF16 (cuDNN) rotary joint attention, forward + backward, at one shape: time and
error, both against a float32 XLA reference computed from the same bf16 inputs.

    python benchmarks/fp8_attention.py --batch 4 --tokens 1536 --heads 24   # the block shape

Errors are ||x - ref|| / ||ref|| for the output and dq, dk, dv, after ``--steps`` calls that carry the
FP8 backward's delayed-scaling state forward (the first call's gradients use unit scales).

    python benchmarks/fp8_attention.py --probe-slots

instead calls the FP8 kernel directly, once with every scale set from a float32 evaluation of the same
FP8 inputs (with 4x headroom), then once per scale slot with that slot doubled. A slot with a linear
effect doubles exactly the outputs it feeds (``SLOT_EFFECTS``); a ratio other than the one listed
names a slot that the kernel reads differently from cuDNN's documented contract. It also prints which
tensor's maximum ``amax_dP`` is (dS, or dO V^T) and the baseline's errors against float32.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import median_seconds
from flux_jax import fp8, fp8_attention, fp8_cast, math


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


OUTPUTS = ("o", "amax_s", "amax_o", "dq", "dk", "dv", "amax_dQ", "amax_dK", "amax_dV", "amax_dP")
# Each slot doubled: the outputs that double (2) or change other than linearly (None); all others stay (1).
# From the contract: O = P8 V descale_s descale_v; dV = P8^T dO; D = rowsum(O dO); dS = P (dO V^T - D);
# dQ, dK from dS quantized at scale_dP and dequantized with descale_dP; amaxes before the output scale.
SLOT_EFFECTS = {
    "descale_v": {"o": 2, "amax_o": 2, "dq": 2, "dk": 2, "amax_dQ": 2, "amax_dK": 2, "amax_dP": 2},
    "descale_s": {"o": 2, "amax_o": 2, "dv": 2, "amax_dV": 2, "dq": None, "dk": None}
    | {"amax_dQ": None, "amax_dK": None, "amax_dP": None},
    "scale_o": {"o": 2, "dq": None, "dk": None, "amax_dQ": None, "amax_dK": None, "amax_dP": None},
    "descale_o": {"dq": None, "dk": None, "amax_dQ": None, "amax_dK": None, "amax_dP": None},
    "descale_dO": {"dq": 2, "dk": 2, "dv": 2, "amax_dQ": 2, "amax_dK": 2, "amax_dV": 2, "amax_dP": 2},
    "descale_dP": {"dq": 2, "dk": 2, "amax_dQ": 2, "amax_dK": 2},
    "scale_dP": {"dq": 2, "dk": 2, "amax_dQ": 2, "amax_dK": 2},
    "scale_dQ": {"dq": 2},
    "scale_dK": {"dk": 2},
    "scale_dV": {"dv": 2},
}


def slot_probe(kernel, shape=(1, 256, 2, 128), seed: int = 0, headroom: float = 4.0) -> dict:
    """The FP8 attention kernel's response to each scale slot; see the module docstring."""
    dtype = jnp.float8_e4m3fn
    fmax = fp8_cast.fp8_max(dtype)
    f32 = jnp.float32
    ks = jax.random.split(jax.random.key(seed), 4)
    raw = [jax.random.normal(x, shape, f32) for x in ks]
    divisors = [fp8_cast.amax_of(x) / fmax for x in raw]  # current scaling
    q8, k8, v8, do8 = (fp8_cast.quantize(x, dtype, d) for x, d in zip(raw, divisors))
    q, k, v, do = (x.astype(f32) * d for x, d in zip((q8, k8, v8, do8), divisors))
    attn_scale = 1.0 / float(np.sqrt(shape[-1]))
    # float32 truth from the FP8 inputs.
    p = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) * attn_scale, axis=-1)
    o = jnp.einsum("bhts,bshd->bthd", p, v)
    dp = jnp.einsum("bthd,bshd->bhts", do, v)
    ds = p * (dp - jnp.einsum("bthd,bthd->bht", o, do)[..., None]) * attn_scale
    truth = {
        "o": o,
        "dq": jnp.einsum("bhts,bshd->bthd", ds, k),
        "dk": jnp.einsum("bhts,bthd->bshd", ds, q),
        "dv": jnp.einsum("bhts,bthd->bshd", p, do),
    }
    amax = {n: float(jnp.max(jnp.abs(x))) for n, x in truth.items()} | {"dS": float(jnp.max(jnp.abs(ds)))}
    scale = {n: fmax / (headroom * amax[n]) for n in ("o", "dq", "dk", "dv", "dS")}  # multipliers
    params = {
        "descale_q": divisors[0],
        "descale_k": divisors[1],
        "descale_v": divisors[2],
        "descale_dO": divisors[3],
        "descale_s": 1.0 / fmax,
        "scale_s": fmax,
        "scale_o": scale["o"],
        "descale_o": 1.0 / scale["o"],
        "scale_dP": scale["dS"],
        "descale_dP": 1.0 / scale["dS"],
        "scale_dQ": scale["dq"],
        "scale_dK": scale["dk"],
        "scale_dV": scale["dv"],
        **{f"amax_{n}": 0.0 for n in ("dQ", "dK", "dV", "dP")},
    }
    params = {n: jnp.reshape(jnp.asarray(x, f32), (1, 1, 1, 1)) for n, x in params.items()}

    @jax.jit
    def run(params):
        (o8, amax_s, amax_o), vjp = jax.vjp(
            lambda a, b, c, p: kernel(a, b, c, p, attn_scale), q8, k8, v8, params
        )
        one = jnp.ones((1, 1, 1, 1), f32)
        dq8, dk8, dv8, dparams = vjp((do8, one, one))
        return {"o": o8, "amax_s": amax_s, "amax_o": amax_o, "dq": dq8, "dk": dk8, "dv": dv8} | {
            f"amax_{n}": dparams[f"amax_{n}"] for n in ("dQ", "dK", "dV", "dP")
        }

    def outputs(params):
        got = run(params)
        return {n: np.abs(np.asarray(got[n], np.float64)).sum() for n in OUTPUTS}, got

    base, got = outputs(params)
    errors = {
        n: rel(got[n].astype(f32) / params[f"scale_{s}"].reshape(()), truth[n])
        for n, s in (("o", "o"), ("dq", "dQ"), ("dk", "dK"), ("dv", "dV"))
    }
    amax_dp = float(got["amax_dP"].reshape(()))
    slots = {}
    for slot, effects in SLOT_EFFECTS.items():
        ratios, _ = outputs(params | {slot: params[slot] * 2})
        ratios = {n: float(ratios[n] / base[n]) if base[n] else float("nan") for n in OUTPUTS}
        wrong = {
            n: (round(r, 4), effects.get(n, 1))
            for n, r in ratios.items()
            if effects.get(n, 1) is not None and not abs(r - effects.get(n, 1)) < 0.05
        }
        slots[slot] = {"ratios": ratios, "unexpected": wrong}
    return {
        "errors_vs_float32": errors,
        "amax_dP": amax_dp,
        "max_abs_dS": amax["dS"],
        "max_abs_dOVt": float(jnp.max(jnp.abs(dp))),
        "slots": slots,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="")
    p.add_argument("--probe-slots", action="store_true", help="map the kernel's scale slots (see above)")
    args = p.parse_args(argv)
    if args.probe_slots:
        found = slot_probe(fp8_attention.cudnn_fp8_attention)
        print(json.dumps(found, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(found, f, indent=1)
        for slot, r in found["slots"].items():
            print(f"{slot:<11} {'as documented' if not r['unexpected'] else r['unexpected']}")
        return 0
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
