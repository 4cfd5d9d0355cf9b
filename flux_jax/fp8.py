"""FP8 formats, platform detection, config validation and the per-site dot_general policy.

The dot itself (scaling math, custom VJP, state module) is in ``flux_jax.fp8_dot``.

Policy choice: only transformer blocks run FP8. The embedders (img_in, txt_in, time_in,
vector_in, guidance_in) and final_layer stay BF16: they are a tiny share of the FLOPs, their
K or N is small (64, 256, 768) so an FP8 GEMM gains nothing, and they sit at the model's
numerically sensitive boundary, as in Primus / Transformer Engine recipes.
"""

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flux_jax import distributed
from flux_jax.errors import UserError, block
from flux_jax.fp8_cast import CAST_KERNELS, triton_available, triton_cast_error
from flux_jax.fp8_dot import (
    AMAX_ALGOS,
    FP8_COLLECTION,
    FP8_WEIGHTS,
    RECIPES,
    Fp8DotGeneral,
    Fp8Spec,
    as_max_grad,
    cast_kernels,
    from_max_grad,
)

__all__ = [
    "FP8_COLLECTION",
    "FP8_WEIGHTS",
    "cast_kernels",
    "Fp8DotGeneral",
    "Fp8Spec",
    "DeviceDescription",
    "as_max_grad",
    "from_max_grad",
    "describe_device",
    "format_family",
    "fp8_dtypes",
    "supports_fp8_gemm",
    "supports_block_scaled_gemm",
    "spec_from_config",
    "make_policy",
    "validate_config",
    "config_problems",
    "validate_fp8_attention",
    "attention_spec",
    "merge_states",
    "summarize",
]

FORMATS = ("e4m3", "hybrid")
# The recipes a config may ask for: fp8_dot also knows "blockwise", which runs the MX code path under
# another name until the 1x128 / 128x128 recipe exists, so config_problems rejects it.
SUPPORTED_RECIPES = tuple(r for r in RECIPES if r != "blockwise")
FAMILIES = ("auto", "ocp", "fnuz")
_DTYPES = {
    "ocp": (jnp.float8_e4m3fn, jnp.float8_e5m2),
    "fnuz": (jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz),
}


@dataclasses.dataclass(frozen=True)
class DeviceDescription:
    """What FP8 decisions depend on: ``platform`` ("cpu"|"gpu"|"cuda"|"rocm"|...), strings from
    the device (``device_kind``, ``compute_capability``: "9.0" on CUDA, "gfx942" on ROCm)."""

    platform: str
    device_kind: str = ""
    compute_capability: str = ""


def describe_device(device=None) -> DeviceDescription:
    device = device or jax.devices()[0]
    platform = device.platform
    client = getattr(device, "client", None)
    version = str(getattr(client, "platform_version", "")).lower()
    if platform == "gpu":
        platform = "rocm" if ("rocm" in version or "hip" in version) else "cuda"
    return DeviceDescription(
        platform=platform,
        device_kind=str(getattr(device, "device_kind", "")),
        compute_capability=str(getattr(device, "compute_capability", "") or ""),
    )


def _gfx(desc: DeviceDescription) -> str | None:
    m = re.search(r"gfx[0-9a-f]+", f"{desc.compute_capability} {desc.device_kind}".lower())
    return m.group(0) if m else None


def _cuda_cc(desc: DeviceDescription) -> tuple[int, int] | None:
    m = re.match(r"\s*(\d+)\.(\d+)", desc.compute_capability)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _is_rocm(desc: DeviceDescription) -> bool:
    return desc.platform in ("rocm", "hip") or _gfx(desc) is not None


def format_family(desc: DeviceDescription, requested: str = "auto") -> str:
    """ "fnuz" on gfx94x (MI300X/MI325X), "ocp" elsewhere (gfx950, gfx12, NVIDIA, CPU)."""
    if requested != "auto":
        return requested
    gfx = _gfx(desc)
    return "fnuz" if gfx is not None and gfx.startswith("gfx94") else "ocp"


def fp8_dtypes(fmt: str, family: str) -> tuple[Any, Any]:
    """(forward dtype, gradient dtype) for a format ("e4m3"|"hybrid") and family."""
    e4m3, e5m2 = _DTYPES[family]
    return (e4m3, e5m2) if fmt == "hybrid" else (e4m3, e4m3)


