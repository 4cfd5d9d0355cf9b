"""FP8 attention: its scaling and state against BF16 attention, through an XLA emulation of cuDNN's FP8
kernel contract on the CPU (the cuDNN kernel itself: the GPU test at the end), and its config errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flux_jax import fp8, fp8_attention, math, optim, setup, sharding, steps
from flux_jax.fp8_cast import fp8_max

F32 = jnp.float32


def _reference(q, k, v, scale):
    p = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) * scale, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, v), p


def _to_fp8(x, multiplier, dtype):
    m = fp8_max(dtype)
    return jnp.clip(x * multiplier.reshape(()), -m, m).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def emulated_kernel(q8, k8, v8, params, scale):
    """cuDNN's FP8 attention contract in XLA: FP8 in, FP8 out, amaxes of the unscaled values."""
    return _emulated_fwd(q8, k8, v8, params, scale)[0]


def _emulated_fwd(q8, k8, v8, params, scale):
    q, k, v = (
        x.astype(F32) * params[f"descale_{n}"].reshape(()) for x, n in ((q8, "q"), (k8, "k"), (v8, "v"))
    )
    _, p = _reference(q, k, v, scale)
    # P goes through E4M3 at the fixed scale cuDNN is given, before the P @ V product.
    p8 = _to_fp8(p, params["scale_s"], q8.dtype).astype(F32) * params["descale_s"].reshape(())
    o = jnp.einsum("bhts,bshd->bthd", p8, v)
    o8 = _to_fp8(o, params["scale_o"], q8.dtype)
    out = (o8, jnp.max(p).reshape(1, 1, 1, 1), jnp.max(jnp.abs(o)).reshape(1, 1, 1, 1))
    return out, (q, k, v, o8, params)


def _emulated_bwd(scale, res, g):
    # The FP8 backward as cuDNN's reference model of it computes: dV from the quantized P; dS from the
    # FP8 output O (the softmax-gradient term) and quantized at scale_dP; dQ and dK from that FP8 dS.
    q, k, v, o8, params = res
    s = lambda name: params[name].reshape(())  # noqa: E731
    do = g[0].astype(F32) * s("descale_dO")
    _, p = _reference(q, k, v, scale)
    p8 = _to_fp8(p, params["scale_s"], o8.dtype).astype(F32) * s("descale_s")
    dv = jnp.einsum("bhts,bthd->bshd", p8, do)
    dp = jnp.einsum("bthd,bshd->bhts", do, v)
    delta = jnp.einsum("bthd,bthd->bht", o8.astype(F32) * s("descale_o"), do)[..., None]
    ds = p * (dp - delta) * scale
    ds8 = _to_fp8(ds, params["scale_dP"], o8.dtype).astype(F32) * s("descale_dP")
    dq = jnp.einsum("bhts,bshd->bthd", ds8, k)
    dk = jnp.einsum("bhts,bthd->bshd", ds8, q)
    cot = jax.tree.map(jnp.zeros_like, params)
    for n, x in (("dQ", dq), ("dK", dk), ("dV", dv), ("dP", ds)):
        cot[f"amax_{n}"] = jnp.max(jnp.abs(x)).reshape(1, 1, 1, 1)
    return tuple(
        _to_fp8(x, params[f"scale_{n}"], g[0].dtype) for x, n in ((dq, "dQ"), (dk, "dK"), (dv, "dV"))
    ) + (cot,)


emulated_kernel.defvjp(_emulated_fwd, _emulated_bwd)


