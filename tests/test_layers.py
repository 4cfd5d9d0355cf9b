"""Block pieces of layers.py not covered by the model-level parity tests."""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import norm_then_rope
from jax._src.ad_checkpoint import saved_residuals

from benchmarks import residuals
from flux_jax import layers


def residual_bytes(fn, x):
    return sum(a.size * a.dtype.itemsize for a, _ in saved_residuals(fn, x))


def test_gelu_matches_plain_autodiff_bit_for_bit():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 16, 64)) * 3, jnp.bfloat16)
    out, vjp = jax.vjp(layers.gelu, x)
    ref, ref_vjp = jax.vjp(lambda v: nn.gelu(v, approximate=True), x)
    assert out.dtype == ref.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    cot = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape), x.dtype)
    np.testing.assert_array_equal(
        np.asarray(vjp(cot)[0], np.float32), np.asarray(ref_vjp(cot)[0], np.float32)
    )


def test_gelu_keeps_only_its_input_for_the_backward():
    x = jnp.zeros((4, 256), jnp.bfloat16)
    assert residual_bytes(layers.gelu, x) == x.nbytes
    # Plain autodiff keeps tanh and its pieces as well.
    assert residual_bytes(lambda v: nn.gelu(v, approximate=True), x) >= 3 * x.nbytes


@pytest.mark.parametrize("kind", ["double", "single"])
def test_blocks_keep_no_float32_qk_intermediates_for_the_backward(kind, monkeypatch):
    args = argparse.Namespace(width=64, heads=2, batch=2, img=8, txt=4)
    x = residuals.block_inputs(args)
    common = dict(hidden_size=64, num_heads=2, mlp_ratio=2.0, dtype=jnp.bfloat16)
    if kind == "double":
        block, inputs = layers.DoubleStreamBlock(**common), (x["img"], x["txt"], x["vec"], x["pe"])
    else:
        joint = jnp.concatenate([x["txt"], x["img"]], axis=1)
        block, inputs = layers.SingleStreamBlock(**common), (joint, x["vec"], x["pe"])

    def f32_heads(found):  # float32 residuals shaped like a stream's q or k: (B, L, H, D)
        return [a for a, _ in found if a.dtype == jnp.float32 and a.shape[2:] == (2, 32)]

    fused = residuals.residuals(block, inputs)
    assert f32_heads(fused) == []
    monkeypatch.setattr(layers, "rms_norm_rope", norm_then_rope)
    composed = residuals.residuals(block, inputs)
    # Norm then RoPE keeps float32 x and normed x for q and k (per stream in the double block).
    assert len(f32_heads(composed)) >= 4
    nbytes = lambda found: sum(a.size * a.dtype.itemsize for a, _ in found)  # noqa: E731
    assert nbytes(fused) < nbytes(composed)