def supports_fp8_gemm(desc: DeviceDescription) -> bool:
    """Whether XLA has an FP8 GEMM for this device. CPU runs FP8 dots emulated (tests, CI)."""
    if desc.platform == "cpu":
        return True
    if _is_rocm(desc):
        gfx = _gfx(desc) or ""
        return gfx.startswith(("gfx94", "gfx95", "gfx12"))
    cc = _cuda_cc(desc)
    return cc is not None and cc >= (8, 9)


def supports_block_scaled_gemm(desc: DeviceDescription) -> bool:
    if _is_rocm(desc):
        return (_gfx(desc) or "").startswith("gfx950")
    cc = _cuda_cc(desc)
    return desc.platform not in ("cpu",) and cc is not None and cc >= (10, 0)


def _get(config, name, default=None):
    return config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)


def validate_config(config, desc: DeviceDescription | None = None) -> None:
    """Raises one UserError naming every bad FP8 field and its fix; no-op when config.fp8 is None."""
    problems = config_problems(config, desc)
    if problems:
        raise UserError(block("Invalid FP8 config", problems))


def config_problems(config, desc: DeviceDescription | None = None) -> list[str]:
    """One line per bad FP8 field (the value, what is allowed, the fix); with config.fp8 None only
    fp8_dot_product_attention is checked."""
    fmt = _get(config, "fp8")
    try:
        validate_fp8_attention(config, desc)
        attention = []
    except ValueError as err:
        attention = [str(err)]
    if fmt is None:
        return attention
    bad = attention
    if fmt not in FORMATS:
        bad.append(f"config.fp8={fmt!r} is not a format; use one of {FORMATS} or None for BF16")
    recipe = _get(config, "fp8_recipe", "delayed")
    if recipe == "blockwise":
        bad.append(
            "config.fp8_recipe='blockwise' is not implemented yet (the 1x128 / 128x128 block-scaled "
            "recipe); use 'mxfp8' where the hardware has block-scaled GEMMs, else 'delayed', "
            "'tensorwise' or 'rowwise'"
        )
    elif recipe not in RECIPES:
        bad.append(f"config.fp8_recipe={recipe!r} must be one of {SUPPORTED_RECIPES}")
    family = _get(config, "fp8_format_family", "auto")
    if family not in FAMILIES:
        bad.append(f"config.fp8_format_family={family!r} is unknown; use one of {FAMILIES}")
    hist = _get(config, "fp8_amax_history_len", 1024)
    if not isinstance(hist, int) or hist < 1:
        bad.append(f"config.fp8_amax_history_len={hist!r} must be an integer >= 1 (e.g. 1024)")
    margin = _get(config, "fp8_margin", 0)
    if margin is None or margin < 0:
        bad.append(f"config.fp8_margin={margin!r} must be >= 0 (0 is the usual value)")
    algo = _get(config, "fp8_amax_compute_algo", "max")
    if algo not in AMAX_ALGOS:
        bad.append(f"config.fp8_amax_compute_algo={algo!r} is unknown; use one of {AMAX_ALGOS}")
    kernel = _get(config, "fp8_cast_kernel", "xla")
    if kernel not in ("auto", *CAST_KERNELS):
        bad.append(f"config.fp8_cast_kernel={kernel!r} is unknown; use 'auto' or one of {CAST_KERNELS}")
    desc = desc or describe_device()
    if kernel == "triton" and (reason := triton_available(_gpu_platform(desc))):
        bad.append(f"config.fp8_cast_kernel='triton' cannot run here: {reason}; use 'xla' or 'auto'")
    elif fmt in FORMATS and kernel == "triton" and _is_rocm(desc) and jax.default_backend() != "cpu":
        if reason := triton_cast_check(desc, _get(config, "fp8_format_family", "auto")):
            bad.append(
                f"config.fp8_cast_kernel='triton': on this GPU the Triton FP8 cast does not match the XLA "
                f"cast ({reason}); use 'auto' or 'xla'"
            )
    if fmt in FORMATS and not supports_fp8_gemm(desc):
        bad.append(
            f"config.fp8={fmt!r} but this device ({desc.platform} {desc.device_kind!r}, compute "
            f"capability {desc.compute_capability!r}) has no FP8 GEMMs (needs CUDA cc >= 8.9 or "
            "ROCm gfx942/gfx950); set config.fp8=None to train in BF16"
        )
    if recipe == "mxfp8" and not supports_block_scaled_gemm(desc):
        bad.append(
            f"config.fp8_recipe={recipe!r} needs block-scaled GEMMs (NVIDIA Blackwell or AMD "
            f"gfx950); this device is {desc.platform} {desc.device_kind!r}. Use "
            "fp8_recipe='delayed', 'tensorwise' or 'rowwise'"
        )
    return bad


