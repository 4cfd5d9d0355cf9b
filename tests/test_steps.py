import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flux_jax import optim, setup, sharding, steps, toy


def _step_setup(config, batch_size):
    fp = setup.flux_params(config)
    net = steps.make_model(config, fp, use_fp8=False)
    pipe = toy.ToyPipeline(
        seed=0,
        split="train",
        batch_size=batch_size,
        image_size=config.data.image_size,
        txt_len=config.data.txt_len,
        context_in_dim=fp.context_in_dim,
        vec_in_dim=fp.vec_in_dim,
    )
    batch = {k: jnp.asarray(v) for k, v in next(pipe).items()}
    args = (batch["img"][:1], batch["img_ids"][:1], batch["txt"][:1], batch["txt_ids"][:1])
    params = net.init(jax.random.key(0), *args, jnp.zeros((1,)), batch["y"][:1])["params"]
    return net, params, batch


def _state(params, tx):
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": tx.init(params),
        "fp8_meta": {},
        "rng": jax.random.key(1),
    }


def test_eval_over_micro_batches_matches_one_batch(tiny_config):
    # The eval step runs the forward over the train step's micro batches: the same per-timestep sums
    # and counts as one forward over the whole batch, accumulated across calls.
    config = tiny_config()
    net, params, batch = _step_setup(config, 8)
    batch = batch | {"timestep": jnp.arange(8, dtype=jnp.int32) % 8}
    whole = jax.jit(steps.make_eval_step(config, net, num_micro=1, use_fp8=False))
    config.micro_batch_size = 2
    micro = jax.jit(steps.make_eval_step(config, net, num_micro=4, use_fp8=False))
    zeros = (jnp.zeros(8), jnp.zeros(8))
    rng = jax.random.key(3)
    (t1, loss1, per1), (t4, loss4, per4) = (f(params, {}, batch, rng, 0, zeros) for f in (whole, micro))
    np.testing.assert_allclose(t1[0], t4[0], rtol=1e-5)
    np.testing.assert_array_equal(t1[1], np.ones(8))
    np.testing.assert_array_equal(t4[1], np.ones(8))
    np.testing.assert_allclose(loss1, loss4, rtol=1e-5)
    np.testing.assert_allclose(per1, per4, rtol=1e-5)
    assert float(loss1) > 0
    # A second batch adds to the totals; its noise comes from fold_in(rng, 1), not the first batch's.
    t2, loss2, _ = micro(params, {}, batch, rng, 1, t4)
    np.testing.assert_array_equal(t2[1], 2 * np.ones(8))
    assert not np.allclose(t2[0], 2 * t4[0])


