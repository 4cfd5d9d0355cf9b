import jax
import pytest

from flux_jax import doctor

ON_GPU = jax.default_backend() == "gpu"


def test_count_fp8_gemms_parses_hlo_lines():
    hlo = "\n".join(
        [
            "%c = (bf16[64,64]{1,0}, s8[0]{0}) custom-call(f8e4m3fn[64,64]{1,0} %a), "
            'custom_call_target="__cublas$lt$matmul$f8"',
            '%d = bf16[64,64]{1,0} custom-call(bf16[64,64] %a), custom_call_target="__cublas$lt$matmul"',
            "%e = f32[8,8]{1,0} dot(f8e4m3fn[8,8]{1,0} %p, f8e5m2[8,8]{1,0} %q)",
        ]
    )
    assert doctor.count_fp8_gemms(hlo) == 1
    assert doctor.count_fp8_dots(hlo) == 1


def test_count_fp8_gemms_includes_fp8_dots_in_xla_triton_gemm_fusions():
    # Shapes of the H200 HLO where XLA's autotuner gave an FP8 dot to its Triton GEMM emitter:
    # two call sites share one deduplicated f8 computation; a bf16 gemm fusion does not count.
    hlo = "\n".join(
        [
            "%gemm_fusion_dot.1_computation (p0: f8e4m3fn[4096,12288], p1: f8e4m3fn[12288,3072], "
            "p2: f32[]) -> bf16[4096,3072] {",
            "%gemm_fusion_dot.2_computation (p0: bf16[4,3072], p1: bf16[3072,3072]) -> bf16[4,3072] {",
            "  %gemm_fusion_dot.1 = bf16[4096,3072]{1,0} fusion(%a, %b, %s), kind=kCustom, "
            "calls=%gemm_fusion_dot.1_computation, metadata={}",
            "  %gemm_fusion_dot.7 = bf16[4096,3072]{1,0} fusion(%c, %d, %t), kind=kCustom, "
            "calls=%gemm_fusion_dot.1_computation, metadata={}",
            "  %gemm_fusion_dot.2 = bf16[4,3072]{1,0} fusion(%e, %f), kind=kCustom, "
            "calls=%gemm_fusion_dot.2_computation, metadata={}",
        ]
    )
    assert doctor.count_fp8_triton_gemms(hlo) == 2
    assert doctor.count_fp8_gemms(hlo) == 2
    assert doctor.count_triton_gemms(hlo) == 3


def test_report_on_this_machine():
    r = doctor.report()
    assert r["platform"] == jax.devices()[0].platform or r["platform"] in ("cuda", "rocm")
    assert r["e4m3_dtype"].startswith("float8_e4m3")
    # The maxima of the dtypes chosen for this platform: 240 for gfx942's fnuz E4M3, 448 for OCP.
    assert r["e4m3_max"] == (240.0 if r["format_family"] == "fnuz" else 448.0)
    assert r["e5m2_max"] == 57344.0
    assert r["attention_auto"] in ("xla", "cudnn", "pallas")
    assert r["fp8_cast_kernel_auto"] in ("xla", "triton")
    if jax.default_backend() == "cpu":
        assert r["fp8_gemms_compiled"] is False
        assert r["triton_cast_check"] == "the platform is 'cpu', not a GPU"
        assert doctor.verdict(r).startswith("FP8 training: emulated on CPU")


@pytest.mark.skipif(not ON_GPU, reason="FP8 GEMM custom calls only exist on a GPU backend")
def test_gpu_compiles_fp8_gemms():
    assert doctor.report()["fp8_gemm_custom_calls"] == 3


def _report(**overrides):
    base = {
        "jax": "0.0",
        "platform": "cuda",
        "device_kind": "NVIDIA H100 80GB HBM3",
        "compute_capability": "9.0",
        "format_family": "ocp",
        "e4m3_dtype": "float8_e4m3fn",
        "e5m2_dtype": "float8_e5m2",
        "fp8_gemm_supported": True,
        "fp8_gemm_custom_calls": 3,
        "fp8_gemms_compiled": True,
    }
    return base | overrides


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ({}, "FP8 training: ready (3 FP8 GEMMs"),
        ({"platform": "cpu", "fp8_gemms_compiled": False}, "FP8 training: emulated on CPU"),
        (
            {"device_kind": "NVIDIA A100", "compute_capability": "8.0", "fp8_gemm_supported": False},
            "FP8 training: not available: NVIDIA A100 (compute capability 8.0) has no FP8 GEMMs",
        ),
        (
            {"fp8_gemm_custom_calls": 0, "fp8_gemms_compiled": False},
            "FP8 training: not available: NVIDIA H100 80GB HBM3 has FP8 GEMMs but XLA",
        ),
    ],
)
def test_verdict_says_ready_emulated_or_why_not(overrides, expected):
    line = doctor.verdict(_report(**overrides))
    assert line.startswith(expected)
    if "not available" in expected:
        assert "--config.fp8=None" in line
