"""Platform-bound config choices: ``"auto"`` resolved against the device at start-up, explicit ones checked.

``model.attention``: "cudnn" on NVIDIA (16-bit compute, a head dim cuDNN takes); on ROCm
``ROCM_ATTENTION``, the fastest portable choice measured (benchmarks/RESULTS.md), if it compiles there;
"xla" elsewhere.
``fp8_cast_kernel``: "triton" (the jax-triton cast) on NVIDIA with jax-triton installed; on ROCm the same
once it has matched the XLA cast bit for bit on the device at start-up (``fp8_cast.triton_cast_error``),
else "xla" with a warning; "xla" elsewhere. ``fp8_format_family``: "fnuz" on gfx94x
(MI300X/MI325X), "ocp" elsewhere. ``resolve`` writes the resolved values into the config, so they are
what the run logs and saves in config.json.
"""

import functools
import warnings

import jax
import jax.numpy as jnp

from flux_jax import distributed, fp8
from flux_jax.math import IMPLEMENTATIONS, flash_attention

ATTENTION_CHOICES = ("auto", *IMPLEMENTATIONS)
# ROCm takes JAX's Pallas (Triton) flash attention: forward + backward 2.3x faster than XLA's attention at
# the block shape and 2.2x at 1024 px on an H100 (benchmarks/attention.py; benchmarks/RESULTS.md, "Attention
# kernels"). It has not run on an AMD GPU, so ``attention_for`` compiles it once on the device first and falls
# back to XLA, with a warning naming the error, if that fails.
ROCM_ATTENTION = "pallas"
GPU_PLATFORMS = ("cuda", "rocm")


def cudnn_takes(head_dim: int, dtype: str) -> bool:
    """Whether cuDNN's fused attention runs this model: 16-bit compute, head dim a multiple of 8 up to 256."""
    return dtype in ("bfloat16", "float16") and head_dim % 8 == 0 and head_dim <= 256


def auto_attention(desc: fp8.DeviceDescription, head_dim: int, dtype: str) -> str:
    if desc.platform == "cuda" and cudnn_takes(head_dim, dtype):
        return "cudnn"
    if desc.platform == "rocm":
        return ROCM_ATTENTION
    return "xla"


def attention_error(choice: str, desc: fp8.DeviceDescription) -> str | None:
    """Why an explicit ``model.attention`` cannot run on this platform, or None."""
    if choice == "cudnn" and desc.platform != "cuda":
        return (
            "model.attention='cudnn' needs an NVIDIA GPU with cuDNN, and this platform is "
            f"{desc.platform!r}: use --config.model.attention=auto (or xla)"
        )
    if choice == "pallas" and desc.platform not in GPU_PLATFORMS:
        return (
            f"model.attention='pallas' (JAX's Pallas flash attention) needs an NVIDIA or AMD GPU, and this "
            f"platform is {desc.platform!r}: use --config.model.attention=auto (or xla)"
        )
    return None


@functools.cache
def pallas_error() -> str | None:
    """Why JAX's Pallas flash attention does not compile and run on this device (forward and backward of a
    tiny problem), or None. Only asked on a GPU, where ``auto`` would pick it without having run there."""
    try:
        q = jnp.ones((1, 32, 1, 16), jnp.bfloat16)
        jax.block_until_ready(jax.grad(lambda q: flash_attention(q, q, q).astype(jnp.float32).sum())(q))
    except Exception as e:  # noqa: BLE001 - any failure means: do not pick it automatically
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def attention_for(config, flux_params, desc: fp8.DeviceDescription | None = None) -> str:
    """``config.model.attention``, with ``"auto"`` resolved on ``desc`` (this device by default).

    On a GPU, an ``auto`` that lands on the Pallas attention (ROCm, where it has not run) is compiled
    once on the device first (``pallas_error``); if it does not run, XLA attention, with a warning."""
    if config.model.attention != "auto":
        return config.model.attention
    head_dim = flux_params.hidden_size // flux_params.num_heads
    choice = auto_attention(desc or fp8.describe_device(), head_dim, config.model.dtype)
    if (
        choice == "pallas"
        and jax.default_backend() != "cpu"
        and (error := distributed.first_error(pallas_error(), "pallas_check"))
    ):
        warnings.warn(
            f"model.attention=auto: the Pallas flash attention does not run on this GPU ({error}); "
            "using XLA attention instead. --config.model.attention=pallas makes this an error.",
            stacklevel=2,
        )
        return "xla"
    return choice


def resolve(config, flux_params, desc: fp8.DeviceDescription | None = None) -> dict[str, str]:
    """Replaces each ``"auto"`` platform choice of ``config`` by its value on ``desc`` (this device by
    default); returns the resolved values {dotted field: value}."""
    desc = desc or fp8.describe_device()
    config.model.attention = attention_for(config, flux_params, desc)
    if config.get("fp8_format_family", "auto") == "auto":
        config.fp8_format_family = fp8.format_family(desc)
    if config.get("fp8_cast_kernel", "xla") == "auto":
        family, probe = config.get("fp8_format_family", "auto"), config.get("fp8") is not None
        config.fp8_cast_kernel = fp8.resolve_cast_kernel("auto", desc, family, probe=probe)
    return {
        "model.attention": config.model.attention,
        "fp8_cast_kernel": config.get("fp8_cast_kernel", "xla"),
        "fp8_format_family": config.get("fp8_format_family", "auto"),
    }
