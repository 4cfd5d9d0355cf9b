"""FP8 joint attention through cuDNN's fused FP8 flash attention (forward and backward, Hopper).

Opt-in (``config.fp8_dot_product_attention``); attention stays BF16 otherwise. JAX 0.11 reaches
cuDNN's FP8 kernels only through ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(...,
use_fp8=True)``: q, k, v, the output gradient, the output and dq, dk, dv are all E4M3 tensors with
per-tensor scales, and cuDNN reports the amax of the output and of each gradient it writes.

Scaling, per call site (one per block):
- q, k, v: current scaling (their amax, then the cast).
- the softmax P (in [0, 1]): the fixed scale 1 / fp8 max, exact.
- the output O: each row is a convex combination of V's rows, so |O| <= amax(v): v's scale, exact.
- dO, dq, dk, dv and dP (the gradient of P): delayed scaling from an amax history in ``fp8_meta``,
  as Transformer Engine's FP8 attention does. Their amaxes come back as the cotangent of the state
  (the overwrite-with-gradient convention of ``fp8_dot``).

Scale convention as in ``fp8_dot``: ``scale`` is the divisor, ``x ~= q * scale``; cuDNN's
"descale" is that divisor and its "scale" the reciprocal.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from flux_jax.fp8_cast import amax_of, fp8_max, quantize
from flux_jax.fp8_dot import (
    MAX_GRAD_DTYPE,
    Fp8Spec,
    as_max_grad,
    from_max_grad,
    history_amax,
    scale_from_amax,
    scaling_state,
    state_entries,
)
from flux_jax.math import apply_rope

# The backward quantities under delayed scaling; each has ``{name}_amax_history`` and ``{name}_scale``.
GRAD_OPERANDS = ("dO", "dQ", "dK", "dV", "dP")
FIELD = "config.fp8_dot_product_attention"


def check_shape(q_shape, k_shape) -> None:
    """cuDNN's FP8 training kernels: head dim 128 and both sequence lengths multiples of 128."""
    _, t, _, d = q_shape
    s = k_shape[1]
    if d != 128 or t % 128 or s % 128:
        raise ValueError(
            f"{FIELD}=True: cuDNN's FP8 attention trains only with head dim 128 and sequence lengths "
            f"that are multiples of 128; this model has head dim {d} and {t} tokens (text + image). "
            f"Set {FIELD}=False, or choose data.txt_len / data.image_size / model width and heads to fit."
        )


def cudnn_fp8_attention(q8, k8, v8, params: dict, scale: float):
    """The cuDNN FP8 kernel: (o8, amax_s, amax_o); differentiable, the params' cotangent holds amaxes."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention
    except ImportError as err:  # pragma: no cover - depends on the installed jax
        raise ValueError(
            f"{FIELD}=True needs jax's cuDNN fused attention module, which this jax ({jax.__version__}) "
            f"lacks ({err}); set {FIELD}=False."
        ) from err
    return dot_product_attention(q8, k8, v8, fp8_params=params, scale=scale, use_fp8=True)


def _kernel_params(grad_scales: dict, sq, sk, sv, dtype) -> dict:
    """The 17 scalars cuDNN's FP8 attention takes, as (1, 1, 1, 1) float32 arrays."""
    one = lambda x: jnp.reshape(jnp.asarray(x, jnp.float32), (1, 1, 1, 1))  # noqa: E731
    s_p = 1.0 / fp8_max(dtype)  # P <= 1
    g = grad_scales
    params = {
        "descale_q": sq,
        "descale_k": sk,
        "descale_v": sv,
        "descale_s": s_p,
        "scale_s": 1.0 / s_p,
        "scale_o": 1.0 / sv,
        "descale_o": sv,
        "descale_dO": g["dO"],
        "descale_dP": g["dP"],
        "scale_dQ": 1.0 / g["dQ"],
        "scale_dK": 1.0 / g["dK"],
        "scale_dV": 1.0 / g["dV"],
        "scale_dP": 1.0 / g["dP"],
        **{f"amax_{n}": 0.0 for n in ("dQ", "dK", "dV", "dP")},
    }
    return {k: one(v) for k, v in params.items()}


