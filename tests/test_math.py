"""Properties of the pure FLUX.1 math against independent numpy formulations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import norm_then_rope

from flux_jax.math import (
    apply_rope,
    attention,
    compute_dtype_dot,
    embed_nd,
    flash_attention,
    float32_kernel_dot,
    rms_norm_rope,
    rope,
    timestep_embedding,
)


def test_timestep_embedding_is_cos_first_float32():
    t = np.array([0.0, 0.25, 1.0], np.float32)
    emb = np.asarray(timestep_embedding(jnp.asarray(t, jnp.bfloat16), dim=8))
    freqs = np.exp(-math.log(10000.0) * np.arange(4) / 4)
    args = 1000.0 * t[:, None] * freqs[None, :]
    np.testing.assert_allclose(emb, np.concatenate([np.cos(args), np.sin(args)], 1), rtol=1e-5, atol=1e-4)
    assert timestep_embedding(jnp.asarray(t, jnp.bfloat16)).dtype == jnp.float32
    assert timestep_embedding(jnp.asarray(t)).shape == (3, 256)


def test_apply_rope_rotates_interleaved_pairs_like_complex_multiplication():
    rng = np.random.default_rng(0)
    axes_dim, theta = (2, 4, 6), 10_000
    ids = rng.integers(0, 9, size=(2, 5, 3)).astype(np.float32)
    x = rng.normal(size=(2, 5, 3, sum(axes_dim))).astype(np.float32)
    out = np.asarray(apply_rope(jnp.asarray(x), embed_nd(jnp.asarray(ids), axes_dim, theta)))

    angles = np.concatenate(
        [ids[..., i : i + 1] / theta ** (np.arange(0, d, 2) / d) for i, d in enumerate(axes_dim)], -1
    )
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angles)[:, :, None, :]
    expected = np.stack([z.real, z.imag], -1).reshape(x.shape)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_rope_tables_shapes_and_errors():
    pe = embed_nd(jnp.zeros((2, 7, 3)), (4, 6, 6), 10_000)
    assert pe.shape == (2, 7, 1, 8, 2, 2) and pe.dtype == jnp.float32
    with pytest.raises(ValueError, match="axes_dim"):
        embed_nd(jnp.zeros((2, 7, 2)), (4, 6, 6), 10_000)
    with pytest.raises(ValueError, match="even"):
        rope(jnp.zeros((1, 3)), 5, 10_000)


def _norm_rope_case(dtype, pe_batch: int):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 7, 3, 16)) * 3, dtype)
    scale = jnp.asarray(1 + 0.2 * rng.normal(size=(16,)), jnp.float32)
    pe = embed_nd(jnp.asarray(rng.integers(0, 20, (pe_batch, 7, 3)), jnp.float32), (4, 6, 6), 10_000)
    g = jnp.asarray(rng.normal(size=x.shape), dtype)
    return x, scale, pe, g


def _vjp(fn, x, scale, pe, g, dtype):
    out, vjp = jax.vjp(lambda *a: fn(*a, dtype), x, scale, pe)
    return (out, *vjp(g))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("pe_batch", [2, 1])
def test_rms_norm_rope_is_norm_then_rope_op_for_op(dtype, pe_batch):
    x, scale, pe, g = _norm_rope_case(dtype, pe_batch)
    # Op by op the forward and the analytic backward (x, scale and pe, broadcast over heads and here
    # over the batch) reproduce autodiff of the composition bit for bit: same ops, same order, same
    # roundings (the gradient is rounded to dtype after RoPE's transpose and to x's dtype after scale).
    got = _vjp(rms_norm_rope, x, scale, pe, g, dtype)
    want = _vjp(norm_then_rope, x, scale, pe, g, dtype)
    assert [a.dtype for a in got] == [a.dtype for a in want] == [dtype, dtype, jnp.float32, jnp.float32]
    assert [a.shape for a in got] == [a.shape for a in want] == [x.shape, x.shape, scale.shape, pe.shape]
    # On a GPU the gradients of the broadcast inputs (scale, pe) are sums whose order the two sides'
    # reduce kernels choose: on an H100, 28% of pe's float32 gradient differed by one float32 rounding.
    exact = 4 if jax.default_backend() == "cpu" else 2
    for a, b in zip(got[:exact], want[:exact]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    for a, b in zip(got[exact:], want[exact:]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * np.abs(b).max())
    # Jitted, XLA fuses each side differently (the row sums and the scale's sum over rows may be
    # reassociated), so gradients agree to float32 rounding. The jitted forward is bit-equal on the CPU.
    # On an H200 XLA's GPU fusions round the composition's steps differently: 3% of the bf16 outputs
    # differed, by up to 0.0042 (where RoPE cancels, 27% of a small value) in outputs up to 3.3. So on a
    # GPU both are held to the float32 evaluation instead: within one bf16 ulp of the largest output.
    got = jax.jit(_vjp, static_argnums=(0, 5))(rms_norm_rope, x, scale, pe, g, dtype)
    want = jax.jit(_vjp, static_argnums=(0, 5))(norm_then_rope, x, scale, pe, g, dtype)
    a, b = np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(a, b)
    else:
        f32 = (x.astype(jnp.float32), scale, pe, g.astype(jnp.float32), jnp.float32)
        truth = np.asarray(jax.jit(_vjp, static_argnums=(0, 5))(norm_then_rope, *f32)[0])
        tol = (2.0**-7 if dtype == jnp.bfloat16 else 1e-6) * np.abs(truth).max()
        np.testing.assert_allclose(a, truth, rtol=0, atol=tol, err_msg="rms_norm_rope vs float32")
        np.testing.assert_allclose(b, truth, rtol=0, atol=tol, err_msg="norm_then_rope vs float32")
    rtol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-5
    for a, b in zip(got[1:], want[1:]):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())


def test_rms_norm_rope_saves_no_float32_copy_for_the_backward():
    from jax._src.ad_checkpoint import saved_residuals

    x, scale, pe, _ = _norm_rope_case(jnp.bfloat16, 2)

    def saved(fn):
        res = saved_residuals(lambda x, s: fn(x, s, pe, jnp.bfloat16), x, scale)
        return sorted((tuple(a.shape), str(a.dtype)) for a, _ in res)

    # x, scale, pe and the mean square per row (B, L, H, 1) only.
    assert saved(rms_norm_rope) == sorted(
        [(x.shape, "bfloat16"), (scale.shape, "float32"), (pe.shape, "float32"), ((2, 7, 3, 1), "float32")]
    )
    # Autodiff of the composition keeps float32 copies of x and of the normed x (and pe's halves).
    assert saved(norm_then_rope).count((x.shape, "float32")) >= 2


def test_rope_attention_scores_depend_on_relative_position_only():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)

    def score(m, n):
        pm = embed_nd(jnp.full((1, 1, 1), float(m)), (8,), 10_000)
        pn = embed_nd(jnp.full((1, 1, 1), float(n)), (8,), 10_000)
        return float(jnp.sum(apply_rope(q, pm) * apply_rope(k, pn)))

    assert score(3, 1) == pytest.approx(score(12, 10), rel=1e-4)
    assert score(3, 1) != pytest.approx(score(3, 2), rel=1e-3)


def test_attention_matches_softmax_reference_at_zero_positions():
    rng = np.random.default_rng(2)
    b, length, h, d = 2, 6, 3, 8
    q, k, v = (rng.normal(size=(b, length, h, d)).astype(np.float32) for _ in range(3))
    pe = embed_nd(jnp.zeros((b, length, 1)), (d,), 10_000)
    out = np.asarray(attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), pe))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, length, h * d)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="implementation"):
        attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), pe, implementation="flash")


def _qkv(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=shape), dtype) for _ in range(4)]


def _fwd_bwd(attend, q, k, v, g):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, *vjp(g)


@pytest.mark.parametrize("length", [32, 20])  # 20: padded to a tile, the padding masked out
def test_pallas_flash_attention_matches_xla_values_and_gradients(length):
    # The Pallas interpreter on the CPU: the kernel's own code, forward and backward.
    q, k, v, g = _qkv((2, length, 2, 16), jnp.float32, length)
    blocks = dict(block_q=16, block_k=16, block_q_dkv=16, block_kv_dkv=16, block_q_dq=16, block_kv_dq=16)
    got = _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, blocks), q, k, v, g)
    want = _fwd_bwd(jax.nn.dot_product_attention, q, k, v, g)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_attention_pallas_applies_rope_first():
    q, k, v, _ = _qkv((1, 16, 2, 16), jnp.float32, 3)
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 9, size=(1, 16, 3)), jnp.float32)
    pe = embed_nd(ids, (4, 6, 6), 10_000)
    np.testing.assert_allclose(
        np.asarray(attention(q, k, v, pe, "pallas")), np.asarray(attention(q, k, v, pe, "xla")), atol=1e-5
    )


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Pallas kernel needs a GPU")
@pytest.mark.parametrize("length", [1536, 300])
def test_pallas_flash_attention_on_gpu_matches_xla(length):
    q, k, v, g = _qkv((2, length, 4, 128), jnp.bfloat16, length)
    got = jax.jit(lambda *a: _fwd_bwd(flash_attention, *a))(q, k, v, g)
    want = jax.jit(lambda *a: _fwd_bwd(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), *a))(
        *(x.astype(jnp.float32) for x in (q, k, v, g))
    )
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2


def test_float32_kernel_dot_reads_the_float32_kernel_and_keeps_the_16_bit_kernel_gradient():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(4, 1, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(64, 96)) * 0.1, jnp.float32)
    g = jnp.asarray(rng.normal(size=(4, 1, 96)), jnp.bfloat16)
    dn = (((2,), (0,)), ((), ()))

    def run(dot):
        out, vjp = jax.vjp(lambda x, w: dot(x, w, dn), x, w)
        return [np.asarray(a, np.float64) for a in (out, *vjp(g.astype(out.dtype)))], out.dtype

    (out, dx, dw), dtype = run(float32_kernel_dot)
    (out16, dx16, dw16), dtype16 = run(compute_dtype_dot)
    (out32, dx32, _), _ = run(
        lambda x, w, dn: jax.lax.dot_general(x.astype(w.dtype), w, dn, precision="highest")
    )
    assert dtype == dtype16 == jnp.bfloat16
    np.testing.assert_array_equal(dw, dw16)  # the kernel gradient: x^T g in bf16, as the 16-bit dot's
    # Output and input gradient: the float32 product rounded once, so within one bf16 rounding of the
    # float32 reference and closer to it than the product of the bf16-rounded kernel. On a GPU, XLA's
    # default precision runs the float32 GEMM in TF32 (a 10-bit kernel mantissa, against bf16's 7): the
    # error is then bounded against the output's scale, where cancellation leaves small values
    # (an H200 had 14 of 384 outputs over one bf16 rounding of their own value).
    on_cpu = jax.default_backend() == "cpu"
    for got, bf16_copy, want in ((out, out16, out32), (dx, dx16, dx32)):
        atol = 1e-6 if on_cpu else 2.0**-8 * np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=atol)
        assert np.linalg.norm(got - want) < np.linalg.norm(bf16_copy - want)
    with pytest.raises(ValueError, match="float32_kernel_dot"):
        float32_kernel_dot(x, w, (((1,), (0,)), ((), ())))


def test_float32_kernel_dot_on_a_fused_kernel_is_the_flat_kernels():
    # layers.fused_dense's (K, parts, width) kernel: the same values and gradients as its flat (K, parts *
    # width) matrix, with the kernel's axes kept (a tensor-split width is not gathered into a matrix).
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(4, 1, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(64, 3, 32)) * 0.1, jnp.float32)
    g = jnp.asarray(rng.normal(size=(4, 1, 3, 32)), jnp.bfloat16)

    def run(x, w, g):
        out, vjp = jax.vjp(lambda x, w: float32_kernel_dot(x, w, (((2,), (0,)), ((), ()))), x, w)
        return (out, *vjp(g))

    out, dx, dw = run(x, w, g)
    flat = run(x, w.reshape(64, 96), g.reshape(4, 1, 96))
    assert out.shape == g.shape and dw.shape == w.shape
    for a, b in zip((out, dx, dw), (flat[0].reshape(out.shape), flat[1], flat[2].reshape(w.shape))):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)
