"""AdamW with warmup + constant/cosine schedule, global-norm clipping and a weight-decay mask."""

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

DECAY_STYLES = ("constant", "cosine")
MOMENT_DTYPES = ("float32", "bfloat16")
# Parameter names that are never decayed whatever their rank (norm scales, biases).
_NO_DECAY_NAMES = ("bias", "scale")


def lr_schedule(config: Any) -> optax.Schedule:
    """Linear warmup from 0 to config.lr, then constant or cosine down to config.min_lr."""
    warmup = int(config.lr_warmup_iters)
    if config.lr_decay_style == "constant":
        after = optax.constant_schedule(config.lr)
    else:
        decay_steps = max(int(config.train_iters) - warmup, 1)
        after = optax.cosine_decay_schedule(config.lr, decay_steps, alpha=config.min_lr / config.lr)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, config.lr, warmup), after], [warmup])


def decay_mask(params: Any) -> Any:
    """True for leaves that get weight decay: matrices, not biases, norm scales or 1-D params."""

    def leaf(path, x):
        name = str(getattr(path[-1], "key", path[-1])) if path else ""
        return jnp.ndim(x) > 1 and name not in _NO_DECAY_NAMES

    return jax.tree_util.tree_map_with_path(leaf, params)


def element_hash(shape, salt) -> jax.Array:
    """32 well-mixed bits per element of ``shape`` from its flat index and a uint32 ``salt``.

    A murmur3 finalizer of (index, salt): a few integer ops per element, fused into the consumer, and
    the same bits for the same global element whatever the sharding or process count.
    """
    idx = lax.iota(jnp.uint32, math.prod(shape)).reshape(shape) if shape else jnp.uint32(0)
    h = idx * jnp.uint32(0x9E3779B1) + salt
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def round_bf16_stochastic(x: jax.Array, bits: jax.Array) -> jax.Array:
    """float32 -> bfloat16, rounding up with probability equal to the dropped fraction.

    Adding 16 random bits below bf16's last mantissa bit, then truncating, keeps the expected value: an
    update smaller than half a bf16 ulp survives on average instead of always rounding away. Inf stays
    inf; NaN stays NaN.
    """
    u = lax.bitcast_convert_type(x, jnp.uint32)
    u = (u + (bits & jnp.uint32(0xFFFF))) & jnp.uint32(0xFFFF0000)
    rounded = lax.bitcast_convert_type(u, jnp.float32).astype(jnp.bfloat16)
    return jnp.where(jnp.isnan(x), x.astype(jnp.bfloat16), rounded)


def scale_by_adam_stored_as(b1: float, b2: float, eps: float, dtype) -> optax.GradientTransformation:
    """optax.scale_by_adam with both moments stored in ``dtype`` (Megatron's precision-aware optimizer):
    each step reads them, updates and bias-corrects in float32, and rounds them back to ``dtype``.

    The state is an ``optax.ScaleByAdamState``, as optax.adamw's, with 16-bit mu and nu: 4 bytes less
    to read and 4 to write per parameter, and half the moments' memory. bfloat16 moments are rounded
    stochastically (``round_bf16_stochastic``, bits from the step and the element's index): with
    beta2 = 0.999, nu's per-step change (0.1%) is below bf16's half ulp (0.2%) and round-to-nearest drops
    it unless g^2 is far from nu (benchmarks/RESULTS.md, eleventh and twelfth runs).
    """

    def init(params):
        zeros = lambda p: jnp.zeros(p.shape, dtype)  # noqa: E731
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params), nu=jax.tree.map(zeros, params)
        )

    def store(m, v, salt):
        if dtype != jnp.bfloat16:
            return m.astype(dtype), v.astype(dtype)
        bits = element_hash(m.shape, salt)
        return round_bf16_stochastic(m, bits), round_bf16_stochastic(v, bits >> 16)

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)
        step_salt = count.astype(jnp.uint32) * jnp.uint32(0x27D4EB2F)

        def one(i, g, m, v):
            g = g.astype(jnp.float32)
            m = b1 * m.astype(jnp.float32) + (1 - b1) * g
            v = b2 * v.astype(jnp.float32) + (1 - b2) * g * g
            m_out, v_out = store(m, v, step_salt + jnp.uint32(i * 0x165667B1 % 2**32))
            return (m / c1) / (jnp.sqrt(v / c2) + eps), m_out, v_out

        leaves, treedef = jax.tree.flatten(updates)
        mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        out = [one(i, g, m, v) for i, (g, m, v) in enumerate(zip(leaves, mus, nus))]
        pick = lambda k: treedef.unflatten([o[k] for o in out])  # noqa: E731
        return pick(0), optax.ScaleByAdamState(count=count, mu=pick(1), nu=pick(2))

    return optax.GradientTransformation(init, update)


def adamw(config: Any) -> optax.GradientTransformation:
    """optax.adamw, or the same chain with ``config.adam_moments_dtype`` moments.

    A multi-tensor form (optax.flatten: all parameters as one vector) measured 65.6 ms against 51.6 per
    step at the block shape on an H100, +3.4 GiB (benchmarks/RESULTS.md, eleventh run): the per-parameter
    fusions already run at memory bandwidth and flattening adds copies. Not kept.
    """
    moments = config.get("adam_moments_dtype", "float32")
    if moments not in MOMENT_DTYPES:
        raise ValueError(f"config.adam_moments_dtype={moments!r} must be one of {MOMENT_DTYPES}.")
    schedule = lr_schedule(config)
    b1, b2, eps = config.adam_beta1, config.adam_beta2, config.adam_eps
    if moments == "float32":
        return optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=config.weight_decay, mask=decay_mask)
    return optax.chain(
        scale_by_adam_stored_as(b1, b2, eps, jnp.dtype(moments)),
        optax.add_decayed_weights(config.weight_decay, decay_mask),
        optax.scale_by_learning_rate(schedule),
    )


def make_optimizer(config: Any) -> optax.GradientTransformation:
    """clip_by_global_norm(clip_grad) then AdamW; clip_grad 0 disables clipping.

    Applied to params only: the FP8 state never goes through the optimizer.
    """
    parts = []
    if config.clip_grad > 0:
        parts.append(optax.clip_by_global_norm(config.clip_grad))
    parts.append(adamw(config))
    return optax.chain(*parts)
