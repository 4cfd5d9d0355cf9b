"""Properties of the pure FLUX.1 math against independent numpy formulations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flux_jax.math import apply_rope, attention, embed_nd, flash_attention, rope, timestep_embedding


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
