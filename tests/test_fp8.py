import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import ml_dtypes
import numpy as np
import pytest

from flux_jax import fp8
from flux_jax.fp8_dot import Fp8DotGeneral, Fp8Spec, quantize, scale_from_amax

DIMS = (((1,), (0,)), ((), ()))
H200 = fp8.DeviceDescription("cuda", "NVIDIA H200", "9.0")
MI300 = fp8.DeviceDescription("rocm", "AMD Instinct MI300X", "gfx942")
MI355 = fp8.DeviceDescription("rocm", "AMD Instinct MI355X", "gfx950")
CPU = fp8.DeviceDescription("cpu", "cpu", "")


def make_config(**overrides):
    c = ml_collections.ConfigDict(
        dict(
            fp8="hybrid",
            fp8_recipe="delayed",
            fp8_margin=0,
            fp8_amax_history_len=16,
            fp8_amax_compute_algo="max",
            fp8_wgrad=True,
            fp8_format_family="auto",
            first_last_layers_bf16=False,
            num_layers_at_start_in_bf16=0,
            num_layers_at_end_in_bf16=0,
            fp8_modulation=False,
        )
    )
    c.update(overrides)
    return c


@pytest.mark.parametrize(
    "desc,expected",
    [
        (H200, "ocp"),
        (MI300, "fnuz"),
        (MI355, "ocp"),
        (CPU, "ocp"),
        (fp8.DeviceDescription("gpu", "gfx942:sramecc+:xnack-", ""), "fnuz"),
    ],
)
def test_format_family_from_device(desc, expected):
    assert fp8.format_family(desc) == expected


def test_family_forced_and_dtype_max():
    assert fp8.format_family(H200, "fnuz") == "fnuz"
    assert fp8.format_family(MI300, "ocp") == "ocp"
    fwd, bwd = fp8.fp8_dtypes("hybrid", "fnuz")
    assert (fwd, bwd) == (jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz)
    assert float(jnp.finfo(fwd).max) == 240.0
    fwd, bwd = fp8.fp8_dtypes("e4m3", "ocp")
    assert fwd == bwd == jnp.float8_e4m3fn and float(jnp.finfo(fwd).max) == 448.0


@pytest.mark.parametrize(
    "field,value",
    [
        ("fp8_recipe", "bogus"),
        ("fp8", "e3m4"),
        ("fp8_amax_history_len", 0),
        ("fp8_margin", -1),
        ("fp8_amax_compute_algo", "mean"),
        ("fp8_format_family", "nanoo"),
    ],
)
def test_validate_config_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        fp8.validate_config(make_config(**{field: value}), H200)


def test_validate_config_names_every_bad_field_in_one_error():
    from flux_jax.errors import UserError

    bad = dict(fp8_recipe="bogus", fp8_margin=-1, fp8_amax_compute_algo="mean", fp8_format_family="nanoo")
    with pytest.raises(UserError) as err:
        fp8.validate_config(make_config(**bad), H200)
    message = str(err.value)
    assert message.startswith("Invalid FP8 config (4 problems):")
    for field, value in bad.items():
        assert f"config.{field}={value!r}" in message
    # The platform check joins the same list.
    a100 = fp8.DeviceDescription("cuda", "NVIDIA A100", "8.0")
    problems = fp8.config_problems(make_config(fp8_margin=-1), a100)
    assert len(problems) == 2 and "has no FP8 GEMMs" in problems[1]


def test_validate_config_platform():
    fp8.validate_config(make_config(), H200)
    fp8.validate_config(make_config(fp8=None, fp8_recipe="bogus"), H200)
    with pytest.raises(ValueError, match="config.fp8="):
        fp8.validate_config(make_config(), fp8.DeviceDescription("cuda", "NVIDIA A100", "8.0"))
    with pytest.raises(ValueError, match="fp8_recipe"):
        fp8.validate_config(make_config(fp8_recipe="mxfp8"), H200)
    fp8.validate_config(make_config(fp8_recipe="mxfp8"), MI355)
    fp8.validate_config(make_config(fp8_recipe="mxfp8"), fp8.DeviceDescription("cuda", "B200", "10.0"))


@pytest.mark.parametrize("device", [H200, MI355, fp8.DeviceDescription("cuda", "B200", "10.0")])
def test_blockwise_is_rejected_everywhere_until_it_exists(device):
    # "blockwise" would run the MX recipe under another name; mxfp8 stays where the hardware has it.
    with pytest.raises(ValueError, match=r"fp8_recipe='blockwise' is not implemented yet.*use 'mxfp8'"):
        fp8.validate_config(make_config(fp8_recipe="blockwise"), device)


