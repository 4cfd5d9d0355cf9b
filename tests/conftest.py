"""Test setup: 8 host-platform CPU devices for the mesh tests, strict numpy rank rules, the
``tiny_config`` fixture (the toy config at the tiny preset, 3 steps, overrides by dotted name),
``norm_then_rope``, the reference for ``flux_jax.math.rms_norm_rope``, and ``delayed_meta``, one FP8
dot's scaling state for calling ``fp8_matmul`` directly."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402

from flux_jax.fp8_dot import OPERANDS  # noqa: E402
from flux_jax.math import apply_rope  # noqa: E402


def norm_then_rope(x, scale, pe, dtype):
    """The blocks' QK path before rms_norm_rope: RMSNorm (float32 math, x's dtype, times scale), cast to
    dtype, then apply_rope; differentiated by plain autodiff."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return apply_rope(
        (normed.astype(x.dtype) * scale.reshape((1,) * (x.ndim - 1) + scale.shape)).astype(dtype), pe
    )


def delayed_meta():
    """Delayed-scaling state for one dense's three operands: a 4-step history of 2.0 and its scale."""
    return {
        f"{n}_{k}": v
        for n in OPERANDS
        for k, v in (("amax_history", jnp.full((4,), 2.0, jnp.float32)), ("scale", jnp.float32(2.0 / 448)))
    }


def make_tiny_config(**overrides):
    from configs import toy as toy_config

    c = toy_config.get_config()
    c.model.preset = "tiny"
    c.data.image_size = 32  # 4 image tokens
    c.data.txt_len = 4
    c.micro_batch_size = 1
    c.global_batch_size = 8
    c.mesh.data = -1
    c.train_iters = 3
    c.lr_warmup_iters = 1
    c.log_interval = 1
    c.eval_interval = 3
    c.eval_iters = 1
    c.save_interval = 3
    c.checkpoint.async_save = False
    c.update_from_flattened_dict(overrides)
    return c


@pytest.fixture
def tiny_config():
    return make_tiny_config
