"""AdamW with 16-bit moments (``adam_moments_dtype``) against optax.adamw, and a short training run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flux_jax import optim, train


def _params():
    ks = jax.random.split(jax.random.key(0), 3)
    return {
        "a": {"kernel": jax.random.normal(ks[0], (8, 16)), "bias": jnp.zeros(16)},
        "s": jax.random.normal(ks[1], (4,)),
    }


def test_bf16_moments_store_bf16_and_follow_float32_adamw(tiny_config):
    config = tiny_config(lr=1e-2, lr_warmup_iters=0, weight_decay=0.1, adam_beta2=0.95)
    params = _params()
    grads = [jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)) + 0.1 * i, params) for i in range(3)]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        config.adam_moments_dtype = dtype
        tx = optim.make_optimizer(config)
        state, p, seen = tx.init(params), params, []
        for g in grads:
            updates, state = tx.update(g, state, p)
            p = jax.tree.map(jnp.add, p, updates)
            seen.append(p)
        runs[dtype] = (state, seen)
    adam = runs["bfloat16"][0][1][0]
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(runs["float32"][0][1][0].mu)} == {jnp.dtype(jnp.float32)}
    # The first update uses the float32 moments before they are rounded: the same step as optax.adamw.
    for a, b in zip(jax.tree.leaves(runs["bfloat16"][1][0]), jax.tree.leaves(runs["float32"][1][0])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # Later steps read bf16 moments: close to, not equal to, float32's.
    for a, b in zip(jax.tree.leaves(runs["bfloat16"][1][-1]), jax.tree.leaves(runs["float32"][1][-1])):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-3 * 1e-2 * 3)


def test_bf16_moments_train_end_to_end(tiny_config, tmp_path):
    result = train.train_and_evaluate(tiny_config(adam_moments_dtype="bfloat16"), str(tmp_path))
    assert result["steps"] == 3 and np.isfinite(result["train_loss"])
    # The checkpointed bf16 moments restore, and training goes on from them.
    resumed = train.train_and_evaluate(
        tiny_config(adam_moments_dtype="bfloat16", train_iters=4), str(tmp_path)
    )
    assert resumed["steps"] == 4 and np.isfinite(resumed["train_loss"])


def test_bad_moments_dtype_names_the_field(tiny_config, tmp_path):
    with pytest.raises(ValueError, match="adam_moments_dtype"):
        train.train_and_evaluate(tiny_config(adam_moments_dtype="float16"), str(tmp_path))
