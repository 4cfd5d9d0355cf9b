"""Platform choices: every shipped config starts on ROCm (gfx942, gfx950), CUDA and CPU; "auto" resolves per
platform; an explicit choice the platform cannot run is one clear error."""

import importlib
import warnings

import jax.numpy as jnp
import pytest

from flux_jax import choices, config_check, fp8, setup

PLATFORMS = {
    "mi300x": fp8.DeviceDescription("rocm", "AMD Instinct MI300X", "gfx942"),
    "mi355x": fp8.DeviceDescription("rocm", "AMD Instinct MI355X", "gfx950"),
    "h100": fp8.DeviceDescription("cuda", "NVIDIA H100 80GB HBM3", "9.0"),
    "cpu": fp8.DeviceDescription("cpu", "cpu"),
}
SHIPPED = [(name, arg) for name in ("toy", "flux_535m", "flux_12b") for arg in (None, "fp8")]


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
@pytest.mark.parametrize("name,arg", SHIPPED)
def test_every_shipped_config_validates_and_resolves_on_every_platform(name, arg, platform):
    desc = PLATFORMS[platform]
    config = importlib.import_module(f"configs.{name}").get_config(arg)
    assert config.model.attention == "auto" and config.fp8_cast_kernel == "auto"
    config_check.validate(config, desc=desc)
    resolved = choices.resolve(config, setup.flux_params(config), desc)
    config_check.validate(config, desc=desc)  # the resolved values are valid there too
    sixteen_bit = config.model.dtype == "bfloat16"
    want_attention = {
        "h100": "cudnn" if sixteen_bit else "xla",
        "mi300x": choices.ROCM_ATTENTION,
        "mi355x": choices.ROCM_ATTENTION,
        "cpu": "xla",
    }[platform]
    assert resolved["model.attention"] == config.model.attention == want_attention
    assert resolved["fp8_format_family"] == ("fnuz" if platform == "mi300x" else "ocp")
    # The XLA cast off NVIDIA; on NVIDIA the Triton cast where jax-triton is installed.
    want_cast = "xla" if platform != "h100" else fp8.resolve_cast_kernel("auto", desc)
    assert resolved["fp8_cast_kernel"] == want_cast
    if arg == "fp8":
        spec = fp8.spec_from_config(config, desc)
        assert float(jnp.finfo(spec.fwd_dtype).max) == (240.0 if platform == "mi300x" else 448.0)


def test_auto_attention_needs_what_cudnn_takes():
    h100 = PLATFORMS["h100"]
    assert choices.auto_attention(h100, 128, "bfloat16") == "cudnn"
    assert choices.auto_attention(h100, 128, "float32") == "xla"  # cuDNN attention is 16-bit only
    assert choices.auto_attention(h100, 12, "bfloat16") == "xla"  # head dim not a multiple of 8


@pytest.mark.parametrize(
    "attention,platform,expected",
    [
        ("cudnn", "mi300x", r"model\.attention='cudnn' needs an NVIDIA GPU.*'rocm'.*attention=auto"),
        ("cudnn", "cpu", r"model\.attention='cudnn' needs an NVIDIA GPU.*'cpu'"),
        ("pallas", "cpu", r"model\.attention='pallas' .* needs an NVIDIA or AMD GPU.*'cpu'"),
    ],
)
def test_explicit_attention_the_platform_cannot_run_is_a_clear_error(attention, platform, expected):
    config = importlib.import_module("configs.flux_535m").get_config()
    config.model.attention = attention
    with pytest.raises(ValueError, match=expected):
        config_check.validate(config, desc=PLATFORMS[platform])
    # Resolution keeps an explicit choice; it is never swapped for one that runs.
    choices.resolve(config, setup.flux_params(config), PLATFORMS[platform])
    assert config.model.attention == attention


@pytest.mark.parametrize("platform", ["mi300x", "mi355x", "h100"])
def test_pallas_attention_is_allowed_on_gpus(platform):
    config = importlib.import_module("configs.flux_535m").get_config()
    config.model.attention = "pallas"
    config_check.validate(config, desc=PLATFORMS[platform])


@pytest.fixture
def rocm_gpu_with_probe(monkeypatch):
    """A GPU backend with jax-triton, and the device probe (fp8_cast.triton_cast_error) answering
    ``result``; returns the dtype tuples it was asked about."""
    asked = []

    def setup_probe(result):
        monkeypatch.setattr(fp8, "triton_available", lambda platform=None: None)
        monkeypatch.setattr(fp8.jax, "default_backend", lambda: "gpu")
        monkeypatch.setattr(fp8, "triton_cast_error", lambda dtypes: asked.append(dtypes) or result)
        return asked

    return setup_probe


