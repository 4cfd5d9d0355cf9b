import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flux_jax import flow


def test_noise_endpoints_and_target():
    x0 = jax.random.normal(jax.random.key(0), (3, 4, 5))
    eps = jax.random.normal(jax.random.key(1), (3, 4, 5))
    x_t, target = flow.noise(x0, eps, jnp.array([0.0, 1.0, 0.25]))
    np.testing.assert_allclose(x_t[0], x0[0], rtol=1e-6)
    np.testing.assert_allclose(x_t[1], eps[1], rtol=1e-6)
    np.testing.assert_allclose(x_t[2], 0.75 * x0[2] + 0.25 * eps[2], rtol=1e-6)
    np.testing.assert_allclose(target, eps - x0, rtol=1e-6)


@pytest.mark.parametrize("method", flow.TIMESTEP_METHODS)
def test_sample_timesteps_in_unit_interval(method):
    t = flow.sample_timesteps(jax.random.key(0), 4096, method)
    assert t.shape == (4096,) and t.dtype == jnp.float32
    assert float(t.min()) >= 0.0 and float(t.max()) <= 1.0


def test_sample_timesteps_distributions():
    rng = jax.random.key(3)
    uniform = flow.sample_timesteps(rng, 20000, "uniform")
    assert abs(float(uniform.mean()) - 0.5) < 0.01
    assert abs(float(jnp.mean(uniform < 0.1)) - 0.1) < 0.01
    logit = flow.sample_timesteps(rng, 20000, "logit_normal", logit_mean=0.0, logit_std=1.0)
    # sigmoid(N(0, 1)) is symmetric about 1/2 and concentrated in the middle.
    assert abs(float(jnp.median(logit)) - 0.5) < 0.02
    assert float(jnp.mean((logit > 0.25) & (logit < 0.75))) > 0.6
    shifted = flow.sample_timesteps(rng, 20000, "uniform", shift=3.0)
    assert float(shifted.mean()) > float(uniform.mean()) + 0.1


def test_shift_matches_formula():
    t = jnp.linspace(0.0, 1.0, 11)
    np.testing.assert_allclose(flow.shift_timesteps(t, 3.0), 3 * t / (1 + 2 * t), rtol=1e-6)
    np.testing.assert_array_equal(flow.shift_timesteps(t, 1.0), t)


def test_unknown_method_names_field():
    with pytest.raises(ValueError, match="timestep_sampling"):
        flow.sample_timesteps(jax.random.key(0), 4, "cosine")


def test_loss_is_float32_mse():
    pred = jnp.ones((2, 3, 4), jnp.bfloat16)
    target = jnp.zeros((2, 3, 4), jnp.bfloat16).at[0].set(3.0)
    per = flow.per_sample_loss(pred, target)
    assert per.dtype == jnp.float32
    np.testing.assert_allclose(per, [4.0, 1.0])
    np.testing.assert_allclose(flow.loss(pred, target), 2.5)


def test_validation_loss_is_mean_of_per_timestep_means():
    idx = jnp.array([0, 0, 0, 1, 2, 3, 4, 5, 6, 7])
    losses = jnp.array([1.0, 1.0, 4.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0])
    sums, counts = flow.accumulate_by_timestep(losses, idx)
    np.testing.assert_allclose(counts, [3, 1, 1, 1, 1, 1, 1, 1])
    total, means = flow.validation_loss(sums, counts)
    np.testing.assert_allclose(means[0], 2.0)
    np.testing.assert_allclose(total, 2.0)
    np.testing.assert_allclose(flow.validation_timesteps(jnp.arange(8)), np.arange(8) / 8)


def test_validation_loss_ignores_empty_timesteps():
    sums = jnp.array([2.0, 0, 0, 0, 0, 0, 0, 6.0])
    counts = jnp.array([1.0, 0, 0, 0, 0, 0, 0, 2.0])
    total, means = flow.validation_loss(sums, counts)
    np.testing.assert_allclose(total, 2.5)
    assert bool(jnp.isnan(means[1]))


def test_schedule():
    plain = flow.get_schedule(4, 256, shift=False)
    np.testing.assert_allclose(plain, [1.0, 0.75, 0.5, 0.25, 0.0])
    shifted = flow.get_schedule(50, 4096)
    assert float(shifted[0]) == 1.0 and float(shifted[-1]) == 0.0
    assert bool(jnp.all(jnp.diff(shifted) < 0))
    # A long sequence shifts mass towards noise: every inner step sits above the linear one.
    linear = jnp.linspace(1.0, 0.0, 51)
    assert bool(jnp.all(shifted[1:-1] > linear[1:-1]))
    t = jnp.array([0.2, 0.5, 0.9])
    np.testing.assert_allclose(flow.time_shift(0.0, 1.0, t), t, rtol=1e-6)
    np.testing.assert_allclose(flow.get_lin_function()(256), 0.5)
    np.testing.assert_allclose(flow.get_lin_function()(4096), 1.15)
