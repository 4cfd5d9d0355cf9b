"""Rectified flow: timestep sampling, noising, loss, fixed-timestep validation, inference schedule.

Conventions follow BFL/SD3 rectified flow as used by Primus and the MLPerf Flux.1 benchmark:
``x_t = (1 - t) * x0 + t * eps`` with t in [0, 1], the model predicts the velocity ``eps - x0`` and
the loss is the MSE in float32. t = 0 is clean data, t = 1 is pure noise.
"""

import math

import jax
import jax.numpy as jnp

from flux_jax import latents

TIMESTEP_METHODS = ("uniform", "logit_normal", "mode")


def shift_timesteps(t: jax.Array, shift: float) -> jax.Array:
    """SD3 static shift ``shift * t / (1 + (shift - 1) * t)``; shift > 1 moves mass towards noise."""
    if shift == 1.0:
        return t
    return shift * t / (1.0 + (shift - 1.0) * t)


def sample_timesteps(
    rng: jax.Array,
    n: int,
    method: str = "uniform",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    shift: float = 1.0,
) -> jax.Array:
    """Draws n training timesteps in [0, 1] (float32).

    uniform: t ~ U(0, 1) (MLPerf "direct_uniform"); logit_normal: sigmoid(N(mean, std)) (SD3, NeMo);
    mode: SD3's mode sampling with ``mode_scale``. The static shift is applied last.
    """
    if method == "uniform":
        t = jax.random.uniform(rng, (n,), jnp.float32)
    elif method == "logit_normal":
        t = jax.nn.sigmoid(logit_mean + logit_std * jax.random.normal(rng, (n,), jnp.float32))
    elif method == "mode":
        u = jax.random.uniform(rng, (n,), jnp.float32)
        t = 1.0 - u - mode_scale * (jnp.cos(math.pi * u / 2.0) ** 2 - 1.0 + u)
        t = jnp.clip(t, 0.0, 1.0)
    else:
        raise ValueError(f"timestep_sampling={method!r} is not one of {TIMESTEP_METHODS}.")
    return shift_timesteps(t, shift)


def noise(x0: jax.Array, eps: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns (x_t, target) for clean x0 (B, ...), noise eps like x0 and t (B,)."""
    t_b = t.reshape((-1,) + (1,) * (x0.ndim - 1)).astype(x0.dtype)
    x_t = (1.0 - t_b) * x0 + t_b * eps
    return x_t, eps - x0


def per_sample_loss(pred: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error per sample, in float32: (B, ...) -> (B,)."""
    err = jnp.square(pred.astype(jnp.float32) - target.astype(jnp.float32))
    return err.reshape(err.shape[0], -1).mean(axis=1)


def loss(pred: jax.Array, target: jax.Array) -> jax.Array:
    """Scalar float32 MSE over the whole batch."""
    return per_sample_loss(pred, target).mean()


def validation_timesteps(index: jax.Array) -> jax.Array:
    """MLPerf's fixed validation timesteps: index k in 0..7 maps to t = k / 8."""
    return index.astype(jnp.float32) / latents.NUM_VAL_TIMESTEPS


def validation_loss(
    per_timestep_sums: jax.Array, per_timestep_counts: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Validation loss as the mean of per-timestep means.

    Takes accumulated (8,) sums and counts of per-sample losses; returns (loss, per_timestep_means).
    Timesteps with no samples are left out of the mean rather than counted as zero.
    """
    counts = per_timestep_counts.astype(jnp.float32)
    means = jnp.where(counts > 0, per_timestep_sums / jnp.maximum(counts, 1.0), jnp.nan)
    seen = counts > 0
    total = jnp.where(seen, means, 0.0).sum() / jnp.maximum(seen.sum(), 1)
    return total, means


def accumulate_by_timestep(losses: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-sample losses (B,) and timestep indices (B,) -> (8,) sums and (8,) counts."""
    one_hot = jax.nn.one_hot(index, latents.NUM_VAL_TIMESTEPS, dtype=jnp.float32)
    return one_hot.T @ losses.astype(jnp.float32), one_hot.sum(axis=0)


def time_shift(mu: float, sigma: float, t: jax.Array) -> jax.Array:
    """BFL's inference shift ``e^mu / (e^mu + (1/t - 1)^sigma)``."""
    return math.exp(mu) / (math.exp(mu) + (1.0 / t - 1.0) ** sigma)


def get_lin_function(x1: float = 256, y1: float = 0.5, x2: float = 4096, y2: float = 1.15):
    """Line through (x1, y1) and (x2, y2): maps image sequence length to the shift mu."""
    m = (y2 - y1) / (x2 - x1)
    return lambda x: m * x + (y1 - m * x1)


def get_schedule(
    num_steps: int, image_seq_len: int, base_shift: float = 0.5, max_shift: float = 1.15, shift: bool = True
) -> jax.Array:
    """Inference timesteps from 1 to 0 (num_steps + 1 values), shifted by sequence length unless
    ``shift`` is False (schnell)."""
    t = jnp.linspace(1.0, 0.0, num_steps + 1, dtype=jnp.float32)
    if shift:
        mu = get_lin_function(y1=base_shift, y2=max_shift)(image_seq_len)
        inner = jnp.clip(t[1:-1], 1e-12, 1.0)
        t = t.at[1:-1].set(time_shift(mu, 1.0, inner))
    return t
