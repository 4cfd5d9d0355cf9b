"""FP8 dot_general for Flax: scaling math, the custom-VJP matmul and its state module.

The GEMMs take FP8 operands straight into ``lax.dot_general`` (with ``preferred_element_type``) and
multiply the result by scalar scales afterwards: that is the form XLA rewrites into a cuBLASLt /
hipBLASLt FP8 GEMM. A quantize-dequantize formulation is easily broken by other XLA passes and
silently falls back to a 16-bit dot.

Scale convention: ``scale`` is the divisor, ``q = clip(x / scale, -max, max)``, ``x ~= q * scale``.
State lives in the ``fp8_meta`` collection; its new value is returned as the cotangent of the old
one (overwrite-with-gradient), so the train step takes it from the gradient tree.
"""

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import fp8_ops
from jax import lax

from flux_jax.fp8_cast import amax_of, cast, fp8_max, lead_to_end, quantize, round_to
from flux_jax.math import compute_dtype_dot

FP8_COLLECTION = "fp8_meta"
# Optional, per step: each FP8 dot's kernel cast made once (``cast_kernels``), read instead of casting.
FP8_WEIGHTS = "fp8_weights"
WEIGHT_ENTRIES = ("kernel_q", "kernel_q_t", "kernel_scale", "kernel_amax")
OPERANDS = ("input", "kernel", "output_grad")
RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8")
AMAX_ALGOS = ("most_recent", "max")
# An extended float32 dtype whose cotangents combine by max: several uses of one fp8_meta leaf
# (a shared module, a broadcast scan) must keep the largest amax, not the sum.
MAX_GRAD_DTYPE = fp8_ops.fp32_max_grad


@dataclasses.dataclass(frozen=True)
class Fp8Spec:
    """Static description of one FP8 dot: dtypes and recipe parameters."""

    fwd_dtype: Any = jnp.float8_e4m3fn
    bwd_dtype: Any = jnp.float8_e5m2
    recipe: str = "delayed"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: float = 0.0
    wgrad: bool = True
    cast_kernel: str = "xla"  # one of fp8_cast.CAST_KERNELS


def scale_from_amax(amax, old_scale, dtype, margin):
    """Divisor scale mapping ``amax`` to the format max; keeps ``old_scale`` if amax is unusable."""
    new = amax * (2.0**margin) / fp8_max(dtype)
    usable = jnp.isfinite(amax) & (amax > 0)
    return jnp.where(usable, new, old_scale).astype(jnp.float32)


def history_amax(history, algo):
    if algo == "most_recent":
        return history[0]
    return jnp.max(history)


def push_history(history, amax):
    """Roll the window by one and put the newest amax at index 0."""
    return jnp.roll(history, -1).at[0].set(amax)


def cast_with_state(x, meta, name, dtype, spec: Fp8Spec, transpose: int, via=None):
    """Quantize ``x`` by its per-tensor recipe: (q, q.T or None, scale used, new meta entries).

    ``transpose``: False, or how many leading axes ``q.T`` moves to the end (``fp8_cast.cast``)."""
    q, q_t, use, amax = quantize_with_state(x, meta, name, dtype, spec, transpose, via)
    return q, q_t, use, state_entries(meta, name, amax, use)


def state_entries(meta, name, amax, use):
    """The new meta entries of one operand after a cast that used ``use`` and saw ``amax``."""
    return {f"{name}_amax_history": push_history(meta[f"{name}_amax_history"], amax), f"{name}_scale": use}


def quantize_with_state(x, meta, name, dtype, spec: Fp8Spec, transpose: int, via=None):
    """(q, q.T or None, scale used, amax of x) by the per-tensor recipe; ``x`` rounded to ``via`` first.

    Delayed scaling quantizes with the scale from the history *before* the current amax goes in,
    so amax and cast share one pass over ``x``; tensorwise scales by the current amax (a first
    pass) but still records it so summaries and a later recipe switch see real data.
    """
    history, old = meta[f"{name}_amax_history"], meta[f"{name}_scale"]
    if spec.recipe == "tensorwise":
        amax = amax_of(x if via is None else round_to(x, via))
        use = scale_from_amax(amax, old, dtype, spec.margin)
        q, q_t, _ = cast(x, dtype, use, transpose, spec.cast_kernel, via)
    else:
        use = scale_from_amax(history_amax(history, spec.amax_compute_algo), old, dtype, spec.margin)
        q, q_t, amax = cast(x, dtype, use, transpose, spec.cast_kernel, via)
    return q, q_t, use, amax


