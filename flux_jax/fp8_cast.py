"""FP8 casts for the GEMM operands: amax + quantize (+ the transposed copy) of a 2-D tensor.

An FP8 GEMM on Hopper and MI300 takes both operands with the contracted axis minor, so the
backward pass needs a second, transposed FP8 copy of the input and of the output gradient. Two
implementations with one contract, ``cast(x, dtype, scale, transpose, via) -> (q, q_t, amax)``:

- ``"xla"``: plain jnp; XLA fuses what it can. Runs everywhere (CPU tests, CUDA, ROCm).
- ``"triton"``: one jax-triton kernel that reads ``x`` once and writes ``q``, ``q.T`` and
  per-tile amaxes (NVIDIA GPUs; needs the ``gpu`` extra). Bit-identical to ``"xla"``. On a mesh of
  several devices it runs under ``shard_map`` on each device's rows, the amax reduced by max across
  them, so sharded runs keep it (``shard_rows``).

Scale convention as in ``fp8_dot``: ``q = clip(x / scale, -max, max)``. ``via`` (optional) is a
16-bit dtype ``x`` is rounded to first: a float32 master kernel is cast as the bf16 copy of it would
be, bit for bit, without that copy being written and read.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

CAST_KERNELS = ("xla", "triton")


def fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def amax_of(x) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def quantize(x, dtype, scale):
    m = fp8_max(dtype)
    scaled = x.astype(jnp.float32) / scale
    return jnp.clip(scaled, -m, m).astype(dtype)


def round_to(x, dtype):
    """``x`` rounded to ``dtype``'s values (to nearest even; its subnormals and overflow included), kept in
    x's dtype.

    ``x.astype(dtype).astype(x.dtype)`` does not survive XLA's excess-precision simplification (on by
    default on GPUs), which drops such convert pairs; ``reduce_precision`` does, but it flushes the
    subnormals of a narrower exponent range to zero, so those are rounded to dtype's subnormal step here.
    """
    info = jnp.finfo(dtype)
    out = lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    if info.nexp < jnp.finfo(x.dtype).nexp:
        step = float(info.smallest_subnormal)
        out = jnp.where(jnp.abs(x) < float(info.smallest_normal), jnp.round(x / step) * step, out)
    return out


def lead_to_end(x, n: int):
    """``x`` with its leading ``n`` axes moved to the end: ``x.T`` of a matrix, (K, P, D) -> (P, D, K)
    for n = 1, (P, D, N) -> (N, P, D) for n = 2."""
    n = int(n)
    return jnp.transpose(x, (*range(n, x.ndim), *range(n)))


def cast_xla(x, dtype, scale, transpose: int, via=None):
    if via is not None:
        x = round_to(x, via)
    q = quantize(x, dtype, scale)
    return q, (lead_to_end(q, transpose) if transpose else None), amax_of(x)


def triton_available(platform: str | None = None) -> str | None:
    """None when the triton cast can run on ``platform`` ("cuda", "rocm", "cpu", ...; default: this
    machine's backend), else the reason it cannot. ROCm is allowed (Triton targets AMD GPUs too)."""
    if platform is None:
        platform = jax.default_backend()
    if platform not in ("gpu", "cuda", "rocm"):
        return f"the platform is {platform!r}, not a GPU"
    try:
        import jax_triton  # noqa: F401
    except ImportError:
        return "jax-triton is not installed (pip install 'flux_jax[gpu]')"
    return None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cast_transpose_amax(
        x_ptr,
        scale_ptr,
        q_ptr,
        qt_ptr,
        amax_ptr,
        M: tl.constexpr,
        K: tl.constexpr,
        fmax: tl.constexpr,
        transpose: tl.constexpr,
        round_bf16: tl.constexpr,
        block_m: tl.constexpr,
        block_k: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = pid_m * block_m + tl.arange(0, block_m)
        rk = pid_k * block_k + tl.arange(0, block_k)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mask, other=0.0)
        if round_bf16:
            x = x.to(tl.bfloat16)
        x = x.to(tl.float32)
        a = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        # tl.max drops NaN; a NaN anywhere makes the tile amax inf, so the scale update skips it.
        nan = tl.sum(tl.sum((x != x).to(tl.int32), axis=1), axis=0)
        a = tl.where(nan > 0, float("inf"), a)
        tl.store(amax_ptr + pid_m * tl.num_programs(1) + pid_k, a)
        scale = tl.load(scale_ptr)
        q = tl.clamp(x / scale, -fmax, fmax).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)
        if transpose:
            tl.store(qt_ptr + rk[:, None] * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))

    return cast_transpose_amax