def validate_fp8_attention(config, desc: DeviceDescription | None = None) -> None:
    """``fp8_dot_product_attention`` needs FP8 on, cuDNN attention and an NVIDIA Hopper (or newer) GPU,
    and even there is refused: measured slower than BF16 and with wrong gradients (the message says
    by how much). ``flux_jax.fp8_attention`` stays, reachable from code, for the next attempt."""
    if not _get(config, "fp8_dot_product_attention", False):
        return
    field = "config.fp8_dot_product_attention=True"
    if _get(config, "fp8") is None:
        raise ValueError(
            f"{field} runs attention in FP8 inside the FP8 blocks; set config.fp8 too, or set it False."
        )
    model = _get(config, "model")
    if model is not None and _get(model, "attention") != "cudnn":
        raise ValueError(
            f"{field} is cuDNN's FP8 attention; set config.model.attention='cudnn' (NVIDIA GPUs)."
        )
    desc = desc or describe_device()
    cc = _cuda_cc(desc)
    if desc.platform != "cuda" or cc is None or cc < (9, 0):
        raise ValueError(
            f"{field} needs cuDNN's FP8 flash attention, on NVIDIA Hopper or newer (compute capability "
            f">= 9.0); this device is {desc.platform} {desc.device_kind!r} (compute capability "
            f"{desc.compute_capability!r}). Set config.fp8_dot_product_attention=False."
        )
    raise ValueError(
        f"{field}: cuDNN's FP8 attention, as jax 0.11.2 reaches it (flux_jax.fp8_attention), is not usable "
        "for training: on an H100 at the block shape it took 1.59 ms forward + backward against BF16 "
        "cuDNN's 1.33 ms, and its dq / dk / dv differed from BF16 attention's by 74% / 99% / 700% "
        "(relative norm; the forward by 5.9%) (benchmarks/RESULTS.md, eleventh run). "
        "Set config.fp8_dot_product_attention=False: attention stays BF16."
    )


def attention_spec(config, desc: DeviceDescription | None = None) -> Fp8Spec | None:
    """The FP8 attention's spec when ``config.fp8_dot_product_attention`` is set, else None."""
    if _get(config, "fp8") is None or not _get(config, "fp8_dot_product_attention", False):
        return None
    validate_fp8_attention(config, desc)
    return spec_from_config(config, desc)


def spec_from_config(config, desc: DeviceDescription | None = None) -> Fp8Spec:
    desc = desc or describe_device()
    family = format_family(desc, _get(config, "fp8_format_family", "auto"))
    fwd, bwd = fp8_dtypes(_get(config, "fp8"), family)
    return Fp8Spec(
        fwd_dtype=fwd,
        bwd_dtype=bwd,
        recipe=_get(config, "fp8_recipe", "delayed"),
        amax_history_len=int(_get(config, "fp8_amax_history_len", 1024)),
        amax_compute_algo=_get(config, "fp8_amax_compute_algo", "max"),
        margin=float(_get(config, "fp8_margin", 0)),
        wgrad=bool(_get(config, "fp8_wgrad", True)),
        cast_kernel=resolve_cast_kernel(_get(config, "fp8_cast_kernel", "xla"), desc, family),
    )


def _gpu_platform(desc: DeviceDescription) -> str:
    """ "cuda" / "rocm" for GPUs (whatever the backend calls them), else the platform."""
    return "rocm" if _is_rocm(desc) else desc.platform


def resolve_cast_kernel(
    kernel: str, desc: DeviceDescription | None = None, family: str = "auto", probe: bool = True
) -> str:
    """'auto' -> 'triton' on an NVIDIA GPU with jax-triton installed (on meshes too: the cast runs per
    shard); on a ROCm GPU the same once the Triton cast has matched the XLA cast bit for bit on this
    device in ``family``'s FP8 dtypes (``fp8_cast.triton_cast_error``), else 'xla' with a warning naming
    why; 'xla' elsewhere. ``probe=False`` (a run without FP8) takes 'xla' on ROCm without the check."""
    if kernel != "auto":
        return kernel
    desc = desc or describe_device()
    platform = _gpu_platform(desc)
    if platform not in ("cuda", "rocm") or triton_available(platform) is not None:
        return "xla"
    if platform == "cuda":
        return "triton"
    if not probe or jax.default_backend() == "cpu":  # a ROCm description on a CPU (tests): nothing to probe
        return "xla"
    if error := triton_cast_check(desc, family):
        warnings.warn(
            f"fp8_cast_kernel=auto: the Triton FP8 cast does not match the XLA cast on this GPU ({error}); "
            "using the XLA cast. --config.fp8_cast_kernel=xla silences this.",
            stacklevel=2,
        )
        return "xla"
    return "triton"


