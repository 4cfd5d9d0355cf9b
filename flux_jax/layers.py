"""FLUX.1 building blocks in Flax linen, one class per BFL concept.

Every linear layer is a `dense(...)`: float32 params, configurable compute dtype, logical axis
names for sharding, and an injectable dot_general (the FP8 hook), which receives the float32 kernel
and makes its own low-precision copy of it. Blocks never branch on FP8; they only pass
`dot_general_cls` (token GEMMs) and `modulation_dot_general_cls` (the per-sample modulation GEMM,
whose M is the batch size) through.
"""

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from flux_jax.fp8_attention import Fp8Attention
from flux_jax.fp8_dot import Fp8Spec
from flux_jax.math import attention, compute_dtype_dot, float32_kernel_dot, rms_norm_rope
from flux_jax.sharding import constrain

DotGeneralFactory = Callable[[], nn.Module] | None
Init = Callable[..., jax.Array]

xavier = nn.initializers.xavier_uniform()
zeros = nn.initializers.zeros_init()


def activation_names(ndim: int, features: tuple[str | None, ...]) -> tuple[str | None, ...]:
    """Logical names of a (B, [L,] *features) activation whose feature axes carry kernel axes `features`."""
    names = tuple(None if f is None else f"act_{f}" for f in features)
    return ("act_batch",) + ("act_len",) * (ndim - 1 - len(names)) + names


def promote_all_but_kernel(inputs, kernel, bias, dtype=None):
    """nn.Dense's dtype promotion with the kernel left in its param dtype (float32): the dot_general
    casts it. ``compute_dtype_dot`` rounds it to the input's dtype, as nn.Dense would; the FP8 dot
    quantizes it straight from float32 to the same FP8 bits, without writing and reading a bf16 copy."""
    inputs, bias = nn.dtypes.promote_dtype(inputs, bias, dtype=dtype)
    return inputs, kernel, bias


class Dense(nn.Module):
    """nn.Dense over the trailing ``len(axes) - len(features)`` input axes, with float32 params whose
    kernel axes carry the logical names ``axes`` (contracted input axes, then the feature axes), its
    input and output pinned to the layout those names imply.

    A column-parallel layer (kernel ("embed", "mlp")) takes a tensor-replicated input and gives a
    tensor-sharded output; a row-parallel one (("mlp", "embed")) the reverse: the Megatron layout
    the act_* rules describe. Left to sharding propagation, the embed side can come out
    tensor-sharded instead, and XLA's SPMD partitioner miscompiles that dot when data, fsdp and
    tensor are all > 1 (batch over (data, fsdp), kernel features over fsdp, result features over
    tensor: it swaps the batch shards of two devices). Pinning both sides keeps every weight dot
    on layouts it partitions correctly; without a mesh the constraints are no-ops.

    The kernel is drawn as the (inputs, outputs) matrix and reshaped, so a fused kernel (``fused_dense``)
    holds the values of its flat form; a matrix kernel is nn.Dense's, value for value.
    """

    features: tuple[int, ...]
    axes: tuple[str | None, ...]
    dtype: Any
    dot_general_cls: DotGeneralFactory = None
    kernel_init: Init = xavier
    use_bias: bool = True
    dot_general: Callable = compute_dtype_dot

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        n_in = len(self.axes) - len(self.features)
        in_shape = inputs.shape[inputs.ndim - n_in :]
        inputs = constrain(inputs, activation_names(inputs.ndim, self.axes[:n_in]))
        kernel_init = nn.with_logical_partitioning(_drawn_flat(self.kernel_init, n_in), self.axes)
        kernel = self.param("kernel", kernel_init, in_shape + self.features, jnp.float32)
        bias = None
        if self.use_bias:
            bias_init = nn.with_logical_partitioning(zeros, self.axes[n_in:])
            bias = self.param("bias", bias_init, self.features, jnp.float32)
        inputs, kernel, bias = promote_all_but_kernel(inputs, kernel, bias, dtype=self.dtype)
        dot_general = self.dot_general_cls() if self.dot_general_cls is not None else self.dot_general
        contract = (tuple(range(inputs.ndim - n_in, inputs.ndim)), tuple(range(n_in)))
        y = dot_general(inputs, kernel, (contract, ((), ())), precision=None)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - bias.ndim) + bias.shape)
        return constrain(y, activation_names(y.ndim, self.axes[n_in:]))