def test_scale_skips_zero_and_nonfinite():
    dt = jnp.float8_e4m3fn
    for bad in (0.0, np.inf, np.nan):
        assert float(scale_from_amax(jnp.float32(bad), jnp.float32(0.5), dt, 0.0)) == 0.5
    np.testing.assert_allclose(float(scale_from_amax(jnp.float32(896.0), 1.0, dt, 1.0)), 4.0)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz, jnp.float8_e5m2])
def test_saturation_at_max(dtype):
    q = quantize(jnp.array([1e9, -1e9, 1.0], jnp.float32), dtype, jnp.float32(1.0))
    m = float(jnp.finfo(dtype).max)
    np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)), [m, -m, 1.0])


def _fp8_step(spec):
    mod = Fp8DotGeneral(spec=spec)

    @jax.jit
    def step(x, w, meta, c):
        y, vjp = jax.vjp(lambda a, b, m: mod.apply({"fp8_meta": m}, a, b, DIMS), x, w, meta)
        dx, dw, new_meta = vjp(c)
        return y, dx, dw, new_meta

    return mod, step


class NumpyDelayed:
    """Reference delayed scaling for one operand, written independently of the JAX code."""

    def __init__(self, n, dtype, algo, margin):
        self.hist, self.scale = np.zeros(n, np.float32), np.float32(1.0)
        self.dtype, self.algo, self.margin = dtype, algo, margin
        self.max = float(ml_dtypes.finfo(dtype).max)

    def step(self, x):
        a = self.hist[0] if self.algo == "most_recent" else self.hist.max()
        if np.isfinite(a) and a > 0:
            self.scale = np.float32(a * 2.0**self.margin / self.max)
        q = np.clip(x / self.scale, -self.max, self.max).astype(self.dtype).astype(np.float32)
        self.hist = np.roll(self.hist, -1)
        self.hist[0] = np.abs(x).max()
        return q * self.scale


@pytest.mark.parametrize("algo,margin", [("max", 0.0), ("most_recent", 0.0), ("most_recent", 2.0)])
def test_delayed_matches_numpy_model(algo, margin):
    n = 4
    spec = Fp8Spec(amax_history_len=n, amax_compute_algo=algo, margin=margin, recipe="delayed")
    mod, step = _fp8_step(spec)
    rng = np.random.default_rng(0)
    x0 = jnp.zeros((8, 16), jnp.float32)
    w0 = jnp.zeros((16, 12), jnp.float32)
    meta = mod.init(jax.random.PRNGKey(0), x0, w0, DIMS)["fp8_meta"]
    refs = {
        k: NumpyDelayed(n, d, algo, margin)
        for k, d in (("input", spec.fwd_dtype), ("kernel", spec.fwd_dtype), ("output_grad", spec.bwd_dtype))
    }
    mags = [1.0, 3.0, 0.5, 0.0, 20.0, 2.0, 2.0, 0.1, 5.0, 1.0, 7.0, 0.3]
    for i, mag in enumerate(mags):
        x = (rng.standard_normal((8, 16)) * mag).astype(np.float32)
        w = (rng.standard_normal((16, 12)) * (1 + i % 3)).astype(np.float32)
        c = (rng.standard_normal((8, 12)) * 10.0 ** (i % 4 - 2)).astype(np.float32)
        y, dx, dw, meta = step(x, w, meta, c)
        xq, wq, cq = refs["input"].step(x), refs["kernel"].step(w), refs["output_grad"].step(c)
        for got, want in ((y, xq @ wq), (dx, cq @ wq.T), (dw, xq.T @ cq)):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        for k, ref in refs.items():
            np.testing.assert_allclose(np.asarray(meta[f"{k}_amax_history"]), ref.hist, rtol=1e-6)
            np.testing.assert_allclose(float(meta[f"{k}_scale"]), ref.scale, rtol=1e-6)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("family", ["ocp", "fnuz"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "rowwise"])