def _qkv(seed, shape=(2, 128, 2, 128)):
    ks = jax.random.split(jax.random.key(seed), 5)
    q, k, v = (jax.random.normal(x, shape, F32).astype(jnp.bfloat16) for x in ks[:3])
    ids = jnp.stack([jnp.zeros(shape[1]), jnp.arange(shape[1]) // 8, jnp.arange(shape[1]) % 8], -1)
    pe = math.embed_nd(jnp.broadcast_to(ids, (shape[0], shape[1], 3)), (16, 56, 56), 10000.0)
    g = jax.random.normal(ks[3], (*shape[:2], shape[2] * shape[3]), F32).astype(jnp.bfloat16)
    return q, k, v, pe, g


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_fp8_attention_tracks_bf16_attention_and_its_backward_state():
    q, k, v, pe, g = _qkv(0)
    spec = fp8.Fp8Spec(jnp.float8_e4m3fn, jnp.float8_e5m2, amax_history_len=4)
    mod = fp8_attention.Fp8Attention(spec, kernel=emulated_kernel)
    meta = mod.init(jax.random.key(0), q, k, v, pe)["fp8_meta"]
    assert set(meta) == {f"{n}_{s}" for n in fp8_attention.GRAD_OPERANDS for s in ("amax_history", "scale")}

    def loss(qkv, meta):
        out = mod.apply({"fp8_meta": fp8.as_max_grad(meta)}, *qkv, pe)
        return jnp.sum(out.astype(F32) * g.astype(F32)), out

    ref_out, ref_vjp = jax.vjp(lambda *a: math.attention(*a, pe), q, k, v)
    ref_grads = ref_vjp(g)
    for _ in range(2):  # the second step scales the gradients from the first's amaxes
        (_, out), (grads, new) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)((q, k, v), meta)
        new = fp8.from_max_grad(new)
        assert _rel(out, ref_out) < 0.08  # E4M3 output: 3 mantissa bits
        np.testing.assert_allclose(new["dO_amax_history"][0], jnp.max(jnp.abs(g.astype(F32))), rtol=1e-6)
        for n in ("dQ", "dK", "dV", "dP"):
            assert float(new[f"{n}_amax_history"][0]) > 0
        meta = new
    for a, b in zip(grads, ref_grads):
        assert _rel(a, b) < 0.1  # E4M3 gradients; the first step's (unit scales) flush to zero
    # The forward alone (evaluation) gives the training forward's values.
    np.testing.assert_array_equal(mod.apply({"fp8_meta": meta}, q, k, v, pe), out)


def test_fp8_attention_state_trains_in_a_model_step_with_cached_kernels(tiny_config, monkeypatch):
    monkeypatch.setattr(fp8_attention, "cudnn_fp8_attention", emulated_kernel)
    config = tiny_config(
        fp8="e4m3",
        **{"model.hidden_size": 256, "model.num_heads": 2, "data.image_size": 128, "data.txt_len": 64},
    )
    config.micro_batch_size = 1
    config.global_batch_size = 2
    config.model.num_heads = 16  # the tiny preset's axes_dim fit head dim 16; 128 is set below
    fp = dataclasses.replace(setup.flux_params(config), num_heads=2, axes_dim=(16, 56, 56))
    net = steps.make_model(config, fp, use_fp8=True).clone(attention_fp8=fp8.spec_from_config(config))
    rng = np.random.default_rng(0)
    side = 8
    ids = np.stack(np.meshgrid(np.arange(side), np.arange(side), indexing="ij"), -1).reshape(1, -1, 2)
    batch = {
        "img": rng.standard_normal((2, side * side, fp.in_channels), np.float32),
        "img_ids": np.repeat(np.concatenate([np.zeros_like(ids[..., :1]), ids], -1), 2, 0).astype(np.float32),
        "txt": rng.standard_normal((2, 64, fp.context_in_dim), np.float32),
        "txt_ids": np.zeros((2, 64, 3), np.float32),
        "y": rng.standard_normal((2, fp.vec_in_dim), np.float32),
    }
    batch = jax.tree.map(jnp.asarray, batch)
    one = {k: x[:1] for k, x in batch.items()}
    v = sharding.unbox(
        net.init(
            jax.random.key(0),
            one["img"],
            one["img_ids"],
            one["txt"],
            one["txt_ids"],
            jnp.zeros((1,)),
            one["y"],
        )
    )
    assert "fp8_attention" in v["fp8_meta"]["double_blocks_0"]
    # The modulation and final layers start at zero (gates 0): no gradient would reach attention.
    v["params"] = jax.tree.map(
        lambda x: 0.02 * jax.random.normal(jax.random.key(2), x.shape) if x.ndim == 2 and not x.any() else x,
        v["params"],
    )
    tx = optim.make_optimizer(config)
    state = {"step": jnp.zeros((), jnp.int32), "params": v["params"], "opt_state": tx.init(v["params"])}
    state |= {"fp8_meta": v["fp8_meta"], "rng": jax.random.key(1)}
    step = jax.jit(steps.make_train_step(config, net, tx, num_micro=2, use_fp8=True))
    # Delayed scaling, unit scales at first: a step's dO amax scales the next step's dO, whose dS amax
    # (dP) scales the step after's dS; only then are dQ and dK nonzero. Four steps fill every history.
    for _ in range(4):
        state, m = step(state, batch)
        assert bool(m["finite"])
    for block in ("double_blocks_0", "single_blocks_0"):
        att = state["fp8_meta"][block]["fp8_attention"]
        assert all(float(att[f"{n}_amax_history"][0]) > 0 for n in fp8_attention.GRAD_OPERANDS)
        assert 0 < float(att["dO_scale"]) < 1  # scaled from an earlier step's amax


def test_fp8_attention_config_errors_name_the_field(tiny_config):
    hopper = fp8.DeviceDescription("cuda", "NVIDIA H100 80GB HBM3", "9.0")
    config = tiny_config(fp8="e4m3", fp8_dot_product_attention=True, **{"model.attention": "cudnn"})
    # Refused on Hopper too, with the measurement that refuses it.
    with pytest.raises(ValueError, match="not usable for training.*dq / dk / dv"):
        fp8.attention_spec(config, hopper)
    for desc in (fp8.DeviceDescription("cpu"), fp8.DeviceDescription("rocm", "MI300X", "gfx942")):
        with pytest.raises(ValueError, match="fp8_dot_product_attention.*Hopper"):
            fp8.validate_fp8_attention(config, desc)
    with pytest.raises(ValueError, match="model.attention='cudnn'"):
        fp8.validate_fp8_attention(tiny_config(fp8="e4m3", fp8_dot_product_attention=True), hopper)
    with pytest.raises(ValueError, match="set config.fp8 too"):
        fp8.validate_config(tiny_config(fp8_dot_product_attention=True), hopper)
    with pytest.raises(ValueError, match="head dim 128.*4 tokens"):
        fp8_attention.check_shape((1, 4, 2, 16), (1, 4, 2, 16))
    assert fp8.attention_spec(tiny_config(fp8="e4m3"), hopper) is None


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN FP8 attention needs an NVIDIA Hopper GPU")
@pytest.mark.xfail(
    strict=True,
    reason="measured on an H100 with jax 0.11.2: output 5.9% off BF16 attention, dq/dk/dv 74%/99%/700% "
    "(RESULTS.md eleventh run); config.fp8_dot_product_attention is refused until this passes",
)
def test_gpu_cudnn_fp8_attention_against_bf16():
    q, k, v, pe, g = _qkv(0, (4, 1536, 24, 128))
    spec = fp8.Fp8Spec(jnp.float8_e4m3fn, jnp.float8_e5m2, amax_history_len=4)
    mod = fp8_attention.Fp8Attention(spec)
    meta = mod.init(jax.random.key(0), q, k, v, pe)["fp8_meta"]

    @jax.jit
    def grads(qkv, meta):
        def loss(qkv, meta):
            out = mod.apply({"fp8_meta": fp8.as_max_grad(meta)}, *qkv, pe)
            return jnp.sum(out.astype(F32) * g.astype(F32)), out

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(qkv, meta)

    ref_out, ref_vjp = jax.vjp(lambda *a: math.attention(*a, pe, "cudnn"), q, k, v)
    ref_grads = ref_vjp(g)
    for _ in range(2):
        (_, out), (dqkv, new) = grads((q, k, v), meta)
        meta = fp8.from_max_grad(new)
    assert _rel(out, ref_out) < 0.05
    for a, b in zip(dqkv, ref_grads):
        assert _rel(a, b) < 0.15


def test_slot_probe_reads_the_contract_off_the_emulated_kernel():
    # benchmarks/fp8_attention.py --probe-slots maps cuDNN's scale slots on a GPU; against the emulation
    # of the documented contract every slot must do what SLOT_EFFECTS says, with FP8-sized errors.
    from benchmarks.fp8_attention import SLOT_EFFECTS, slot_probe

    found = slot_probe(emulated_kernel, shape=(1, 128, 2, 128))
    assert {s: r["unexpected"] for s, r in found["slots"].items()} == {s: {} for s in SLOT_EFFECTS}
    assert all(e < 0.1 for e in found["errors_vs_float32"].values()), found["errors_vs_float32"]
    # The emulation reports amax_dP as dS's maximum, not dO V^T's.
    assert found["amax_dP"] == pytest.approx(found["max_abs_dS"], rel=0.02)
    assert found["max_abs_dOVt"] > 10 * found["max_abs_dS"]


def test_slot_probe_names_a_kernel_that_reads_two_slots_swapped():
    from benchmarks.fp8_attention import slot_probe

    def swapped(q8, k8, v8, params, scale):  # reads scale_dV where scale_dQ is documented, and back
        return emulated_kernel(
            q8, k8, v8, params | {"scale_dQ": params["scale_dV"], "scale_dV": params["scale_dQ"]}, scale
        )

    found = slot_probe(swapped, shape=(1, 128, 2, 128))
    wrong = {s: sorted(r["unexpected"]) for s, r in found["slots"].items() if r["unexpected"]}
    assert wrong == {"scale_dQ": ["dq", "dv"], "scale_dV": ["dq", "dv"]}