def _grad_scales(meta, spec: Fp8Spec, dtype) -> dict:
    return {
        n: scale_from_amax(
            history_amax(meta[f"{n}_amax_history"], spec.amax_compute_algo),
            meta[f"{n}_scale"],
            dtype,
            spec.margin,
        )
        for n in GRAD_OPERANDS
    }


def _quantize_qkv(q, k, v, dtype):
    scales = [scale_from_amax(amax_of(x), jnp.float32(1.0), dtype, 0.0) for x in (q, k, v)]
    return [quantize(x, dtype, s) for x, s in zip((q, k, v), scales)], scales


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def fp8_attention(q, k, v, meta, spec: Fp8Spec, max_grad: bool, kernel=cudnn_fp8_attention):
    """softmax(q k^T / sqrt(D)) v in FP8, (B, L, H, D) x3 -> (B, L, H, D) in q's dtype.

    ``meta``: the site's delayed-scaling state for the backward quantities; its cotangent is the new
    state. ``kernel``: the FP8 kernel (cuDNN; the tests pass an XLA emulation of the same contract).
    """
    return _fwd(q, k, v, meta, spec, max_grad, kernel, training=False)[0]


def _fwd(q, k, v, meta, spec, max_grad, kernel, training=True):
    dtype = spec.fwd_dtype
    meta = from_max_grad(meta) if max_grad else meta
    (q8, k8, v8), (sq, sk, sv) = _quantize_qkv(q, k, v, dtype)
    grad_scales = _grad_scales(meta, spec, dtype)
    params = _kernel_params(grad_scales, sq, sk, sv, dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if not training:
        o8 = kernel(q8, k8, v8, params, scale)[0]
        return (o8.astype(jnp.float32) * sv).astype(q.dtype), None
    (o8, _, _), vjp = jax.vjp(lambda a, b, c, p: kernel(a, b, c, p, scale), q8, k8, v8, params)
    out = (o8.astype(jnp.float32) * sv).astype(q.dtype)
    return out, (vjp, grad_scales, meta)


def _fwd_rule(q, k, v, meta, spec, max_grad, kernel):
    return _fwd(q, k, v, meta, spec, max_grad, kernel)


def _bwd_rule(spec, max_grad, kernel, res, g):
    vjp, grad_scales, meta = res
    g8 = quantize(g, spec.fwd_dtype, grad_scales["dO"])
    ones = jnp.ones((1, 1, 1, 1), jnp.float32)
    dq8, dk8, dv8, dparams = vjp((g8, ones, ones))
    amaxes = {n: jnp.reshape(dparams[f"amax_{n}"], ()) for n in ("dQ", "dK", "dV", "dP")}
    amaxes["dO"] = amax_of(g)
    new = {}
    for n in GRAD_OPERANDS:
        new.update(state_entries(meta, n, amaxes[n], grad_scales[n]))
    dq, dk, dv = (
        (x.astype(jnp.float32) * grad_scales[n]).astype(g.dtype)
        for x, n in ((dq8, "dQ"), (dk8, "dK"), (dv8, "dV"))
    )
    return dq, dk, dv, as_max_grad(new) if max_grad else new


fp8_attention.defvjp(_fwd_rule, _bwd_rule)


class Fp8Attention(nn.Module):
    """Rotary joint attention in FP8 with its backward scaling state: (B, L, H, D) x3 -> (B, L, H*D)."""

    spec: Fp8Spec = Fp8Spec()
    kernel: object = None  # None: cudnn_fp8_attention

    @nn.compact
    def __call__(self, q, k, v, pe=None):
        if pe is not None:  # None: q and k come rotated (the blocks' QKNorm applies RoPE)
            q, k = apply_rope(q, pe), apply_rope(k, pe)
        check_shape(q.shape, k.shape)
        meta = scaling_state(self, GRAD_OPERANDS, self.spec.amax_history_len)
        max_grad = all(x.dtype == MAX_GRAD_DTYPE for x in meta.values())
        if not max_grad:
            meta = jax.tree.map(lambda x: x.astype(jnp.float32), meta)
        out = fp8_attention(q, k, v, meta, self.spec, max_grad, self.kernel or cudnn_fp8_attention)
        return out.reshape(*out.shape[:-2], -1)