def triton_cast_check(desc: DeviceDescription, family: str = "auto") -> str | None:
    """The Triton cast's device check (``fp8_cast.triton_cast_error``) in the run's FP8 dtypes, one
    outcome on every process (every process must call it)."""
    return distributed.first_error(triton_cast_error(cast_dtypes(desc, family)), "triton_cast_check")


def cast_dtypes(desc: DeviceDescription, family: str = "auto") -> tuple[str, ...]:
    """The names of the FP8 dtypes a run casts to on ``desc`` (both formats of the family)."""
    return tuple(jnp.dtype(d).name for d in _DTYPES[format_family(desc, family)])


def block_sites(flux_params) -> list[str]:
    """Block site names in execution order: double blocks, then single blocks."""
    return [f"double_blocks.{i}" for i in range(flux_params.depth)] + [
        f"single_blocks.{i}" for i in range(flux_params.depth_single_blocks)
    ]


def make_policy(
    config, flux_params, desc: DeviceDescription | None = None
) -> Callable[[str], Callable[[], Any] | None] | None:
    """site -> zero-arg Fp8DotGeneral factory, or None for plain BF16; None when config.fp8 is None.

    Sites are ``"double_blocks.{i}"`` / ``"single_blocks.{i}"`` (the token GEMMs of a block), the
    same with ``".modulation"`` (the block's per-sample modulation GEMM) and the embedders and
    final layer (``"img_in"``, ``"final_layer"``, ...), which stay BF16.

    Every block site (and, with ``fp8_modulation``, every modulation site) holds FP8 state; the
    blocks ``first_last_layers_bf16`` keeps in BF16 get a dot that holds it unused
    (``Fp8DotGeneral(enabled=False)``). So the ``fp8_meta`` tree depends on the architecture and on
    ``fp8_modulation`` (which GEMMs of a block can run FP8), never on which layers run BF16.
    """
    if _get(config, "fp8") is None:
        return None
    desc = desc or describe_device()
    validate_config(config, desc)
    spec = spec_from_config(config, desc)
    sites = block_sites(flux_params)
    bf16 = set()
    if _get(config, "first_last_layers_bf16", False):
        start = int(_get(config, "num_layers_at_start_in_bf16", 0) or 0)
        end = int(_get(config, "num_layers_at_end_in_bf16", 0) or 0)
        bf16 = set(sites[:start]) | set(sites[len(sites) - end :] if end else [])
    state_sites = frozenset(sites)
    if _get(config, "fp8_modulation", False):
        # The per-sample modulation GEMMs (M = batch) follow their block when asked for.
        state_sites |= frozenset(f"{s}.modulation" for s in sites)
    fp8_sites = frozenset(s for s in state_sites if s.removesuffix(".modulation") not in bf16)
    factory = functools.partial(Fp8DotGeneral, spec=spec)
    held = functools.partial(Fp8DotGeneral, spec=spec, enabled=False)

    def policy(site: str):
        return factory if site in fp8_sites else held if site in state_sites else None

    return policy


def merge_states(a, b):
    """Elementwise max of two fp8_meta trees (amax from several microbatches combines by max)."""
    return jax.tree.map(jnp.maximum, a, b)


def _operand_states(tree):
    """(scale, amax history) of every operand in an fp8_meta tree, as numpy arrays."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _operand_states(value)
        elif str(key).endswith("_scale"):
            yield np.asarray(value), np.asarray(tree[f"{str(key).removesuffix('_scale')}_amax_history"])


def summarize(fp8_meta: Mapping) -> dict[str, float]:
    """Scalars for logging: smallest/largest scale of the dots that recorded an amax, largest amax.

    A held BF16 layer's entries (``first_last_layers_bf16``) keep their initial scale and an all-zero
    history and stay out of the scales; scanned entries (a leading layer axis) are filtered per layer."""
    states = list(_operand_states(fp8_meta))
    scales = [s[np.max(h, axis=-1) > 0] for s, h in states]
    scales = [s for s in scales if s.size]
    if not scales:
        return {}
    return {
        "scale_min": float(min(np.min(s) for s in scales)),
        "scale_max": float(max(np.max(s) for s in scales)),
        "amax_max": float(max(np.max(h) for _, h in states)),
    }
