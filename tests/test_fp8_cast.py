"""The FP8 operand casts: XLA semantics everywhere, the Triton kernel bit-equal to it on a GPU."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import delayed_meta

from flux_jax import fp8, fp8_cast
from flux_jax.fp8_dot import Fp8Spec, fp8_matmul

ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="the Triton cast runs on an NVIDIA GPU only")


def _x(shape, seed=0, dtype=jnp.bfloat16, scale=3.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, dtype)


def test_xla_cast_quantizes_transposes_and_measures_amax():
    x = _x((48, 80))
    scale = jnp.float32(0.01)  # 3-sigma values ~9 -> 900 > 448: some saturate
    q, q_t, amax = fp8_cast.cast_xla(x, jnp.float8_e4m3fn, scale, transpose=True)
    ref = np.clip(np.asarray(x, np.float32) / 0.01, -448, 448)
    want = np.asarray(jnp.asarray(ref).astype(q.dtype), np.float32)
    np.testing.assert_array_equal(np.asarray(q, np.float32), want)
    np.testing.assert_array_equal(np.asarray(q_t), np.asarray(q).T)
    assert float(amax) == float(np.max(np.abs(np.asarray(x, np.float32))))
    assert np.max(np.abs(np.asarray(q, np.float32))) == 448.0
    _, none, _ = fp8_cast.cast_xla(x, jnp.float8_e4m3fn, scale, transpose=False)
    assert none is None


@pytest.mark.parametrize("kernel", ["xla", pytest.param("triton", marks=gpu_only)])
@pytest.mark.parametrize("via", [jnp.bfloat16, jnp.float16])
def test_cast_via_rounds_a_float32_master_first(kernel, via):
    # A float32 kernel cast "via" the compute dtype gives the bits of casting its 16-bit copy.
    w = _x((200, 300), 4, jnp.float32, scale=0.05)
    scale = jnp.float32(float(jnp.max(jnp.abs(w))) / 448 * 0.5)
    cast = jax.jit(fp8_cast.cast, static_argnums=(1, 3, 4, 5))
    want = cast(w.astype(via), jnp.float8_e4m3fn, scale, True, kernel, None)
    got = cast(w, jnp.float8_e4m3fn, scale, True, kernel, via)
    plain = cast(w, jnp.float8_e4m3fn, scale, True, kernel, None)
    for a, b in zip(want[:2], got[:2]):
        np.testing.assert_array_equal(np.asarray(b).view(np.uint8), np.asarray(a).view(np.uint8))
    assert float(got[2]) == float(want[2]) == float(jnp.max(jnp.abs(w.astype(via))))
    # Without ``via`` the float32 values round differently somewhere: the check has teeth.
    assert not np.array_equal(np.asarray(plain[0]).view(np.uint8), np.asarray(want[0]).view(np.uint8))


@pytest.mark.parametrize("via", [jnp.bfloat16, jnp.float16])
def test_round_to_is_the_16_bit_copy_even_where_xla_drops_convert_pairs(via):
    # Normal values, subnormals of the 16-bit type, overflow to inf, signed zero.
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(4096) * s for s in (0.05, 1e-5, 1e-7, 1e5)]
    x = jnp.asarray(np.concatenate(parts + [[65519.0, 65520.0, 7e4, 2.98e-8, 2.99e-8, -0.0]]), jnp.float32)
    want = np.asarray(x.astype(via).astype(jnp.float32))
    for fn in (fp8_cast.round_to, jax.jit(fp8_cast.round_to, static_argnums=1)):
        got = np.asarray(fn(x, via))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _config(**kw):
    c = ml_collections.ConfigDict(
        dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4, fp8_cast_kernel="xla")
    )
    c.update(kw)
    return c


def test_unknown_cast_kernel_is_named():
    with pytest.raises(ValueError, match="fp8_cast_kernel='cuda'"):
        fp8.validate_config(_config(fp8_cast_kernel="cuda"), fp8.DeviceDescription("cpu"))


@pytest.mark.skipif(ON_GPU, reason="checks the error off GPU")
def test_triton_cast_off_gpu_is_a_clear_error_and_auto_falls_back_to_xla():
    with pytest.raises(ValueError, match="fp8_cast_kernel='triton' cannot run here.*not a GPU"):
        fp8.validate_config(_config(fp8_cast_kernel="triton"), fp8.DeviceDescription("cpu"))
    spec = fp8.spec_from_config(_config(fp8_cast_kernel="auto"), fp8.DeviceDescription("cpu"))
    assert spec.cast_kernel == "xla"


@gpu_only
@pytest.mark.parametrize("shape", [(6144, 3072), (2048, 12288), (100, 200), (3072, 9216)])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_triton_cast_is_bit_equal_to_xla(shape, dtype):
    x = _x(shape, seed=shape[0])
    scale = jnp.float32(float(jnp.max(jnp.abs(x))) / fp8_cast.fp8_max(dtype) * 0.5)  # half saturates
    want = jax.jit(fp8_cast.cast_xla, static_argnums=(1, 3))(x, dtype, scale, True)
    got = jax.jit(fp8_cast.cast_triton, static_argnums=(1, 3))(x, dtype, scale, True)
    for w, g in zip(want[:2], got[:2]):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
    assert float(got[2]) == float(want[2])


@gpu_only
def test_triton_cast_amax_is_inf_on_nan_so_the_scale_update_skips():
    x = _x((256, 256)).at[17, 33].set(jnp.nan)
    _, _, amax = jax.jit(fp8_cast.cast_triton, static_argnums=(1, 3))(x, jnp.float8_e4m3fn, 1.0, True)
    assert not np.isfinite(float(amax))


@gpu_only
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_matmul_with_triton_cast_equals_xla_cast(recipe):
    x, w, g = _x((1024, 768), 1), _x((768, 512), 2, scale=0.05), _x((1024, 512), 3, scale=1e-3)
    meta = delayed_meta()

    def run(kernel):
        spec = Fp8Spec(recipe=recipe, amax_history_len=4, cast_kernel=kernel)
        f = lambda x, w, meta: fp8_matmul(x, w, meta, None, spec, jnp.bfloat16)  # noqa: E731
        y, vjp = jax.vjp(f, x, w, meta)
        return y, *vjp(g.astype(y.dtype))

    want, got = jax.jit(lambda: run("xla"))(), jax.jit(lambda: run("triton"))()
    # The casts are bit-equal; XLA may still pick other GEMM algorithms (accumulation order) for
    # operands that come from a custom call, so outputs agree to bf16 rounding, amaxes exactly.
    for w_, g_ in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        w_, g_ = np.asarray(w_, np.float32), np.asarray(g_, np.float32)
        assert np.max(np.abs(g_ - w_)) <= 1e-2 * np.max(np.abs(w_)) + 1e-30


def _cpu_mesh(shape=(4, 2), names=("data", "fsdp")):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


@pytest.mark.parametrize("shape,transpose", [((64, 48), True), ((36, 24), True), ((6, 16), False)])
def test_partitioned_cast_on_a_mesh_is_bit_equal_to_the_whole_cast(shape, transpose):
    # The shard_map wiring the Triton cast uses on meshes, run with the XLA cast as the per-device kernel:
    # rows split over the axes that divide them (64: data x fsdp, 36: data only, 6: fsdp only).
    x = _x(shape, 7)
    scale = jnp.float32(float(jnp.max(jnp.abs(x))) / 448 * 0.5)
    run = fp8_cast.partitioned(fp8_cast.cast_xla)
    want = jax.jit(fp8_cast.cast_xla, static_argnums=(1, 3))(x, jnp.float8_e4m3fn, scale, transpose)
    with jax.set_mesh(_cpu_mesh()):
        f = jax.jit(lambda x, s: run(x, jnp.float8_e4m3fn, s, transpose))
        assert "shard_map" in str(jax.make_jaxpr(f)(x, scale))
        got = f(x, scale)
    for w, g in zip(want[:2], got[:2]):
        if w is None:
            assert g is None
            continue
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
    assert float(got[2]) == float(want[2]) == float(jnp.max(jnp.abs(x)))


def test_row_axes_take_the_mesh_axes_that_divide_the_rows():
    mesh = _cpu_mesh()
    assert fp8_cast.row_axes(mesh, 64, ("data", "fsdp")) == ("data", "fsdp")
    assert fp8_cast.row_axes(mesh, 36, ("data", "fsdp")) == ("data",)
    assert fp8_cast.row_axes(mesh, 6, ("data", "fsdp")) == ("fsdp",)
    assert fp8_cast.row_axes(mesh, 3, ("data", "fsdp")) == ()


@pytest.mark.skipif(ON_GPU, reason="an 8-device CPU mesh; the GPU runs the shard_map bit-equality test")
def test_triton_kernel_choice_runs_per_shard_on_a_mesh(monkeypatch):
    # The "triton" path of fp8_matmul on an 8-device mesh, the kernel replaced by the XLA cast (no GPU
    # here): every cast goes through shard_map on local rows, and the results equal the XLA path's.
    seen = []

    def local_cast(x, dtype, scale, transpose, via=None):
        seen.append(x.shape)
        return fp8_cast.cast_xla(x, dtype, scale, transpose, via)

    monkeypatch.setattr(fp8_cast, "cast_triton", local_cast)
    x, w, g = _x((64, 32), 1), _x((32, 16), 2, scale=0.05), _x((64, 16), 3, scale=1e-3)
    meta = delayed_meta()

    def run(kernel):
        spec = Fp8Spec(amax_history_len=4, cast_kernel=kernel)
        f = lambda x, w, meta: fp8_matmul(x, w, meta, None, spec, jnp.bfloat16)  # noqa: E731
        y, vjp = jax.vjp(f, x, w, meta)
        return y, *vjp(g.astype(y.dtype))

    with jax.set_mesh(_cpu_mesh()):
        want, got = jax.jit(lambda: run("xla"))(), jax.jit(lambda: run("triton"))()
    # Per device: the kernel (32 x 16), the output gradient (64 x 16) and the input (64 x 32), by rows.
    assert sorted(seen) == [(4, 16), (8, 16), (8, 32)]
    for w_, g_ in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(g_, np.float32), np.asarray(w_, np.float32))


@gpu_only
@pytest.mark.parametrize("transpose", [True, False])
def test_triton_cast_under_shard_map_is_bit_equal_to_xla(transpose):
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x = _x((3072, 1536), 11)
    dtype = jnp.float8_e4m3fn
    scale = jnp.float32(float(jnp.max(jnp.abs(x))) / fp8_cast.fp8_max(dtype) * 0.5)
    want = jax.jit(fp8_cast.cast_xla, static_argnums=(1, 3))(x, dtype, scale, transpose)
    sharded = fp8_cast.shard_rows(fp8_cast.cast_triton, mesh, x.shape[0])
    got = jax.jit(lambda x, s: sharded(x, dtype, s, transpose))(x, scale)
    for w, g in zip(want[:2], got[:2]):
        if w is not None:
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
    assert float(got[2]) == float(want[2])


@pytest.fixture
def probe(monkeypatch):
    """triton_cast_error with jax-triton taken as present and ``cast_triton`` replaced by ``kernel``."""

    def run(kernel, dtypes=("float8_e4m3fn", "float8_e5m2")):
        monkeypatch.setattr(fp8_cast, "triton_available", lambda platform=None: None)
        monkeypatch.setattr(fp8_cast, "cast_triton", kernel)
        fp8_cast.triton_cast_error.cache_clear()
        try:
            return fp8_cast.triton_cast_error(dtypes)
        finally:
            fp8_cast.triton_cast_error.cache_clear()

    return run


def _as_xla(x, dtype, scale, transpose, via=None):
    return fp8_cast.cast_xla(x, dtype, scale, int(transpose), via)


def test_device_probe_passes_a_kernel_that_matches_the_xla_cast(probe):
    assert probe(_as_xla) is None
    assert probe(_as_xla, ("float8_e4m3fnuz", "float8_e5m2fnuz")) is None


def test_device_probe_names_the_first_output_that_differs(probe):
    def one_value_off(x, dtype, scale, transpose, via=None):
        q, q_t, amax = _as_xla(x, dtype, scale, transpose, via)
        return q, q_t.at[5, 7].set(q_t[5, 7] * 2 + 1), amax

    msg = probe(one_value_off)
    assert msg == "its q.T differs from the XLA cast's in 1 of 19200 values (float8_e4m3fn, bfloat16 input)"

    def off_for_float32(x, dtype, scale, transpose, via=None):
        return _as_xla(x, dtype, scale * (2.0 if via else 1.0), transpose, via)

    assert "(float8_e4m3fn, float32 input)" in probe(off_for_float32)

    def fails(*args):
        raise RuntimeError("no kernel image for gfx942\nmore")

    assert probe(fails) == "RuntimeError: no kernel image for gfx942"


def test_device_probe_input_clips_rounds_to_subnormals_and_has_signed_zeros():
    x = fp8_cast._probe_input()
    dtype = jnp.float8_e4m3fn
    scale = np.abs(x).max() / fp8_cast.fp8_max(dtype) / 2.0
    q = np.asarray(fp8_cast.quantize(jnp.asarray(x), dtype, scale), np.float32)
    assert np.sum(np.abs(q) == fp8_cast.fp8_max(dtype)) > 10  # clipped
    tiny = float(jnp.finfo(dtype).smallest_normal)
    assert np.sum((np.abs(q) > 0) & (np.abs(q) < tiny)) > 10  # FP8 subnormals
    assert np.sum(np.signbit(x) & (x == 0)) > 0 and np.sum(~np.signbit(x) & (x == 0)) > 0
    assert x.shape[0] % 64 and x.shape[1] % 128  # partial tiles on both axes


@gpu_only
def test_gpu_triton_cast_passes_the_device_probe():
    fp8_cast.triton_cast_error.cache_clear()
    assert fp8_cast.triton_cast_error(("float8_e4m3fn", "float8_e5m2")) is None