def _drawn_flat(init: Init, n_in: int) -> Init:
    """``init`` drawn at the (inputs, outputs) matrix shape, then reshaped to the kernel's shape."""

    def draw(key, shape, dtype=jnp.float32):
        flat = (math.prod(shape[:n_in]), math.prod(shape[n_in:]))
        return init(key, flat, dtype).reshape(shape)

    return draw


def dense(
    features: int | tuple[int, ...],
    axes: tuple[str | None, ...],
    name: str,
    dtype: Any,
    dot_general_cls: DotGeneralFactory,
    kernel_init: Init = xavier,
    use_bias: bool = True,
    dot_general: Callable = compute_dtype_dot,
) -> nn.Module:
    """Dense with logically partitioned float32 params; a zero kernel_init also zeros the bias.

    ``axes`` names the kernel's axes: the contracted trailing input axes, then ``features``.
    ``dot_general`` is the 16-bit dot, used when ``dot_general_cls`` is None.
    """
    features = (features,) if isinstance(features, int) else tuple(features)
    return Dense(features, tuple(axes), dtype, dot_general_cls, kernel_init, use_bias, dot_general, name=name)


def fused_dense(
    parts: int, width: int, axis: str, name: str, dtype: Any, dot_general_cls: DotGeneralFactory, **kw
) -> nn.Module:
    """Column-parallel dense whose ``parts * width`` outputs (BFL's fused q|k|v|..., one flat Linear)
    are laid out as (parts, width) with the tensor axis on ``width``: kernel (dim, parts, width).

    Megatron's head-aligned layout: each tensor shard holds its slice of every part (its heads of q,
    k and v, its features of the MLP input, its share of each modulation chunk), so the parts split
    locally. Flat kernel (dim, parts * width) == this kernel reshaped (row-major); convert maps it.
    """
    return dense((parts, width), ("embed", None, axis), name, dtype, dot_general_cls, **kw)


def layer_norm(name: str, dtype: Any) -> nn.LayerNorm:
    """LayerNorm without affine params, eps 1e-6 (BFL's elementwise_affine=False)."""
    return nn.LayerNorm(epsilon=1e-6, use_bias=False, use_scale=False, dtype=dtype, name=name)


def split_heads(x: jax.Array, num_heads: int) -> list[jax.Array]:
    """'B L K (H D) -> K x (B L H D)': a fused projection's parts (BFL's K H D order) split into heads."""
    b, length, parts, width = x.shape
    x = x.reshape(b, length, parts, num_heads, width // num_heads)
    return [x[:, :, i] for i in range(parts)]


class MLPEmbedder(nn.Module):
    """out_layer(silu(in_layer(x)))."""

    hidden_dim: int
    dtype: Any = jnp.bfloat16
    dot_general_cls: DotGeneralFactory = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.normal(0.02)
        x = dense(self.hidden_dim, ("in", "mlp"), "in_layer", self.dtype, self.dot_general_cls, init)(x)
        x = nn.silu(x)
        return dense(self.hidden_dim, ("mlp", "embed"), "out_layer", self.dtype, self.dot_general_cls, init)(
            x
        )


class RMSNorm(nn.Module):
    """RMS normalisation in float32, cast back to the input dtype, times `scale`, cast to `dtype`, then
    RoPE by `pe`: one `rms_norm_rope` (its backward keeps no float32 intermediates)."""

    @nn.compact
    def __call__(self, x: jax.Array, pe: jax.Array, dtype: Any) -> jax.Array:
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones_init(), (None,)),
            (x.shape[-1],),
            jnp.float32,
        )
        return rms_norm_rope(x, scale, pe, dtype)


class QKNorm(nn.Module):
    """Per-head RMSNorm and RoPE of q and k; both come back in v's dtype, rotated by `pe`."""

    @nn.compact
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, pe: jax.Array) -> tuple[jax.Array, ...]:
        return RMSNorm(name="query_norm")(q, pe, v.dtype), RMSNorm(name="key_norm")(k, pe, v.dtype)


