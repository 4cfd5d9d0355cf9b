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


def test_stochastic_bf16_rounding_is_unbiased_and_exact_on_bf16_values():
    ulp = 2.0**-7  # bf16's spacing in [1, 2)
    x = jnp.full((4096,), 1.0 + 0.3 * ulp, jnp.float32)
    r = optim.round_bf16_stochastic(x, optim.element_hash(x.shape, jnp.uint32(7))).astype(jnp.float32)
    assert set(np.unique(np.asarray(r)).tolist()) == {1.0, 1.0 + ulp}  # only the two neighbours
    assert abs(float(r.mean()) - (1.0 + 0.3 * ulp)) < 0.03 * ulp  # mean kept; nearest would give 1.0
    exact = jnp.array([0.0, -2.5, 1.0 + ulp, 2.0**127, jnp.inf, -jnp.inf], jnp.float32)
    got = optim.round_bf16_stochastic(exact, optim.element_hash(exact.shape, jnp.uint32(1)))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(exact))
    nan = optim.round_bf16_stochastic(jnp.array([jnp.nan]), jnp.array([0xFFFF], jnp.uint32))
    assert bool(jnp.isnan(nan)[0])


def test_element_hash_differs_per_element_and_salt():
    a = np.asarray(optim.element_hash((64, 32), jnp.uint32(3)))
    b = np.asarray(optim.element_hash((64, 32), jnp.uint32(4)))
    assert len(np.unique(a)) == a.size and np.mean(a == b) < 0.01
    low = a & 0xFFFF  # the bits a rounding uses: about uniform
    assert 0.4 < low.mean() / 0xFFFF < 0.6


def test_bf16_second_moment_follows_a_slow_drift():
    """With beta2 = 0.999 nu's per-step change is below bf16's half ulp: stochastic rounding tracks it."""
    tx = optim.scale_by_adam_stored_as(0.9, 0.999, 1e-8, jnp.bfloat16)
    params = {"w": jnp.zeros((2048,))}
    state = tx.init(params)
    state = state._replace(nu={"w": jnp.ones((2048,), jnp.bfloat16)}, count=jnp.array(10_000, jnp.int32))
    g = {"w": jnp.full((2048,), 2.0**0.5)}  # g^2 = 2: nu should move 1 -> 1 + (1 - 0.999^n)
    for _ in range(100):
        _, state = tx.update(g, state)
    expect = 2 - 0.999**100
    assert abs(float(state.nu["w"].astype(jnp.float32).mean()) - expect) < 0.01 * expect