def cast_kernel(w, meta, spec: Fp8Spec, via=None, n_in: int = 1) -> dict:
    """One FP8 dot's kernel cast, made once per step: the ``fp8_weights`` entries of that dot.

    ``n_in``: the kernel's contracted (input) axes, leading; ``kernel_q_t`` has them last."""
    q, q_t, use, amax = quantize_with_state(w, meta, "kernel", spec.fwd_dtype, spec, n_in, via)
    return {"kernel_q": q, "kernel_q_t": q_t, "kernel_scale": use, "kernel_amax": amax}


def cast_kernels(params, fp8_meta, spec: Fp8Spec, dtype) -> dict:
    """The kernel casts of every FP8 dot, for the ``fp8_weights`` collection (same paths as fp8_meta).

    Under gradient accumulation the FP8 dots then read these instead of casting their kernel on each
    micro batch (XLA does not hoist the casts out of the loop). ``dtype`` is the model's compute dtype,
    the one the dot rounds its float32 kernel to, so the cast is the one the dot would make. Scanned blocks
    (a leading layer axis on params and meta) are cast layer by layer. Per-tensor recipes only.
    """
    if spec.recipe not in ("delayed", "tensorwise"):
        return {}

    def one(w, meta, n_in):
        return cast_kernel(w, meta, spec, via=dtype, n_in=n_in)

    def walk(p, m):
        out = {}
        for k, v in m.items():
            if "kernel_scale" not in v:
                if k in p:  # else state without a kernel (FP8 attention's)
                    out[k] = walk(p[k], v)
                continue
            # An Fp8DotGeneral's state; the Dense that owns it holds the kernel.
            w, layers, n_in = p["kernel"], v["kernel_amax_history"].ndim - 1, input_axes(p)
            if layers == 0:
                out[k] = one(w, v, n_in)
            elif layers == 1:
                out[k] = lax.map(lambda a, n_in=n_in: one(*a, n_in), (w, v))
            else:
                raise ValueError(f"fp8_meta entry {k!r} has {layers} stacked axes; at most one is supported.")
        return out

    return walk(params, fp8_meta)


def input_axes(dense_params) -> int:
    """How many leading axes of a Dense's ``kernel`` it contracts (``contracted_axes`` of its leaves'
    shapes; the leaves may be arrays or ``jax.ShapeDtypeStruct``s)."""
    kernel, bias = dense_params["kernel"], dense_params.get("bias")
    return contracted_axes(np.shape(kernel), None if bias is None else np.shape(bias))


def contracted_axes(kernel_shape: tuple[int, ...], bias_shape: tuple[int, ...] | None) -> int:
    """The kernel axes a Dense contracts: those its bias (shaped like the output features) does not
    have; 1 without a bias. A fused projection (kernel (dim, parts, width)) contracts 1, linear2
    (kernel (parts, dim, width), bias (width,)) 2."""
    return 1 if bias_shape is None else len(kernel_shape) - len(bias_shape)


def _fp8_dot_nt(a, b_t, sa, sb, out_dtype, n: int = 1):
    """(M,*K) fp8 @ (*N,*K)^T fp8, both contracted on their ``n`` minor axes (the FP8 GEMM layout:
    (M,K) @ (N,K)^T for matrices), with the scalar scales folded onto the output."""
    ca, cb = tuple(range(a.ndim - n, a.ndim)), tuple(range(b_t.ndim - n, b_t.ndim))
    out = lax.dot_general(a, b_t, ((ca, cb), ((), ())), preferred_element_type=out_dtype)
    return out * (sa * sb).astype(out_dtype)


def rowwise_quantize(x, dtype, axis):
    """Quantize with one scale per slice along ``axis`` (the contracted axes), keepdims."""
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / fp8_max(dtype), 1.0)
    return quantize(x, dtype, scale), scale


