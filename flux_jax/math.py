"""Pure numerical pieces of FLUX.1: timestep embedding, RoPE and joint attention.

Layout is B L H D throughout (batch, tokens, heads, head_dim), the layout
`jax.nn.dot_product_attention` and JAX's Pallas flash attention take, so no transposes sit around
attention.
"""

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp


def timestep_embedding(
    t: jax.Array, dim: int = 256, max_period: float = 10000.0, time_factor: float = 1000.0
) -> jax.Array:
    """Sinusoidal embedding of t in [0, 1], cos first, computed in float32 as BFL does."""
    t = time_factor * t.astype(jnp.float32)
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args = t[:, None] * freqs[None, :]
    emb = jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)
    if dim % 2:
        emb = jnp.concatenate([emb, jnp.zeros_like(emb[:, :1])], axis=-1)
    return emb


def rope(pos: jax.Array, dim: int, theta: float) -> jax.Array:
    """2x2 rotation matrices for one position axis: (..., L) -> (..., L, dim/2, 2, 2), float32."""
    if dim % 2:
        raise ValueError(f"FluxParams.axes_dim entries must be even, got {dim}; fix axes_dim.")
    scale = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    omega = 1.0 / (theta**scale)
    out = pos.astype(jnp.float32)[..., None] * omega.reshape((1,) * pos.ndim + omega.shape)
    cos, sin = jnp.cos(out), jnp.sin(out)
    rot = jnp.stack([cos, -sin, sin, cos], axis=-1)
    return rot.reshape(*rot.shape[:-1], 2, 2)


def embed_nd(ids: jax.Array, axes_dim: tuple[int, ...], theta: float) -> jax.Array:
    """Rotary tables for (B, L, n_axes) ids -> (B, L, 1, head_dim/2, 2, 2), broadcast over heads."""
    if ids.shape[-1] != len(axes_dim):
        raise ValueError(
            f"ids have {ids.shape[-1]} position axes but FluxParams.axes_dim has {len(axes_dim)}; "
            "make them agree."
        )
    emb = jnp.concatenate([rope(ids[..., i], d, theta) for i, d in enumerate(axes_dim)], axis=-3)
    return emb[:, :, None]


def apply_rope(x: jax.Array, pe: jax.Array) -> jax.Array:
    """Rotate adjacent (interleaved) pairs of the head dim in float32; returns x's dtype."""
    return _rotate(x.astype(jnp.float32), pe).astype(x.dtype)


RMS_NORM_EPS = 1e-6


def _rotate(x32: jax.Array, pe: jax.Array) -> jax.Array:
    """apply_rope's float32 rotation: out_i = pe[i, 0] x_0 + pe[i, 1] x_1 for each adjacent pair."""
    x_pairs = x32.reshape(*x32.shape[:-1], -1, 1, 2)
    out = pe[..., 0] * x_pairs[..., 0] + pe[..., 1] * x_pairs[..., 1]
    return out.reshape(x32.shape)


def _rotate_transpose(g32: jax.Array, pe: jax.Array) -> jax.Array:
    """The transpose of ``_rotate`` in x: g_j = pe[0, j] g_0 + pe[1, j] g_1 for each pair."""
    g_pairs = g32.reshape(*g32.shape[:-1], -1, 2, 1)
    out = pe[..., 0, :] * g_pairs[..., 0, :] + pe[..., 1, :] * g_pairs[..., 1, :]
    return out.reshape(g32.shape)