def test_gradient_accumulation_matches_large_batch_and_nonfinite_skips(tiny_config):
    config = tiny_config()
    net, params, batch = _step_setup(config, 8)
    tx = optax.sgd(1.0)  # a linear update keeps the comparison about gradients, not Adam's sign
    big = steps.make_train_step(config, net, tx, num_micro=1, use_fp8=False)
    config.micro_batch_size = 2
    acc = steps.make_train_step(config, net, tx, num_micro=4, use_fp8=False)
    s1, m1 = jax.jit(big)(_state(params, tx), batch)
    s4, m4 = jax.jit(acc)(_state(params, tx), batch)
    np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-5)
    np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-4)
    assert float(m1["grad_norm"]) > 0
    for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s4["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # A non-finite loss skips the update (reusing the compiled large-batch step).
    bad = batch | {"img": batch["img"].at[0, 0, 0].set(jnp.nan)}
    skipped, m = jax.jit(big)(s1, bad)
    assert not bool(m["finite"]) and int(skipped["step"]) == 2
    for a, b in zip(jax.tree.leaves(skipped["params"]), jax.tree.leaves(s1["params"])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="FP8 GEMM custom calls exist only on a GPU backend"
)
@pytest.mark.parametrize("wgrad", [True, False])
def test_gpu_fp8_train_step_runs_every_block_linear_in_fp8(wgrad):
    from configs import flux_535m
    from flux_jax import doctor

    # Full width (3072): at toy widths XLA keeps most FP8 dots out of cuBLASLt, so the check needs
    # the real GEMM sizes (flux-535m, Primus's FP8 micro batch, 256 image + 256 text tokens).
    config = flux_535m.get_config("fp8")
    config.fp8_wgrad = wgrad
    config.global_batch_size = config.micro_batch_size
    config.mesh.data = -1
    fp = setup.flux_params(config)
    net = steps.make_model(config, fp, use_fp8=True)
    img_len, txt_len = (config.data.image_size // 16) ** 2, config.data.txt_len
    b = config.micro_batch_size
    batch = {
        "img": jax.random.normal(jax.random.key(1), (b, img_len, fp.in_channels)),
        "img_ids": jnp.zeros((b, img_len, 3)),
        "txt": jnp.ones((b, txt_len, fp.context_in_dim)),
        "txt_ids": jnp.zeros((b, txt_len, 3)),
        "y": jnp.ones((b, fp.vec_in_dim)),
    }
    v = net.init(
        jax.random.key(0),
        *(batch[k][:1] for k in ("img", "img_ids", "txt", "txt_ids")),
        jnp.zeros((1,)),
        batch["y"][:1],
    )
    tx = optim.make_optimizer(config)
    state = _state(v["params"], tx) | {"fp8_meta": v["fp8_meta"]}
    step = jax.jit(steps.make_train_step(config, net, tx, num_micro=1, use_fp8=True))
    hlo = step.lower(state, batch).compile().as_text()
    # Token GEMMs: qkv, proj, mlp_0, mlp_2 per stream of a double block; linear1, linear2 per single.
    # XLA may give some FP8 dots to its own Triton GEMM emitter; count_fp8_gemms counts those too.
    linears = 8 * fp.depth + 2 * fp.depth_single_blocks
    assert doctor.count_fp8_gemms(hlo) == linears * (3 if wgrad else 2)


def _fp8_casts_in_accumulation(jaxpr, shapes, num_micro) -> int:
    """Conversions to FP8 of kernel shape (or its transpose) inside the accumulation scan (the scan
    of length ``num_micro``; scanned blocks and the layer-wise cache casts are scans of other lengths).

    Only casts count (XLA's ``convert_element_type``, the jax-triton cast kernel on a GPU): the zero
    cotangents of the cached casts are FP8 arrays of kernel shape too, but they are no cast (and jit
    drops them, nothing differentiates them).
    """

    def walk(jx, inside):
        n = 0
        for eqn in jx.eqns:
            if inside and eqn.primitive.name in ("convert_element_type", "triton_kernel_call"):
                n += sum(
                    1
                    for v in eqn.outvars
                    if jnp.issubdtype(v.aval.dtype, jnp.floating)
                    and jnp.finfo(v.aval.dtype).bits == 8
                    and tuple(v.aval.shape) in shapes
                )
            accumulation = eqn.primitive.name == "scan" and eqn.params["length"] == num_micro
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                n += walk(sub, inside or accumulation)
        return n

    return walk(jaxpr.jaxpr, False)


@pytest.mark.parametrize("scan_blocks", [False, True])
def test_fp8_weight_cache_under_accumulation_is_exact_and_out_of_the_loop(tiny_config, scan_blocks):
    # Kernel shapes (32 x 32k) stay apart from the activations' (M = 2 samples x 4 tokens).
    config = tiny_config(fp8="e4m3", **{"model.scan_blocks": scan_blocks, "model.depth": 2})
    config.micro_batch_size = 2
    fp = setup.flux_params(config)
    net = steps.make_model(config, fp, use_fp8=True)
    _, _, batch = _step_setup(config, 8)
    args = (batch["img"][:1], batch["img_ids"][:1], batch["txt"][:1], batch["txt_ids"][:1])
    v = sharding.unbox(net.init(jax.random.key(0), *args, jnp.zeros((1,)), batch["y"][:1]))
    tx = optim.make_optimizer(config)
    state = _state(v["params"], tx) | {"fp8_meta": v["fp8_meta"]}
    kernels = {
        tuple(x.shape[-2:])
        for path, x in jax.tree_util.tree_leaves_with_path(v["params"])
        if "kernel" in jax.tree_util.keystr(path)
    }
    shapes = kernels | {s[::-1] for s in kernels}
    runs = {}
    for cache in (True, False):
        config.fp8_cache_weights = cache
        step = steps.make_train_step(config, net, tx, num_micro=4, use_fp8=True)
        casts = _fp8_casts_in_accumulation(jax.make_jaxpr(step)(state, batch), shapes, 4)
        s, m = jax.jit(step)(state, batch)
        s, m2 = jax.jit(step)(s, batch)
        runs[cache] = (casts, s, [float(m["loss"]), float(m2["loss"])])
    assert runs[True][0] == 0 and runs[False][0] > 0
    assert runs[True][2] == runs[False][2]
    for key in ("params", "fp8_meta"):
        for a, b in zip(jax.tree.leaves(runs[True][1][key]), jax.tree.leaves(runs[False][1][key])):
            np.testing.assert_array_equal(a, b)
    hist = jax.tree_util.tree_leaves_with_path(runs[True][1]["fp8_meta"])
    assert any("kernel_amax_history" in jax.tree_util.keystr(p) and float(jnp.max(x)) > 0 for p, x in hist)