def rowwise_matmul(a, b, dtype_a, dtype_b, out_dtype, n: int = 1):
    """(M,*K) @ (*K,*N) over the ``n`` axes of K: per-row scales of a, per-column scales of b, applied
    to the GEMM output."""
    ka, kb = tuple(range(a.ndim - n, a.ndim)), tuple(range(n))
    qa, sa = rowwise_quantize(a, dtype_a, ka)
    qb, sb = rowwise_quantize(b, dtype_b, kb)
    out = lax.dot_general(qa, qb, ((ka, kb), ((), ())), preferred_element_type=jnp.float32)
    sa = sa.reshape(sa.shape[: a.ndim - n] + (1,) * (b.ndim - n))
    sb = sb.reshape((1,) * (a.ndim - n) + sb.shape[n:])
    return (out * sa * sb).astype(out_dtype)


def _plain_dot(a, b, out_dtype):
    """(*K, M) @ (M, *N) over M: the 16-bit weight gradient of a kernel with any number of axes."""
    return lax.dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())), preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def fp8_matmul(x, w, meta, cached, spec: Fp8Spec, out_dtype, max_grad: bool = False, w_dtype=None):
    """y = x @ w in FP8 for x (M,*K), w (*K,*N), contracted over K; ``meta`` is the dict of six state
    arrays. A matrix w is the plain GEMM; a fused kernel keeps its axes, so a tensor-parallel mesh
    splits its parts locally, and each device runs the (M,K) @ (K,N) GEMM on its slice.

    ``w`` may be the float32 master kernel of a 16-bit ``x``: it is quantized as its copy in x's
    dtype would be (the same bits), straight from float32, and its gradient, the GEMM's output in
    ``out_dtype``, is converted to ``w_dtype`` (w's dtype; default ``out_dtype``). ``cached``: None,
    or this dot's ``cast_kernel`` made earlier in the step; w is then only the anchor of its
    gradient. ``max_grad``: meta arrives in MAX_GRAD_DTYPE and its cotangent (the new state) goes
    back in it.
    """
    return _fp8_matmul_fwd(x, w, meta, cached, spec, out_dtype, max_grad, w_dtype)[0]


def _fp8_matmul_fwd(x, w, meta, cached, spec: Fp8Spec, out_dtype, max_grad=False, w_dtype=None):
    del w_dtype  # the backward's
    if max_grad:
        meta = from_max_grad(meta)
    if spec.recipe == "rowwise":
        # The 16-bit copy's values, also under XLA's excess precision (see round_to).
        w = round_to(w, x.dtype).astype(x.dtype)
        y = rowwise_matmul(x, w, spec.fwd_dtype, spec.fwd_dtype, out_dtype, x.ndim - 1)
        new = dict(meta)
        for name, v in (("input", x), ("kernel", w)):
            amax = amax_of(v)
            new[f"{name}_amax_history"] = push_history(meta[f"{name}_amax_history"], amax)
            new[f"{name}_scale"] = scale_from_amax(amax, meta[f"{name}_scale"], spec.fwd_dtype, 0.0)
        return y, (x, w, new, cached)
    new = dict(meta)
    # x.T feeds the FP8 weight-gradient GEMM; w.T (N,K) the forward, w (K,N) the data gradient.
    n_in = x.ndim - 1
    qx, qx_t, sx, upd_x = cast_with_state(x, meta, "input", spec.fwd_dtype, spec, spec.wgrad)
    if cached is None:
        qw, qw_t, sw, upd_w = cast_with_state(w, meta, "kernel", spec.fwd_dtype, spec, n_in, x.dtype)
    else:
        qw, qw_t, sw = cached["kernel_q"], cached["kernel_q_t"], cached["kernel_scale"]
        upd_w = state_entries(meta, "kernel", cached["kernel_amax"], sw)
    new.update(upd_x)
    new.update(upd_w)
    y = _fp8_dot_nt(qx, qw_t, sx, sw, out_dtype, n_in)
    # Without an FP8 wgrad the weight-gradient GEMM needs the 16-bit activation.
    saved_x = (qx_t, sx) if spec.wgrad else (x, None)
    return y, (saved_x, (qw, sw), new, cached)


