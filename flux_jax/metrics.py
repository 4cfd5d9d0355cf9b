"""Model FLOP count, device peak, the metrics writer (metrics.jsonl + TensorBoard) and the sample-id log."""

import json
import os
import resource
from typing import Any

import jax

# Dense peak FLOP/s (no sparsity) per device, by a substring of jax's device_kind.
_PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp8": 1979e12},
    "H100": {"bf16": 989e12, "fp8": 1979e12},
    "MI300X": {"bf16": 1307.4e12, "fp8": 2614.9e12},
    "MI325X": {"bf16": 1307.4e12, "fp8": 2614.9e12},
}


def train_flops_per_sample(p: Any, img_len: int, txt_len: int) -> float:
    """Model FLOPs of one training sample (forward + backward) for FluxParams p.

    6 * params_touched_per_token * tokens for every dense layer (2 FLOPs per multiply-add, times 3
    for forward, data-gradient and weight-gradient), plus attention: QK^T and AV cost
    2 * 2 * L^2 * hidden per layer forward, times 3 for training, with L = img_len + txt_len.
    Per-sample layers (modulations, time/vector embedders) count once per sample. Recomputation
    is not counted (this is model FLOPs, as MFU is defined).
    """
    h = p.hidden_size
    mlp = int(h * p.mlp_ratio)
    length = img_len + txt_len
    stream = 3 * h * h + h * h + 2 * h * mlp  # qkv, attention out, MLP in/out of one stream
    double = stream * length  # img tokens use img weights, txt tokens txt weights
    single = (h * (3 * h + mlp) + (h + mlp) * h) * length
    embed = p.in_channels * h * img_len + p.context_in_dim * h * txt_len + h * p.out_channels * img_len
    per_sample = (
        p.depth * 2 * 6 * h * h  # img_mod and txt_mod
        + p.depth_single_blocks * 3 * h * h
        + 2 * h * h  # final adaLN
        + (256 * h + h * h) * (2 if p.guidance_embed else 1)  # time_in (+ guidance_in)
        + p.vec_in_dim * h
        + h * h  # vector_in
    )
    dense = p.depth * double + p.depth_single_blocks * single + embed + per_sample
    attention = 4 * length * length * h * (p.depth + p.depth_single_blocks)
    return 6.0 * dense + 3.0 * attention


def peak_flops(device_kind: str, fp8: bool) -> float | None:
    """Peak FLOP/s of one device, or None when the device is not in the table."""
    for name, peaks in _PEAK_FLOPS.items():
        if name.lower() in device_kind.lower():
            return peaks["fp8" if fp8 else "bf16"]
    return None


def memory_metrics() -> dict[str, float]:
    """Memory of this process, GiB: device peak / in use / limit (largest over the local devices,
    where the backend keeps allocator stats: GPUs, not CPU) and the host's peak resident set."""
    out = {"host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}
    stats = [s for s in (d.memory_stats() for d in jax.local_devices()) if s]
    for key, name in (
        ("peak_bytes_in_use", "peak_memory_gib"),
        ("bytes_in_use", "memory_in_use_gib"),
        ("bytes_limit", "memory_limit_gib"),
    ):
        if stats and all(key in s for s in stats):
            out[name] = max(s[key] for s in stats) / 2**30
    return out


class MetricWriter:
    """Appends JSON lines to WORKDIR/metrics.jsonl and scalars to TensorBoard (process 0 only)."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        from tensorboardX import SummaryWriter

        os.makedirs(workdir, exist_ok=True)
        self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, values: dict[str, Any], prefix: str = "train") -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, "split": prefix, **values}) + "\n")
        self._jsonl.flush()
        for key, value in values.items():
            if isinstance(value, int | float):
                self._tb.add_scalar(f"{prefix}/{key}", value, step)
        self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()


class IdsLog:
    """With config.data.log_ids: the sample ids each train step read on this process, one JSON line
    per step in WORKDIR/data_ids/process_<index>.jsonl (a resumed run appends the steps it repeats).
    Shows which records every process consumed, e.g. to check that no record is read twice an epoch."""

    def __init__(self, workdir: str, process_index: int, enabled: bool = False):
        self._file = None
        if enabled:
            os.makedirs(os.path.join(workdir, "data_ids"), exist_ok=True)
            self._file = open(os.path.join(workdir, "data_ids", f"process_{process_index}.jsonl"), "a")

    def write(self, step: int, ids) -> None:
        if self._file is None:
            return
        if ids is None:
            raise ValueError("data.log_ids=True but this data source yields no sample ids")
        self._file.write(json.dumps({"step": step, "ids": [str(i) for i in ids]}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