def test_gradients_close_to_float32(family, fmt, recipe):
    fwd, bwd = fp8.fp8_dtypes(fmt, family)
    mod, step = _fp8_step(Fp8Spec(fwd_dtype=fwd, bwd_dtype=bwd, recipe=recipe, amax_history_len=2))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 64)).astype(np.float32) * 3
    w = rng.standard_normal((64, 24)).astype(np.float32) * 0.1
    c = rng.standard_normal((32, 24)).astype(np.float32) * 1e-3
    meta = mod.init(jax.random.PRNGKey(0), x, w, DIMS)["fp8_meta"]
    _, _, _, meta = step(x, w, meta, c)  # delayed scaling needs one step of history
    y, dx, dw, meta = step(x, w, meta, c)
    # Relative Frobenius error of a K-term FP8 product: about the format's half-ulp / sqrt(3).
    fwd_tol, bwd_tol = 0.05, (0.1 if fmt == "hybrid" else 0.05)
    assert _rel(y, x @ w) < fwd_tol
    assert _rel(dx, c @ w.T) < bwd_tol
    assert _rel(dw, x.T @ c) < bwd_tol
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(meta))


def test_wgrad_off_keeps_weight_grad_exact_and_hlo_has_fp8_dots():
    x = jnp.ones((16, 32), jnp.bfloat16)
    w = jnp.ones((32, 8), jnp.bfloat16)
    for wgrad, n_fp8 in ((True, 3), (False, 2)):
        mod, step = _fp8_step(Fp8Spec(wgrad=wgrad, amax_history_len=2))
        meta = mod.init(jax.random.PRNGKey(0), x, w, DIMS)["fp8_meta"]
        text = step.lower(x, w, meta, jnp.ones((16, 8), jnp.bfloat16)).as_text()
        dots = [ln for ln in text.splitlines() if "dot_general" in ln]
        assert sum("f8E" in ln.split("->")[0] for ln in dots) == n_fp8
    _, _, dw, _ = step(x, w, meta, jnp.full((16, 8), 0.3, jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(dw, np.float32), 16 * 0.3, rtol=1e-2)


class TwoDense(nn.Module):
    spec: Fp8Spec

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(8, use_bias=False, dot_general_cls=functools.partial(Fp8DotGeneral, spec=self.spec))
        return dense(x) + dense(10.0 * x)  # one state, two uses


def test_shared_state_combines_by_max():
    m = TwoDense(Fp8Spec(amax_history_len=3))
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 4))
    v = m.init(jax.random.PRNGKey(1), x)

    def loss(params, meta):
        y = m.apply({"params": params, "fp8_meta": fp8.as_max_grad(meta)}, x)
        return jnp.sum(y)

    _, new = jax.jit(jax.grad(loss, argnums=(0, 1)))(v["params"], v["fp8_meta"])
    hist = new["Dense_0"]["Fp8DotGeneral_0"]["input_amax_history"]
    assert hist.dtype == jnp.float32
    np.testing.assert_allclose(float(hist[0]), 10.0 * float(jnp.max(jnp.abs(x))), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(hist[1:]), 0.0)
    merged = fp8.merge_states(v["fp8_meta"], new)
    assert float(merged["Dense_0"]["Fp8DotGeneral_0"]["input_amax_history"][0]) == float(hist[0])


class Layer(nn.Module):
    spec: Fp8Spec

    @nn.compact
    def __call__(self, x, _):
        dg = functools.partial(Fp8DotGeneral, spec=self.spec)
        return nn.Dense(x.shape[-1], dot_general_cls=dg)(x) * 2.0, None


def test_scan_and_remat_keep_per_layer_state():
    n_layers, hist = 3, 4
    stack = nn.scan(
        nn.remat(Layer),
        variable_axes={"params": 0, "fp8_meta": 0},
        split_rngs={"params": True},
        length=n_layers,
    )(Fp8Spec(amax_history_len=hist))
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 8))
    v = stack.init(jax.random.PRNGKey(1), x, None)
    meta = v["fp8_meta"]
    assert meta["Dense_0"]["Fp8DotGeneral_0"]["input_amax_history"].shape == (n_layers, hist)
    assert meta["Dense_0"]["Fp8DotGeneral_0"]["input_scale"].shape == (n_layers,)

    def loss(params, meta):
        return jnp.sum(stack.apply({"params": params, "fp8_meta": meta}, x, None)[0])

    _, new = jax.jit(jax.grad(loss, argnums=(0, 1)))(v["params"], meta)
    h = np.asarray(new["Dense_0"]["Fp8DotGeneral_0"]["input_amax_history"])
    assert h.shape == (n_layers, hist)
    np.testing.assert_allclose(h[0, 0], float(jnp.max(jnp.abs(x))), rtol=1e-6)
    assert len(set(np.round(h[:, 0], 5))) == n_layers  # each layer saw its own input
    assert (h[:, 1:] == 0).all()