def test_auto_cast_on_rocm_takes_triton_once_it_matches_the_xla_cast_on_the_device(rocm_gpu_with_probe):
    asked = rocm_gpu_with_probe(None)
    assert fp8.resolve_cast_kernel("auto", PLATFORMS["mi300x"]) == "triton"
    assert fp8.resolve_cast_kernel("auto", PLATFORMS["mi355x"]) == "triton"
    assert asked == [("float8_e4m3fnuz", "float8_e5m2fnuz"), ("float8_e4m3fn", "float8_e5m2")]
    assert fp8.resolve_cast_kernel("auto", PLATFORMS["mi300x"], "ocp") == "triton"
    assert asked[-1] == ("float8_e4m3fn", "float8_e5m2")
    # A run without FP8 does not ask; NVIDIA takes it without asking.
    assert fp8.resolve_cast_kernel("auto", PLATFORMS["mi300x"], probe=False) == "xla"
    assert fp8.resolve_cast_kernel("auto", PLATFORMS["h100"]) == "triton"
    assert len(asked) == 3
    config = importlib.import_module("configs.flux_535m").get_config("fp8")
    config.model.attention = "xla"  # the attention's own device check is not what this test is about
    choices.resolve(config, setup.flux_params(config), PLATFORMS["mi300x"])
    assert (config.fp8_cast_kernel, config.fp8_format_family) == ("triton", "fnuz")
    bf16 = importlib.import_module("configs.flux_535m").get_config()
    bf16.model.attention = "xla"
    choices.resolve(bf16, setup.flux_params(bf16), PLATFORMS["mi300x"])
    assert bf16.fp8_cast_kernel == "xla" and len(asked) == 4


def test_auto_cast_on_rocm_falls_back_to_xla_naming_the_mismatch(rocm_gpu_with_probe):
    rocm_gpu_with_probe(
        "its q differs from the XLA cast's in 3 of 19200 values (float8_e4m3fnuz, bfloat16 input)"
    )
    with pytest.warns(
        UserWarning, match=r"does not match the XLA cast on this GPU \(its q differs.*using the XLA"
    ):
        assert fp8.resolve_cast_kernel("auto", PLATFORMS["mi300x"]) == "xla"
    # Asked for explicitly, the mismatch is a config error, not a silent switch.
    config = importlib.import_module("configs.flux_535m").get_config("fp8")
    config.fp8_cast_kernel = "triton"
    with pytest.raises(
        ValueError, match=r"fp8_cast_kernel='triton': on this GPU the Triton FP8 cast does not match"
    ):
        config_check.validate(config, desc=PLATFORMS["mi300x"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config_check.validate(config, desc=PLATFORMS["h100"])  # NVIDIA: no probe, no warning


def test_auto_cast_on_a_rocm_description_off_the_gpu_stays_xla(monkeypatch):
    # jax-triton is not installed on the CPU test machines: availability is mocked, the check is the policy.
    monkeypatch.setattr(fp8, "triton_available", lambda platform=None: None)
    monkeypatch.setattr(fp8, "triton_cast_error", lambda dtypes: pytest.fail("probed on the CPU"))
    assert fp8.resolve_cast_kernel("auto", PLATFORMS["mi300x"]) == "xla"
    assert fp8.resolve_cast_kernel("auto", PLATFORMS["h100"]) == "triton"


def test_train_writes_the_resolved_choices_to_config_json(tiny_config, tmp_path):
    import json

    from flux_jax import train

    config = tiny_config(fp8="e4m3", train_iters=1, eval_interval=0)
    train.train_and_evaluate(config, str(tmp_path))
    saved = json.load(open(tmp_path / "config.json"))
    desc = fp8.describe_device()
    fp = setup.flux_params(config)
    head_dim = fp.hidden_size // fp.num_heads
    assert saved["model"]["attention"] == choices.auto_attention(desc, head_dim, "float32") != "auto"
    assert saved["fp8_cast_kernel"] == fp8.resolve_cast_kernel("auto", desc) != "auto"
    assert saved["fp8_format_family"] == fp8.format_family(desc) != "auto"


@pytest.mark.parametrize("compiles", [True, False])
def test_auto_pallas_on_a_gpu_falls_back_to_xla_only_if_it_does_not_run(monkeypatch, compiles):
    """On a GPU, auto picks Pallas on ROCm only after compiling it there; a failure is a warning naming it."""
    monkeypatch.setattr(choices.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(choices, "pallas_error", lambda: None if compiles else "LoweringError: no gfx942")
    config = importlib.import_module("configs.flux_535m").get_config(None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        resolved = choices.resolve(config, setup.flux_params(config), PLATFORMS["mi300x"])
    assert resolved["model.attention"] == ("pallas" if compiles else "xla")
    messages = [str(w.message) for w in seen if "Pallas flash attention" in str(w.message)]
    assert bool(messages) is not compiles
    assert compiles or "LoweringError: no gfx942" in messages[0]
    # An explicit choice is never replaced.
    config.model.attention = "pallas"
    again = choices.resolve(config, setup.flux_params(config), PLATFORMS["mi300x"])
    assert again["model.attention"] == "pallas"


def test_pallas_probe_runs_here():
    """The probe itself: the Pallas attention's forward and backward run on this backend (the CPU interpreter
    here; the device in GPU runs)."""
    choices.pallas_error.cache_clear()
    assert choices.pallas_error() is None
