"""Block pieces of layers.py not covered by the model-level parity tests."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax._src.ad_checkpoint import saved_residuals

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