def test_dense_3d_input_matches_2d():
    mod, _ = _fp8_step(Fp8Spec(recipe="tensorwise"))
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 16))
    w = jax.random.normal(jax.random.PRNGKey(1), (16, 4))
    dims3 = (((2,), (0,)), ((), ()))
    meta = mod.init(jax.random.PRNGKey(0), x, w, dims3)
    y3 = mod.apply(meta, x, w, dims3)
    y2 = mod.apply(meta, x.reshape(10, 16), w, DIMS)
    np.testing.assert_allclose(np.asarray(y3).reshape(10, 4), np.asarray(y2), rtol=1e-6)
    with pytest.raises(ValueError, match="dense layouts"):
        mod.apply(meta, x, jnp.ones((2, 16, 4)), (((2,), (1,)), ((0,), (0,))))


def test_make_policy_sites():
    params = type("P", (), {"depth": 2, "depth_single_blocks": 3})()
    assert fp8.make_policy(make_config(fp8=None), params, CPU) is None
    policy = fp8.make_policy(
        make_config(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=2),
        params,
        CPU,
    )
    # Every block site holds FP8 state; the first/last ones run BF16 (enabled=False).
    assert all(policy(s) is not None for s in fp8.block_sites(params))
    fp8_sites = [s for s in fp8.block_sites(params) if policy(s)().enabled]
    assert fp8_sites == ["double_blocks.1", "single_blocks.0"]
    for site in ("img_in", "txt_in", "time_in", "vector_in", "guidance_in", "final_layer"):
        assert policy(site) is None
    assert policy("double_blocks.0.modulation") is None  # fp8_modulation off: no state
    mod = policy("double_blocks.1")()
    assert isinstance(mod, Fp8DotGeneral) and mod.spec.bwd_dtype == jnp.float8_e5m2
    fnuz = fp8.make_policy(make_config(fp8="e4m3"), params, MI300)("single_blocks.2")()
    assert fnuz.spec.fwd_dtype == fnuz.spec.bwd_dtype == jnp.float8_e4m3fnuz


def test_summarize():
    meta = {
        "a": {"input_scale": jnp.float32(0.5), "input_amax_history": jnp.array([3.0, 1.0])},
        "b": {"kernel_scale": jnp.float32(2.0), "kernel_amax_history": jnp.array([0.0, 7.0])},
    }
    assert fp8.summarize(meta) == {"scale_min": 0.5, "scale_max": 2.0, "amax_max": 7.0}
    # A held BF16 layer (scale 1, nothing recorded) and the held layers of a scanned stack stay out.
    meta["held"] = {"input_scale": jnp.float32(1e-3), "input_amax_history": jnp.zeros(2)}
    meta["scan"] = {"input_scale": jnp.array([4.0, 9.0]), "input_amax_history": jnp.array([[1.0, 0], [0, 0]])}
    assert fp8.summarize(meta) == {"scale_min": 0.5, "scale_max": 4.0, "amax_max": 7.0}
    assert fp8.summarize({"held": meta["held"]}) == {}


def test_double_stream_block_fp8_close_to_bf16():
    from flux_jax.layers import DoubleStreamBlock
    from flux_jax.math import embed_nd

    dg = functools.partial(Fp8DotGeneral, spec=Fp8Spec(recipe="tensorwise", amax_history_len=2))
    kw = dict(hidden_size=32, num_heads=2, mlp_ratio=4.0, dtype=jnp.float32)
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    img, txt = jax.random.normal(ks[0], (2, 8, 32)), jax.random.normal(ks[1], (2, 4, 32))
    vec = jax.random.normal(ks[2], (2, 32))
    ids = jnp.zeros((2, 12, 3)).at[..., 1].set(jnp.arange(12.0))
    pe = embed_nd(ids, (4, 6, 6), 10_000)
    ref_block, fp8_block = (
        DoubleStreamBlock(**kw),
        DoubleStreamBlock(**kw, dot_general_cls=dg, modulation_dot_general_cls=dg),
    )
    params = ref_block.init(ks[3], img, txt, vec, pe)["params"]
    v = fp8_block.init(ks[3], img, txt, vec, pe)
    assert jax.tree.structure(v["params"]) == jax.tree.structure(params)
    n_dense = len(jax.tree.leaves(v["fp8_meta"])) // 6
    assert n_dense == 10  # mod.lin, attn.qkv, attn.proj, mlp_0, mlp_2 per stream
    ref = ref_block.apply({"params": params}, img, txt, vec, pe)
    out = fp8_block.apply({"params": params, "fp8_meta": v["fp8_meta"]}, img, txt, vec, pe)
    for a, b in zip(out, ref, strict=True):
        assert _rel(a, b) < 0.05