def cast_triton(
    x, dtype, scale, transpose: bool, via=None, block_m: int = 64, block_k: int = 128, num_warps: int = 4
):
    import jax_triton as jt

    # float32 -> bf16 rounding happens in the kernel; any other 16-bit ``via`` is converted first.
    round_bf16 = via is not None and x.dtype == jnp.float32 and jnp.dtype(via) == jnp.bfloat16
    if via is not None and not round_bf16:
        x = x.astype(via)
    m, k = x.shape
    grid = (-(-m // block_m), -(-k // block_k))
    out_shape = [
        jax.ShapeDtypeStruct((m, k), dtype),
        jax.ShapeDtypeStruct((k, m) if transpose else (1, 1), dtype),
        jax.ShapeDtypeStruct((grid[0] * grid[1],), jnp.float32),
    ]
    q, q_t, tile_amax = jt.triton_call(
        x,
        jnp.reshape(scale, (1,)).astype(jnp.float32),
        kernel=_kernel(),
        out_shape=out_shape,
        grid=grid,
        num_warps=num_warps,
        M=m,
        K=k,
        fmax=fp8_max(dtype),
        transpose=transpose,
        round_bf16=round_bf16,
        block_m=block_m,
        block_k=block_k,
    )
    return q, (q_t if transpose else None), jnp.max(tile_amax)


def _probe_input(rows: int = 96, cols: int = 200) -> np.ndarray:
    """float32 values over 30 binary orders of magnitude, both signs and zeros; tiles cut at both edges."""
    rng = np.random.default_rng(0)
    x = np.exp2(rng.uniform(-24.0, 6.0, (rows, cols))) * rng.choice([-1.0, 1.0], (rows, cols))
    x[::7, ::5] = 0.0
    x[1::11, 3::13] = -0.0
    return x.astype(np.float32)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@functools.cache
def triton_cast_error(dtypes: tuple[str, ...]) -> str | None:
    """Why the Triton cast cannot stand in for the XLA cast on this device, or None.

    For each FP8 dtype (by name), both kernels cast a probe tensor, bf16 and a float32 one rounded via
    bf16 (the kernel cast), with the transposed copy and a scale that clips the largest values; q, q.T
    and the amax must agree bit for bit. Asked where ``auto`` would pick the Triton cast without it
    having run on this kind of GPU (ROCm), once per process.
    """
    if reason := triton_available():
        return reason
    x_np = _probe_input()
    x32 = jnp.asarray(x_np)
    triton, xla = (jax.jit(f, static_argnums=(1, 3, 4)) for f in (cast_triton, cast_xla))
    try:
        for name in dtypes:
            dtype = jnp.dtype(name)
            scale = jnp.float32(np.abs(x_np).max() / fp8_max(dtype) / 2.0)  # the top values clip
            for x, via in ((x32.astype(jnp.bfloat16), None), (x32, jnp.bfloat16)):
                got, want = triton(x, dtype, scale, True, via), xla(x, dtype, scale, 1, via)
                for part, a, b in zip(("q", "q.T", "amax"), got, want):
                    differ = int(np.sum(_bits(a) != _bits(b)))
                    if differ:
                        return (
                            f"its {part} differs from the XLA cast's in {differ} of {np.size(a)} values "
                            f"({name}, {x.dtype} input)"
                        )
    except Exception as e:  # noqa: BLE001 - any failure means: do not pick it automatically
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def cast(x, dtype, scale, transpose: int, kernel: str = "xla", via=None):
    """(q, q.T or None, amax of x) with ``q = clip(x / scale)`` in ``dtype``; x first rounded to ``via``.

    ``transpose``: False, or the number of leading axes the transposed copy moves to the end
    (``lead_to_end``; True = 1, ``q.T`` of a matrix). An n-D ``x`` is cast as its 2-D view.
    """
    if via is not None and jnp.dtype(via) == x.dtype:
        via = None
    if kernel == "triton" and x.ndim >= 2 and np.prod(x.shape) > 0:
        if x.ndim == 2:
            return partitioned(cast_triton)(x, dtype, scale, transpose, via)
        lead = int(transpose) or 1
        q, q_t, amax = partitioned(cast_triton)(
            x.reshape(math.prod(x.shape[:lead]), -1), dtype, scale, bool(transpose), via
        )
        q_t = None if q_t is None else q_t.reshape(*x.shape[lead:], *x.shape[:lead])
        return q.reshape(x.shape), q_t, amax
    return cast_xla(x, dtype, scale, transpose, via)


def partitioned(local_cast):
    """``local_cast`` (a per-device cast with ``cast``'s contract) made safe on the current mesh: under
    ``shard_map`` over its auto axes when the mesh (``jax.set_mesh``) has several devices, else itself.

    A custom call such as the Triton kernel has no partitioning rule, so XLA could not split it across
    devices; under ``shard_map`` each device casts its own rows and only the amax crosses devices.
    """

    def run(x, dtype, scale, transpose, via=None):
        mesh = jax.sharding.get_abstract_mesh()
        auto = tuple(
            name
            for name, kind in zip(mesh.axis_names, mesh.axis_types)
            if kind != jax.sharding.AxisType.Manual and mesh.shape[name] > 1
        )
        if not auto:
            return local_cast(x, dtype, scale, transpose, via)
        return shard_rows(local_cast, mesh, x.shape[0], auto)(x, dtype, scale, transpose, via)

    return run


def row_axes(mesh, rows: int, candidates) -> tuple[str, ...]:
    """The mesh axes (in mesh order) whose sizes multiply to a divisor of ``rows``, taken greedily."""
    axes, size = [], 1
    for name in candidates:
        if rows % (size * mesh.shape[name]) == 0:
            axes.append(name)
            size *= mesh.shape[name]
    return tuple(axes)


def shard_rows(local_cast, mesh, rows: int, candidates=None):
    """``local_cast`` under ``shard_map``: x's rows split over the mesh axes that divide them (the rest
    of the mesh holds copies), q split like x, q.T by columns, the amax the max over all devices. The
    result is that of ``local_cast`` on the whole of x, bit for bit: the cast is elementwise and a max
    does not depend on the order it is taken in."""
    candidates = mesh.axis_names if candidates is None else candidates
    axes = row_axes(mesh, rows, candidates) or None
    rows_spec, cols_spec = P(axes, None), P(None, axes)

    def run(x, dtype, scale, transpose, via=None):
        def local(x_local, scale):
            q, q_t, amax = local_cast(x_local, dtype, scale, transpose, via)
            if axes:
                amax = lax.pmax(amax, axes)
            return (q, q_t, amax) if transpose else (q, amax)

        out_specs = (rows_spec, cols_spec, P()) if transpose else (rows_spec, P())
        # Manual over the candidate axes only: inside an outer shard_map its manual axes stay as they are.
        out = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(rows_spec, P()),
            out_specs=out_specs,
            axis_names=frozenset(candidates),
            check_vma=False,
        )(x, jnp.asarray(scale, jnp.float32))
        return out if transpose else (out[0], None, out[1])

    return run