def _fp8_matmul_bwd(spec: Fp8Spec, out_dtype, max_grad, w_dtype, res, g):
    *res, cached = res
    dx, dw, new = _fp8_matmul_grads(spec, out_dtype, tuple(res), g)
    # The cached casts are step inputs, not functions of w: no gradient flows through them.
    zeros = jax.tree.map(jnp.zeros_like, cached)
    dw = dw.astype(out_dtype if w_dtype is None else w_dtype)
    return dx, dw, as_max_grad(new) if max_grad else new, zeros


def _fp8_matmul_grads(spec: Fp8Spec, out_dtype, res, g):
    if spec.recipe == "rowwise":
        x, w, new = res
        gd, n_out = spec.bwd_dtype, g.ndim - 1
        dx = rowwise_matmul(g, lead_to_end(w, x.ndim - 1), gd, spec.fwd_dtype, x.dtype, n_out)
        if spec.wgrad:
            dw = rowwise_matmul(lead_to_end(x, 1), g, spec.fwd_dtype, gd, w.dtype)
        else:
            dw = _plain_dot(lead_to_end(x, 1), g.astype(x.dtype), w.dtype)
        amax = amax_of(g)
        new = dict(new)
        new["output_grad_amax_history"] = push_history(new["output_grad_amax_history"], amax)
        new["output_grad_scale"] = scale_from_amax(amax, new["output_grad_scale"], gd, 0.0)
        return dx, dw, new
    (saved_x, sx), (qw, sw), new = res
    new = dict(new)
    qg, qg_t, sg, upd = cast_with_state(g, new, "output_grad", spec.bwd_dtype, spec, spec.wgrad)
    new.update(upd)
    dx = _fp8_dot_nt(qg, qw, sg, sw, out_dtype, g.ndim - 1)
    if spec.wgrad:
        dw = _fp8_dot_nt(saved_x, qg_t, sx, sg, out_dtype)  # (K,M) x (N,M) -> (K,N)
    else:
        dw = _plain_dot(lead_to_end(saved_x, 1), g.astype(saved_x.dtype), out_dtype)
    return dx, dw, new


fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def dense_layout(lhs_ndim, rhs_ndim, dimension_numbers):
    """Number of contracted axes when the dot is a plain dense: lhs trailing axes @ rhs leading axes.

    Returns None for any other layout (batch dims, permuted contraction).
    """
    (lc, rc), (lb, rb) = dimension_numbers
    n = len(lc)
    if lb or rb or n == 0 or len(rc) != n:
        return None
    if tuple(lc) != tuple(range(lhs_ndim - n, lhs_ndim)) or tuple(rc) != tuple(range(n)):
        return None
    if rhs_ndim <= n:
        return None
    return n


def as_max_grad(tree):
    """Cast fp8_meta leaves to the max-combining dtype; do it once, inside the differentiated fn."""
    return jax.tree.map(lambda v: lax.convert_element_type(v, MAX_GRAD_DTYPE), tree)


def from_max_grad(tree):
    return jax.tree.map(lambda v: lax.convert_element_type(v, jnp.float32), tree)


@jax.custom_vjp
def hold_state(y, meta):
    """``y``, with ``meta`` handed back unchanged as its own cotangent: a dot that holds FP8 state but
    does not use it leaves that state as it was (an unused input would get a zero cotangent, which
    the overwrite-with-gradient convention would write over the scales)."""
    del meta
    return y


def _hold_state_fwd(y, meta):
    return y, meta


def _hold_state_bwd(meta, g):
    return g, meta


hold_state.defvjp(_hold_state_fwd, _hold_state_bwd)


def scaling_state(module: nn.Module, operands, amax_history_len: int) -> dict:
    """Declares (or reads) ``{operand}_amax_history`` and ``{operand}_scale`` in ``module``'s fp8_meta
    collection for each operand and returns their values by name."""
    n_hist = max(1, amax_history_len)
    meta = {}
    for name in operands:
        h = module.variable(FP8_COLLECTION, f"{name}_amax_history", jnp.zeros, (n_hist,), jnp.float32)
        s = module.variable(FP8_COLLECTION, f"{name}_scale", jnp.ones, (), jnp.float32)
        meta[f"{name}_amax_history"], meta[f"{name}_scale"] = h.value, s.value
    return meta