def test_flux_scanned_blocks_have_per_layer_fp8_meta():
    from flux_jax.model import PRESETS, Flux

    p = dataclasses.replace(PRESETS["tiny"], depth=2, depth_single_blocks=3)
    policy = fp8.make_policy(make_config(fp8_amax_history_len=5), p, CPU)
    model = Flux(p, dtype=jnp.float32, dot_general_policy=policy, scan_blocks=True)
    b, n, t = 1, 4, 3
    args = (
        jnp.ones((b, n, 64)),
        jnp.zeros((b, n, 3)),
        jnp.ones((b, t, 32)),
        jnp.zeros((b, t, 3)),
        jnp.full((b,), 0.5),
        jnp.ones((b, 32)),
    )
    v = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *args))
    meta = v["fp8_meta"]
    hists = [
        (jax.tree_util.keystr(k), x.shape)
        for k, x in jax.tree_util.tree_flatten_with_path(meta)[0]
        if "amax_history" in jax.tree_util.keystr(k)
    ]
    assert hists and all(s[-1] == 5 for _, s in hists)
    assert all(s[0] == 2 for k, s in hists if "double" in k) and any("double" in k for k, _ in hists)
    assert all(s[0] == 3 for k, s in hists if "single" in k) and any("single" in k for k, _ in hists)
    assert not any(k.startswith(("['img_in", "['txt_in", "['final")) for k, _ in hists)


@pytest.mark.parametrize("fp8_modulation", [False, True])
def test_policy_modulation_sites_follow_config(fp8_modulation):
    from flux_jax.model import PRESETS

    p = dataclasses.replace(PRESETS["tiny"], depth=2, depth_single_blocks=1)
    policy = fp8.make_policy(make_config(fp8_modulation=fp8_modulation), p, CPU)
    assert policy("double_blocks.1") is not None and policy("single_blocks.0") is not None
    assert (policy("double_blocks.1.modulation") is not None) == fp8_modulation
    assert (policy("single_blocks.0.modulation") is not None) == fp8_modulation
    assert policy("img_in") is None and policy("final_layer") is None


@pytest.mark.parametrize("recipe", [None, "delayed", "tensorwise", "rowwise"])
def test_dense_hands_the_float32_kernel_to_its_dot_bit_equal(recipe):
    # layers.dense gives its dot_general the float32 master kernel (the FP8 dot quantizes it straight
    # from float32); flax's nn.Dense gives it the bf16 copy. Same outputs, gradients and FP8 state.
    from flux_jax.layers import dense

    factory = None if recipe is None else functools.partial(Fp8DotGeneral, spec=Fp8Spec(recipe=recipe))
    ours = dense(24, (None, None), "d", jnp.bfloat16, factory)
    flax_dense = nn.Dense(24, dtype=jnp.bfloat16, param_dtype=jnp.float32, dot_general_cls=factory)
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 40), jnp.float32)
    variables = flax_dense.init(jax.random.PRNGKey(1), x)
    params = jax.tree.map(lambda p: p + 0.01, variables["params"])  # a nonzero bias
    meta = {k: v for k, v in variables.items() if k != "params"}
    if recipe is not None:
        assert "fp8_meta" in meta  # fp8_meta, then a second step from the first one's state

    def run(module, meta):
        def f(params, meta, x):
            return module.apply({"params": params, **jax.tree.map(fp8.as_max_grad, meta)}, x)

        y, vjp = jax.vjp(f, params, meta, x)
        dparams, dmeta, dx = vjp(jnp.cos(y.astype(jnp.float32)).astype(y.dtype))
        return y, dparams, jax.tree.map(fp8.from_max_grad, dmeta), dx

    for _ in range(2):
        got, want = jax.jit(lambda m: run(ours, m))(meta), jax.jit(lambda m: run(flax_dense, m))(meta)
        assert got[1]["kernel"].dtype == jnp.float32
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.dtype == w.dtype
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        meta = got[2]
