"""AdamW with warmup + constant/cosine schedule, global-norm clipping and a weight-decay mask."""

from typing import Any

import jax
import jax.numpy as jnp
import optax

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


def scale_by_adam_stored_as(b1: float, b2: float, eps: float, dtype) -> optax.GradientTransformation:
    """optax.scale_by_adam with both moments stored in ``dtype`` (Megatron's precision-aware optimizer):
    each step reads them, updates and bias-corrects in float32, and rounds them back to ``dtype``.

    The state is an ``optax.ScaleByAdamState``, as optax.adamw's, with 16-bit mu and nu: 4 bytes less
    to read and 4 to write per parameter, and half the moments' memory.
    """

    def init(params):
        zeros = lambda p: jnp.zeros(p.shape, dtype)  # noqa: E731
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params), nu=jax.tree.map(zeros, params)
        )

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)

        def one(g, m, v):
            g = g.astype(jnp.float32)
            m = b1 * m.astype(jnp.float32) + (1 - b1) * g
            v = b2 * v.astype(jnp.float32) + (1 - b2) * g * g
            return (m / c1) / (jnp.sqrt(v / c2) + eps), m.astype(dtype), v.astype(dtype)

        out = jax.tree.map(one, updates, state.mu, state.nu)
        pick = lambda i: jax.tree.map(lambda _, o: o[i], updates, out)  # noqa: E731
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