class Fp8DotGeneral(nn.Module):
    """Drop-in for ``lax.dot_general`` in ``nn.Dense(dot_general_cls=...)`` running FP8 GEMMs.

    ``enabled=False``: a BF16 layer of an FP8 run (``first_last_layers_bf16``). It declares the same
    FP8 state, so the ``fp8_meta`` tree does not depend on which layers run FP8, computes the 16-bit
    dot a plain Dense would (bit-equal values and gradients) and keeps its state unchanged.
    """

    spec: Fp8Spec = Fp8Spec()
    enabled: bool = True

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        spec = self.spec
        if not self.enabled:
            y = compute_dtype_dot(lhs, rhs, dimension_numbers, precision, preferred_element_type)
            meta = self._scaling_state()
            return hold_state(y, meta) if meta else y
        del precision  # FP8 GEMMs have one precision.
        # rhs may be the float32 master kernel of a 16-bit lhs: the product is in lhs's dtype.
        out_dtype = preferred_element_type or lhs.dtype
        n = dense_layout(lhs.ndim, rhs.ndim, dimension_numbers)
        if n is None:
            raise ValueError(
                f"Fp8DotGeneral supports dense layouts only (lhs trailing axes @ rhs leading axes, no "
                f"batch dims); got dimension_numbers={dimension_numbers}. Keep this site in BF16."
            )
        batch_shape, in_shape, out_shape = lhs.shape[: lhs.ndim - n], rhs.shape[:n], rhs.shape[n:]
        if spec.recipe in ("blockwise", "mxfp8"):
            # Block scales are computed per call; there is no state to carry. Matrices, as before.
            y = block_scaled_dot(
                lhs.reshape(*batch_shape, math.prod(in_shape)),
                rhs.astype(lhs.dtype).reshape(math.prod(in_shape), -1),
                (((len(batch_shape),), (0,)), ((), ())),
                out_dtype,
            )
            return y.reshape(*batch_shape, *out_shape)
        meta = self._scaling_state()
        max_grad = all(v.dtype == MAX_GRAD_DTYPE for v in meta.values())
        if not max_grad:
            meta = jax.tree.map(lambda v: v.astype(jnp.float32), meta)
        x = lhs.reshape(-1, *in_shape)
        w = rhs
        y = fp8_matmul(x, w, meta, _cached_kernel_of(self, w, n), spec, out_dtype, max_grad, w.dtype)
        return y.reshape(*batch_shape, *out_shape)

    def _scaling_state(self) -> dict:
        """This dot's scaling state (amax history and scale per operand); none for block-scaled recipes."""
        if self.spec.recipe in ("blockwise", "mxfp8"):
            return {}
        return scaling_state(self, OPERANDS, self.spec.amax_history_len)


def _cached_kernel_of(module: nn.Module, w, n_in: int):
    if not module.has_variable(FP8_WEIGHTS, "kernel_q"):
        return None
    cached = {k: module.get_variable(FP8_WEIGHTS, k) for k in WEIGHT_ENTRIES}
    want_t = w.shape[n_in:] + w.shape[:n_in]
    if cached["kernel_q"].shape != w.shape or cached["kernel_q_t"].shape != want_t:
        raise ValueError(
            f"{FP8_WEIGHTS} entry of {'/'.join(module.scope.path)} has shapes {cached['kernel_q'].shape} "
            f"and {cached['kernel_q_t'].shape}, the kernel {w.shape} contracted over its first {n_in} "
            "axes; rebuild it with fp8.cast_kernels from the current params."
        )
    return cached


def block_scaled_dot(lhs, rhs, dimension_numbers, out_dtype):
    """MXFP8 block-scaled GEMM (forward and both gradients) through jax.nn.scaled_dot_general."""
    cfg = jax.nn.get_scaled_dot_general_config("mxfp8")
    return jax.nn.scaled_dot_general(
        lhs, rhs, dimension_numbers, preferred_element_type=out_dtype, configs=[cfg, cfg, cfg]
    )