class SelfAttention(nn.Module):
    """Holds qkv, norm and proj; the attention itself runs jointly in the block."""

    dim: int
    num_heads: int
    qkv_bias: bool = True
    dtype: Any = jnp.bfloat16
    dot_general_cls: DotGeneralFactory = None

    def setup(self):
        self.qkv = fused_dense(
            3, self.dim, "qkv", "qkv", self.dtype, self.dot_general_cls, use_bias=self.qkv_bias
        )
        self.norm = QKNorm()
        self.proj = dense(self.dim, ("heads", "embed"), "proj", self.dtype, self.dot_general_cls)

    def heads(self, x: jax.Array, pe: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x (B, L, dim) -> normalised and rotated q, k, and v, each (B, L, H, D); pe: x's tokens' RoPE."""
        q, k, v = split_heads(self.qkv(x), self.num_heads)
        q, k = self.norm(q, k, v, pe)
        return q, k, v

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(x)


class Modulation(nn.Module):
    """lin(silu(vec)) split into (shift, scale, gate) once, or twice when `double`. In 16 bits `lin` runs
    on its float32 kernel (``float32_kernel_dot``): M is the batch, so the GEMM is the kernel's bytes."""

    dim: int
    double: bool
    dtype: Any = jnp.bfloat16
    dot_general_cls: DotGeneralFactory = None

    @nn.compact
    def __call__(self, vec: jax.Array) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
        n = 6 if self.double else 3
        lin = fused_dense(
            n,
            self.dim,
            "mod",
            "lin",
            self.dtype,
            self.dot_general_cls,
            kernel_init=zeros,
            dot_general=float32_kernel_dot,
        )
        out = lin(nn.silu(vec))
        # (B, n, dim) gathered over tensor, as the residual stream they modulate is: otherwise sharding
        # propagation splits the norms and the residual by features and gathers (B, L, dim) activations.
        out = constrain(out, ("act_batch", None, "act_embed"))
        chunks = [out[:, None, i] for i in range(n)]
        return [tuple(chunks[i : i + 3]) for i in range(0, n, 3)]


def joint_attention(block: nn.Module, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """The block's joint attention of q, k rotated by QKNorm: FP8 (cuDNN) when the block runs FP8 and
    ``attention_fp8`` is set (``config.fp8_dot_product_attention``), else ``attention_impl`` in 16 bits."""
    if block.attention_fp8 is not None and block.dot_general_cls is not None:
        out = Fp8Attention(block.attention_fp8, name="fp8_attention")(q, k, v)
    else:
        out = attention(q, k, v, None, block.attention_impl)
    return checkpoint_name(out, "attention_out")


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    return (1 + scale) * x + shift


@jax.checkpoint
def gelu(x: jax.Array) -> jax.Array:
    """GELU, tanh approximation (BFL's approximate="tanh"), keeping only x for the backward.

    Plain autodiff keeps up to four M x 4*width intermediates (tanh and its pieces); under
    jax.checkpoint the backward recomputes them from x in its own fusion, as PyTorch's GELU does.
    Same values forward and backward; on one H100 at the block shape 0.28 (BF16) / 0.36 (FP8) GiB
    less peak memory at the same step time (benchmarks/RESULTS.md, tenth run).
    """
    return nn.gelu(x, approximate=True)


class DoubleStreamBlock(nn.Module):
    """Separate image and text weights, joint attention over [txt, img]."""

    hidden_size: int
    num_heads: int
    mlp_ratio: float
    qkv_bias: bool = True
    dtype: Any = jnp.bfloat16
    dot_general_cls: DotGeneralFactory = None
    modulation_dot_general_cls: DotGeneralFactory = None
    attention_impl: str = "xla"
    attention_fp8: Fp8Spec | None = None  # FP8 attention's spec (fp8_dot_product_attention), or None

    @nn.compact
    def __call__(self, img: jax.Array, txt: jax.Array, vec: jax.Array, pe: jax.Array):
        dim, dg = self.hidden_size, self.dot_general_cls
        mlp_dim = int(dim * self.mlp_ratio)
        streams = {}
        for s in ("img", "txt"):
            streams[s] = dict(
                mod=Modulation(dim, True, self.dtype, self.modulation_dot_general_cls, name=f"{s}_mod"),
                norm1=layer_norm(f"{s}_norm1", self.dtype),
                attn=SelfAttention(dim, self.num_heads, self.qkv_bias, self.dtype, dg, name=f"{s}_attn"),
                norm2=layer_norm(f"{s}_norm2", self.dtype),
                mlp_0=dense(mlp_dim, ("embed", "mlp"), f"{s}_mlp_0", self.dtype, dg),
                mlp_2=dense(dim, ("mlp", "embed"), f"{s}_mlp_2", self.dtype, dg),
            )
        x = {"img": img, "txt": txt}
        n_txt = txt.shape[1]
        stream_pe = {"txt": pe[:, :n_txt], "img": pe[:, n_txt:]}  # RoPE is per token: rotate each stream
        mods, qkv = {}, {}
        for s, m in streams.items():
            mods[s] = m["mod"](vec)
            shift, scale, _ = mods[s][0]
            qkv[s] = m["attn"].heads(modulate(m["norm1"](x[s]), shift, scale), stream_pe[s])
        q, k, v = (jnp.concatenate([qkv["txt"][i], qkv["img"][i]], axis=1) for i in range(3))
        attn = joint_attention(self, q, k, v)
        attn_out = {"txt": attn[:, :n_txt], "img": attn[:, n_txt:]}
        for s, m in streams.items():
            (_, _, gate1), (shift2, scale2, gate2) = mods[s]
            h = x[s] + gate1 * m["attn"](attn_out[s])
            mlp_in = modulate(m["norm2"](h), shift2, scale2)
            x[s] = h + gate2 * m["mlp_2"](gelu(m["mlp_0"](mlp_in)))
        return x["img"], x["txt"]


class SingleStreamBlock(nn.Module):
    """Parallel attention + MLP on the joint sequence (linear1 fuses qkv and the MLP input)."""

    hidden_size: int
    num_heads: int
    mlp_ratio: float
    dtype: Any = jnp.bfloat16
    dot_general_cls: DotGeneralFactory = None
    modulation_dot_general_cls: DotGeneralFactory = None
    attention_impl: str = "xla"
    attention_fp8: Fp8Spec | None = None  # FP8 attention's spec (fp8_dot_product_attention), or None

    @nn.compact
    def __call__(self, x: jax.Array, vec: jax.Array, pe: jax.Array) -> jax.Array:
        dim, dg = self.hidden_size, self.dot_general_cls
        mlp_dim = int(dim * self.mlp_ratio)
        mod = Modulation(dim, False, self.dtype, self.modulation_dot_general_cls, name="modulation")
        ((shift, scale, gate),) = mod(vec)
        x_mod = modulate(layer_norm("pre_norm", self.dtype)(x), shift, scale)
        # linear1's 3 * dim + mlp_dim outputs as 3 + mlp_dim / dim parts of dim (q, k, v, the MLP input);
        # linear2's inputs likewise (the attention output, the MLP activation), each tensor-split alike.
        mlp_parts = mlp_dim // dim
        h = fused_dense(3 + mlp_parts, dim, "qkv", "linear1", self.dtype, dg)(x_mod)
        q, k, v = split_heads(h[:, :, :3], self.num_heads)
        q, k = QKNorm(name="norm")(q, k, v, pe)
        attn = joint_attention(self, q, k, v)
        mlp = gelu(h[:, :, 3:])
        b, length = attn.shape[:2]
        joined = jnp.concatenate([attn.reshape(b, length, 1, dim), mlp], axis=2)
        out = dense(dim, (None, "mlp", "embed"), "linear2", self.dtype, dg)(joined)
        return x + gate * out


class LastLayer(nn.Module):
    """adaLN (shift first, then scale) and the output projection; zero-initialised."""

    hidden_size: int
    out_channels: int
    dtype: Any = jnp.bfloat16
    dot_general_cls: DotGeneralFactory = None

    @nn.compact
    def __call__(self, x: jax.Array, vec: jax.Array) -> jax.Array:
        dg = self.dot_general_cls
        mod = dense(2 * self.hidden_size, ("embed", "mod"), "adaLN_modulation_1", self.dtype, dg, zeros)(
            nn.silu(vec)
        )
        shift, scale = jnp.split(mod[:, None, :], 2, axis=-1)
        x = modulate(layer_norm("norm_final", self.dtype)(x), shift, scale)
        return dense(self.out_channels, ("embed", None), "linear", self.dtype, dg, zeros)(x)
