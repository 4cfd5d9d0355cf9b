"""Where a jitted step's GPU time goes: kernel time per category from a jax.profiler trace.

    from benchmarks import trace_summary
    print(trace_summary.profile(lambda: step(state, batch), steps=5))

Reads the ``.xplane.pb`` with ``jax.profiler.ProfileData`` (no TensorBoard needed), sums the
duration of every event on the GPU planes' stream lines by kernel name, and buckets the names.
"""

import collections
import glob
import os
import re
import tempfile

import jax

# First match wins; kernel names are cuBLASLt / cuDNN / XLA fusion names.
CATEGORIES = (
    # Attention first: cuDNN's flash kernels are named "..._sdpa_sm90_flash_..._wgmma_...".
    ("attention", re.compile(r"(cudnn|fmha|flash|sdpa|attention)", re.I)),
    # cuBLASLt's nvjet names start with the operand types: q = e4m3, r = e5m2 (then C/D types, e.g.
    # "nvjet_sm90_qqtst_...", "nvjet_sm90_rqsss_..."; BF16 ones start "nvjet_sm90_tst_...").
    ("fp8_gemm", re.compile(r"(e4m3|e5m2|f8f6f4|fp8|_f8_|qgmma|nvjet_sm\d+_[qr]{2})", re.I)),
    ("gemm", re.compile(r"(gemm|xmma|nvjet|cutlass|wgmma|sm90_)", re.I)),
    ("transpose", re.compile(r"transpose", re.I)),
    ("reduce", re.compile(r"reduce", re.I)),
    ("copy", re.compile(r"(memcpy|memset|copy)", re.I)),
    ("fusion", re.compile(r"(fusion|loop_|input_|triton)", re.I)),
)


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if pattern.search(name):
            return cat
    return "other"


def kernel_times(xplane_path: str, counts: dict[str, int] | None = None) -> dict[str, float]:
    """Total ns per kernel name over the GPU stream lines of one trace (launches into ``counts``)."""
    data = jax.profiler.ProfileData.from_file(xplane_path)
    totals: dict[str, float] = collections.defaultdict(float)
    counts = counts if counts is not None else {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for event in line.events:
                totals[event.name] += event.duration_ns
                counts[event.name] = counts.get(event.name, 0) + 1
    return dict(totals)


def summarize(totals: dict[str, float], steps: int, top: int = 15, counts: dict | None = None) -> dict:
    per_cat: dict[str, float] = collections.defaultdict(float)
    for name, ns in totals.items():
        per_cat[category(name)] += ns
    ms = lambda ns: round(ns / steps / 1e6, 3)  # noqa: E731
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return {
        "kernel_ms_per_step": ms(sum(totals.values())),
        "kernels_per_step": round(sum((counts or {}).values()) / steps, 1),
        "by_category_ms": {k: ms(v) for k, v in sorted(per_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": [(name[:120], category(name), ms(ns)) for name, ns in ranked],
    }


def profile(run_step, steps: int = 5, top: int = 15) -> dict:
    """Traces ``steps`` calls of ``run_step`` (each must block until done) and summarises them."""
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        try:
            for _ in range(steps):
                run_step()
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return {"error": f"no .xplane.pb written under {tmp}"}
        counts: dict[str, int] = {}
        return summarize(kernel_times(paths[0], counts), steps, top, counts)
