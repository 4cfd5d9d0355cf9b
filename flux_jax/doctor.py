"""``python -m flux_jax.doctor``: what FP8 this machine would use, and whether XLA emits FP8 GEMMs.

XLA falls back silently to a 16-bit dot when it cannot rewrite an FP8 dot, so the only reliable
check is the compiled HLO. The last line is the verdict: "FP8 training: ready", "emulated" (CPU)
or "not available" with the reason and what to do.
"""

import argparse
import re

import jax
import jax.numpy as jnp

from flux_jax import choices, cli, fp8, fp8_cast
from flux_jax.fp8_dot import Fp8DotGeneral, Fp8Spec

# Custom-call targets of FP8 GEMMs: cuBLASLt on CUDA, hipBLASLt on ROCm (same target name there).
FP8_GEMM_TARGETS = ("__cublas$lt$matmul$f8", "__hipblaslt$matmul$f8")


def count_fp8_gemms(hlo_text: str) -> int:
    """FP8 GEMMs in compiled HLO text: cuBLASLt / hipBLASLt FP8 custom calls plus the FP8 dots
    XLA's autotuner gave to its own Triton GEMM emitter (``gemm_fusion`` with f8 operands)."""
    custom = sum(
        1
        for line in hlo_text.splitlines()
        if "custom-call" in line and any(t in line for t in FP8_GEMM_TARGETS)
    )
    return custom + count_fp8_triton_gemms(hlo_text)


def count_triton_gemms(hlo_text: str, fp8_only: bool = False) -> int:
    """Call sites of XLA's Triton GEMM fusions (``gemm_fusion``); with ``fp8_only``, only those
    whose computation takes f8 operands."""
    computations = set()
    for line in hlo_text.splitlines():
        head = re.match(r"%(\S*gemm_fusion\S*) \((.*)\) -> ", line)
        if head and (not fp8_only or re.search(r": f8e\w+\[", head.group(2))):
            computations.add(head.group(1))
    return sum(
        1
        for line in hlo_text.splitlines()
        if "kind=kCustom" in line
        and (m := re.search(r"calls=%([^,\s]+)", line))
        and m.group(1) in computations
    )


def count_fp8_triton_gemms(hlo_text: str) -> int:
    """Call sites of Triton GEMM fusions whose computation takes f8 operands."""
    return count_triton_gemms(hlo_text, fp8_only=True)


def count_fp8_dots(hlo_text: str) -> int:
    """Plain HLO dots that still take f8 operands (what a backend without FP8 GEMMs may keep)."""
    return sum(1 for line in hlo_text.splitlines() if " dot(" in line and "f8e" in line.split("dot(")[1])


def probe_fp8_gemm(spec: Fp8Spec, m: int = 6144, k: int = 3072, n: int = 9216) -> dict:
    """Compile a forward+backward FP8 dense and report the FP8 GEMMs in its HLO.

    On the H200 image's XLA, 64^3 gave no FP8 custom call and 1024^3 only the forward one, while
    6144x3072x9216 (a Flux qkv GEMM) gave all three, so the probe uses that shape.
    """
    module = Fp8DotGeneral(spec=spec)
    x = jnp.ones((m, k), jnp.bfloat16)
    w = jnp.ones((k, n), jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    meta = module.init(jax.random.PRNGKey(0), x, w, dims)

    def fwd_bwd(x, w, meta):
        def f(x, w, meta):
            return module.apply(meta, x, w, dims)

        y, vjp = jax.vjp(f, x, w, meta)
        return y, vjp(jnp.ones_like(y))

    text = jax.jit(fwd_bwd).lower(x, w, meta).compile().as_text()
    return {"fp8_gemm_custom_calls": count_fp8_gemms(text), "fp8_hlo_dots": count_fp8_dots(text)}


def report() -> dict:
    desc = fp8.describe_device()
    family = fp8.format_family(desc)
    fwd, bwd = fp8.fp8_dtypes("hybrid", family)
    out = {
        "jax": jax.__version__,
        "platform": desc.platform,
        "device_kind": desc.device_kind,
        "compute_capability": desc.compute_capability,
        "device_count": jax.device_count(),
        "format_family": family,
        "e4m3_dtype": jnp.dtype(fwd).name,
        "e4m3_max": float(jnp.finfo(fwd).max),
        "e5m2_dtype": jnp.dtype(bwd).name,
        "e5m2_max": float(jnp.finfo(bwd).max),
        # What "auto" becomes here (flux_jax.choices) for a bf16 model with 128-wide heads (FLUX).
        "attention_auto": choices.auto_attention(desc, 128, "bfloat16"),
        "fp8_cast_kernel_auto": fp8.resolve_cast_kernel("auto", desc),
        # The device check ROCm's "auto" makes before it takes the Triton cast (run here on any GPU).
        "triton_cast_check": fp8_cast.triton_cast_error(fp8.cast_dtypes(desc)) or "bit-equal to the XLA cast",
        "fp8_gemm_supported": fp8.supports_fp8_gemm(desc),
        "block_scaled_gemm_supported": fp8.supports_block_scaled_gemm(desc),
    }
    out.update(probe_fp8_gemm(Fp8Spec(fwd_dtype=fwd, bwd_dtype=bwd)))
    out["fp8_gemms_compiled"] = out["fp8_gemm_custom_calls"] > 0
    return out


def verdict(r: dict) -> str:
    """One line from a report(): can this machine train in FP8 at FP8 speed, and if not, why."""
    dtypes = f"{r['e4m3_dtype']} / {r['e5m2_dtype']}"
    if r["platform"] == "cpu":
        return (
            f"FP8 training: emulated on CPU ({dtypes}; right for tests, no FP8 GEMMs and no speedup). "
            "FP8 speed needs an NVIDIA Hopper/Blackwell or AMD MI300X/MI325X/MI355X GPU."
        )
    if not r["fp8_gemm_supported"]:
        return (
            f"FP8 training: not available: {r['device_kind']} (compute capability "
            f"{r['compute_capability']}) has no FP8 GEMMs (needs CUDA compute capability >= 8.9 or ROCm "
            "gfx942/gfx950). Train in BF16 (--config.fp8=None)."
        )
    if not r["fp8_gemms_compiled"]:
        return (
            f"FP8 training: not available: {r['device_kind']} has FP8 GEMMs but XLA (jax {r['jax']}) "
            "compiled none for the probe, so FP8 would run as slow 16-bit dots. Update jax/jaxlib and "
            "the CUDA or ROCm plugin; train in BF16 (--config.fp8=None) until then."
        )
    return (
        f"FP8 training: ready ({r['fp8_gemm_custom_calls']} FP8 GEMMs compiled for the probe's "
        f"forward and backward; {dtypes}; format family {r['format_family']})."
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m flux_jax.doctor",
        description="Prints the platform, the FP8 dtypes this machine would use and whether XLA compiles "
        "real FP8 GEMMs here (it compiles a forward+backward FP8 dense of 6144x3072x9216), then a "
        "verdict line. Takes no options besides --help.",
    )
    parser.parse_args(argv)
    r = report()
    for key, value in r.items():
        print(f"{key:28s} {value}")
    print(verdict(r))


if __name__ == "__main__":
    cli.run(main)
