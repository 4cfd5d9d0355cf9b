"""AdamW with warmup + constant/cosine schedule, global-norm clipping and a weight-decay mask."""

from typing import Any

import jax
import jax.numpy as jnp
import optax

DECAY_STYLES = ("constant", "cosine")
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


def make_optimizer(config: Any) -> optax.GradientTransformation:
    """clip_by_global_norm(clip_grad) then AdamW; clip_grad 0 disables clipping.

    Applied to params only: the FP8 state never goes through the optimizer.
    """
    parts = []
    if config.clip_grad > 0:
        parts.append(optax.clip_by_global_norm(config.clip_grad))
    parts.append(
        optax.adamw(
            lr_schedule(config),
            b1=config.adam_beta1,
            b2=config.adam_beta2,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            mask=decay_mask,
        )
    )
    return optax.chain(*parts)
