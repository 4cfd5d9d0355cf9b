"""Model FLOP count, device peak, the metrics writer (metrics.jsonl + TensorBoard) and the sample-id log."""

import glob
import json
import os
import resource
import struct
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
    """Appends JSON lines to WORKDIR/metrics.jsonl and scalars to TensorBoard (process 0 only).

    ``resume_step``: the step the run starts from (0 for a fresh run). What an earlier run logged after
    it (the steps since its last checkpoint, which this run trains again) is removed first, from
    metrics.jsonl and from the TensorBoard event files, so no step is logged twice.
    """

    def __init__(self, workdir: str, enabled: bool = True, resume_step: int = 0):
        self.enabled = enabled
        if not enabled:
            return
        from tensorboardX import SummaryWriter

        os.makedirs(workdir, exist_ok=True)
        path, tb_dir = os.path.join(workdir, "metrics.jsonl"), os.path.join(workdir, "tensorboard")
        truncate_jsonl(path, resume_step)
        truncate_events(tb_dir, resume_step)
        self._jsonl = open(path, "a")
        # purge_step also tells TensorBoard itself to drop older events after resume_step.
        self._tb = SummaryWriter(tb_dir, purge_step=resume_step + 1 if resume_step else None)

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


def last_losses(path: str) -> dict[str, float | None]:
    """The last logged train and validation loss of a metrics.jsonl (None where none was logged)."""
    out: dict[str, float | None] = {"train": None, "val": None}
    if os.path.exists(path):
        with open(path, "rb") as f:
            for line in f:
                row = _json_or_none(line)
                if row and row.get("split") in out and "loss" in row:
                    out[row["split"]] = float(row["loss"])
    return out


def _replace(path: str, write) -> None:
    """Rewrites ``path`` through a temporary file, so a crash leaves the old or the new file whole."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def _json_or_none(line: bytes) -> dict | None:
    """A metrics line, or None for a blank or partly written one (a run killed mid-write)."""
    try:
        return json.loads(line)
    except ValueError:
        return None


def truncate_jsonl(path: str, step: int) -> int:
    """Drops the lines of a metrics.jsonl with a step after ``step``; returns how many were dropped."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    keep = [line for line in lines if (row := _json_or_none(line)) is not None and row.get("step", 0) <= step]
    if len(keep) < len(lines):
        _replace(path, lambda f: f.writelines(keep))
    return len(lines) - len(keep)


def _records(path: str) -> list[bytes]:
    """The records of a TFRecord file (TensorBoard events); stops at a truncated last record."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        end = pos + 12 + length + 4
        if end > len(data):
            break
        out.append(data[pos + 12 : pos + 12 + length])
        pos = end
    return out


def read_events(tb_dir: str) -> list:
    """Every event (tensorboardX Event protos) in the event files of ``tb_dir``, file by file."""
    from tensorboardX.proto import event_pb2

    files = sorted(glob.glob(os.path.join(tb_dir, "events.out.tfevents.*")))
    return [event_pb2.Event.FromString(r) for path in files for r in _records(path)]


def truncate_events(tb_dir: str, step: int) -> int:
    """Drops the events after ``step`` from the event files in ``tb_dir``; returns how many."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    def masked(data: bytes) -> bytes:
        return struct.pack("<I", masked_crc32c(data))

    dropped = 0
    for path in sorted(glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))):
        records = _records(path)
        keep = [r for r in records if event_pb2.Event.FromString(r).step <= step]
        if len(keep) == len(records):
            continue
        dropped += len(records) - len(keep)

        def write(f, keep=keep):
            for r in keep:
                header = struct.pack("<Q", len(r))
                f.write(header + masked(header) + r + masked(r))

        _replace(path, write)
    return dropped


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