def _sum_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sum x over the axes it was broadcast along from ``shape``."""
    x = jnp.sum(x, axis=tuple(range(x.ndim - len(shape))))
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _row(scale: jax.Array, ndim: int) -> jax.Array:
    return scale.reshape((1,) * (ndim - 1) + scale.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def rms_norm_rope(x: jax.Array, scale: jax.Array, pe: jax.Array, dtype: Any) -> jax.Array:
    """RMSNorm of the head dim (float32 math, rounded to x's dtype, times ``scale``), cast to ``dtype``,
    then RoPE (apply_rope): (B, L, H, D) -> (B, L, H, D) in ``dtype``.

    Bit-equal to the RMSNorm-then-``apply_rope`` composition it replaces (the same ops in the same
    order; ``norm_then_rope`` in tests/conftest.py). The backward keeps only x, scale, pe and one
    float32 per row (the mean square + eps), where autodiff of that composition keeps float32 copies
    of x and of the normed x. It is their analytic gradient with autodiff's roundings (to ``dtype``
    after RoPE's transpose, to x's dtype after the scale), and it reduces over the row only for the
    sum RMSNorm's gradient needs.
    """
    return _rms_norm_rope_fwd(x, scale, pe, dtype)[0]


def _rms_norm_rope_fwd(x, scale, pe, dtype):
    x32, scale_row = x.astype(jnp.float32), _row(scale, x.ndim)
    mean_sq = jnp.mean(x32 * x32, axis=-1, keepdims=True) + RMS_NORM_EPS
    y = ((x32 * jax.lax.rsqrt(mean_sq)).astype(x.dtype) * scale_row).astype(dtype)
    out = _rotate(y.astype(jnp.float32), pe).astype(dtype)
    return out, (x, scale, pe, mean_sq)


def _rms_norm_rope_bwd(dtype, res, g):
    x, scale, pe, mean_sq = res
    x32, r, scale_row = x.astype(jnp.float32), jax.lax.rsqrt(mean_sq), _row(scale, x.ndim)
    normed32 = (x32 * r).astype(x.dtype).astype(jnp.float32)
    g32 = g.astype(jnp.float32)
    # RoPE's transpose, rounded where autodiff rounds it (the cast to `dtype` before RoPE).
    g_y = _rotate_transpose(g32, pe).astype(dtype).astype(jnp.float32)
    g_scale = jnp.sum(g_y * normed32, axis=tuple(range(x.ndim - 1))).astype(scale.dtype)
    g_normed = (g_y * scale_row).astype(x.dtype).astype(jnp.float32)
    # d/dx of x * rsqrt(mean(x^2) + eps), in autodiff's order: rsqrt' = -0.5 * r / mean_sq.
    g_mean = jnp.sum(x32 * g_normed, axis=-1, keepdims=True) * (-0.5 * (r / mean_sq)) / x.shape[-1]
    g_x = g_normed * r + x32 * g_mean + g_mean * x32
    # pe's gradient (unused in training: pe comes from the positions): sum over heads of g_i x_j.
    y32 = (normed32 * scale_row).astype(dtype).astype(jnp.float32)
    g_pe = g32.reshape(*g.shape[:-1], -1, 2, 1) * y32.reshape(*x.shape[:-1], -1, 1, 2)
    g_pe = _sum_to(g_pe, pe.shape).astype(pe.dtype)
    return g_x.astype(x.dtype), g_scale, g_pe


rms_norm_rope.defvjp(_rms_norm_rope_fwd, _rms_norm_rope_bwd)


# "xla": jax.nn.dot_product_attention's XLA softmax(QK^T)V; "cudnn": its cuDNN fused kernel (NVIDIA);
# "pallas": JAX's Pallas (Triton-lowered) flash attention, forward and backward (NVIDIA and ROCm).
IMPLEMENTATIONS = ("xla", "cudnn", "pallas")
# Pallas flash attention tiles (queries x keys): forward 128 x 64, backward 64 x 64 for both the dK/dV
# and the dQ loops; benchmarks/attention.py times these against the kernel's defaults and neighbours.
FLASH_BLOCKS = dict(block_q=128, block_k=64, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, pe: jax.Array | None, implementation: str = "xla"
) -> jax.Array:
    """Rotary joint attention, no mask: (B, L, H, D) x3 -> (B, L, H*D). ``pe=None``: q and k come
    rotated already (``rms_norm_rope``)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}."
        )
    if pe is not None:
        q, k = apply_rope(q, pe), apply_rope(k, pe)
    if implementation == "pallas":
        out = flash_attention(q, k, v)
    else:
        out = jax.nn.dot_product_attention(q, k, v, implementation=implementation)
    return out.reshape(*out.shape[:-2], -1)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, blocks: dict | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(D)) v by JAX's Pallas GPU flash attention, (B, L, H, D) -> (B, L, H, D).

    The kernel tiles the sequence, so L is padded to a whole number of tiles; the padding tokens get
    segment id 0 and the real ones 1, so no real query attends to padding. Off GPU the kernel runs in
    the Pallas interpreter (tests).
    """
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    blocks = dict(FLASH_BLOCKS if blocks is None else blocks)
    length = q.shape[1]
    # Tiles are powers of two of at least 16 (Triton's smallest dot); short sequences take one tile.
    tile = max(16, min(max(blocks.values()), 1 << (length - 1).bit_length()))
    blocks = {name: min(size, tile) for name, size in blocks.items()}
    padded = -(-length // tile) * tile
    segment_ids = None
    if padded != length:
        pad = ((0, 0), (0, padded - length), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
        real = (jnp.arange(padded) < length).astype(jnp.int32)
        segment_ids = jnp.broadcast_to(real, (q.shape[0], padded))
    out = pallas_attention.mha(
        q,
        k,
        v,
        segment_ids,
        sm_scale=1.0 / math.sqrt(q.shape[-1]),
        block_sizes=pallas_attention.BlockSizes(**blocks),
        interpret=jax.default_backend() == "cpu",
    )
    return out[:, :length]


def compute_dtype_dot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """``lax.dot_general`` with the kernel (rhs) in the input's dtype: the 16-bit dense GEMM."""
    return jax.lax.dot_general(
        lhs,
        rhs.astype(lhs.dtype),
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _float32_kernel_dot(lhs, rhs, dimension_numbers, precision):
    return _float32_kernel_dot_fwd(lhs, rhs, dimension_numbers, precision)[0]


def _float32_kernel_dot_fwd(lhs, rhs, dimension_numbers, precision):
    wide = rhs.dtype
    out = jax.lax.dot_general(
        lhs.astype(wide), rhs, dimension_numbers, precision=precision, preferred_element_type=wide
    )
    return out.astype(lhs.dtype), (lhs, rhs)


def _float32_kernel_dot_bwd(dimension_numbers, precision, res, g):
    lhs, rhs = res
    wide, batch = rhs.dtype, tuple(range(lhs.ndim - 1))
    # rhs (K, *N), g (..., *N): dx contracts the feature axes against the float32 kernel; dw leaves
    # the GEMM in the input's dtype, as the 16-bit dot's does.
    features = (tuple(range(lhs.ndim - 1, g.ndim)), tuple(range(1, rhs.ndim)))
    dx = jax.lax.dot_general(g.astype(wide), rhs, (features, ((), ())), precision=precision)
    dw = jax.lax.dot_general(lhs, g, ((batch, batch), ((), ())), precision=precision)
    return dx.astype(lhs.dtype), dw.astype(wide)


_float32_kernel_dot.defvjp(_float32_kernel_dot_fwd, _float32_kernel_dot_bwd)


def float32_kernel_dot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """Dense's dot on the float32 kernel itself: the input promoted, the product accumulated and rounded
    back to the input's dtype. For the per-sample modulation GEMM (M = batch rows against 27% of the
    block shape's parameters), which ``compute_dtype_dot`` makes write, save and read a 16-bit copy of its
    kernel; here the forward and the input gradient read the float32 kernel once each and nothing is saved
    but the input. The kernel gradient is the 16-bit dot's: the input times the output gradient, in the
    input's dtype."""
    contract = ((lhs.ndim - 1,), (0,))
    if tuple(map(tuple, dimension_numbers[0])) != contract or any(dimension_numbers[1]) or rhs.ndim < 2:
        raise ValueError(f"float32_kernel_dot is Dense's (..., K) x (K, *N) dot; got {dimension_numbers}.")
    if preferred_element_type is not None and preferred_element_type != lhs.dtype:
        raise ValueError("float32_kernel_dot returns the input's dtype; preferred_element_type must be None.")
    # A fused kernel (K, parts, width) keeps its axes: as a (K, parts * width) matrix a tensor-split
    # width would be gathered.
    return _float32_kernel_dot(lhs, rhs, (contract, ((), ())), precision)
