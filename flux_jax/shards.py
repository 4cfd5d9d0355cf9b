"""Precomputed-embedding shards: ArrayRecord files of msgpack records.

Layout of a shard directory::

    DIR/shard-00000.array_record     one msgpack map per record (format below)
    DIR/shard-00001.array_record
    DIR/empty_encodings.npz          t5 (T, 4096) and clip (768,) of the empty prompt (CFG dropout)

Record format (schema_version 1): a msgpack map with

    "schema_version": 1
    "id": str                        stable sample id
    "caption": str                   optional, "" when unknown
    "timestep": int                  optional, validation index 0..7
    array fields, each {"dtype": str, "shape": [int, ...], "data": bytes (C order)}:
      "mean", "logvar" (16, h, w)    VAE posterior; or "latent" (16, h, w) alone
      "t5_encodings" (T, 4096)
      "clip_encodings" (768,)

msgpack plus raw little-endian bytes was chosen over pickle (not safe to load) and np.savez (a zip
per record, slow to parse): any language can read it and dtype/shape are explicit.
A shard is written under a temporary name and renamed when complete, so a half-written shard
never looks valid and `prepare` can resume by skipping the shards that exist.
"""

import dataclasses
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgpack
import numpy as np
from array_record.python import array_record_module

from flux_jax.errors import UserError

SCHEMA_VERSION = 1
EMPTY_ENCODINGS = "empty_encodings.npz"
SHARD_SUFFIX = ".array_record"
ARRAY_FIELDS = ("mean", "logvar", "latent", "t5_encodings", "clip_encodings")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def np_dtype(name: str) -> np.dtype:
    """NumPy dtype for a name of FLOAT_DTYPES ("bfloat16" through ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclasses.dataclass(frozen=True)
class RecordSpec:
    """Shapes every record of a dataset must have."""

    latent_shape: tuple[int, int, int] = (16, 32, 32)
    txt_len: int = 256
    t5_dim: int = 4096
    clip_dim: int = 768


def shard_name(index: int) -> str:
    return f"shard-{index:05d}{SHARD_SUFFIX}"


def list_shards(directory: str | os.PathLike) -> list[Path]:
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(
            f"shard directory {directory} does not exist: set data.path to a folder written by "
            "`python -m flux_jax.prepare`"
        )
    shards = sorted(directory.glob(f"*{SHARD_SUFFIX}"))
    if not shards:
        raise UserError(f"no *{SHARD_SUFFIX} files in {directory}: run `python -m flux_jax.prepare` first")
    return shards


def _pack_array(x: np.ndarray) -> dict:
    x = np.asarray(x)
    if x.dtype == np.float64:
        x = x.astype(np.float32)
    if x.dtype.name not in FLOAT_DTYPES:
        raise UserError(f"array dtype {x.dtype} is not one of {FLOAT_DTYPES}")
    return {"dtype": x.dtype.name, "shape": list(x.shape), "data": np.ascontiguousarray(x).tobytes()}


def encode_record(sample: Mapping) -> bytes:
    """Serializes one sample dict (arrays + id/caption/timestep) to record bytes."""
    out = {
        "schema_version": SCHEMA_VERSION,
        "id": str(sample.get("id", "")),
        "caption": sample.get("caption", ""),
    }
    if sample.get("timestep") is not None:
        out["timestep"] = int(sample["timestep"])
    for name in ARRAY_FIELDS:
        if name in sample and sample[name] is not None:
            out[name] = _pack_array(sample[name])
    return msgpack.packb(out, use_bin_type=True)


def _unpack_array(obj, name: str, where: str) -> np.ndarray:
    if not isinstance(obj, dict) or not {"dtype", "shape", "data"} <= obj.keys():
        raise UserError(f"{where}: field {name!r} is not an array map with dtype/shape/data")
    if obj["dtype"] not in FLOAT_DTYPES:
        raise UserError(f"{where}: field {name!r} has dtype {obj['dtype']}, expected one of {FLOAT_DTYPES}")
    dtype = np_dtype(obj["dtype"])
    shape = tuple(int(s) for s in obj["shape"])
    if len(obj["data"]) != dtype.itemsize * int(np.prod(shape)):
        raise UserError(f"{where}: field {name!r} holds {len(obj['data'])} bytes, not shape {shape} {dtype}")
    return np.frombuffer(obj["data"], dtype=dtype).reshape(shape)


def _check_shape(x: np.ndarray, expected: tuple, name: str, where: str) -> None:
    if x.shape != tuple(expected):
        raise UserError(
            f"{where}: field {name!r} has shape {x.shape}, expected {tuple(expected)} "
            "(check data.image_size / data.txt_len against the shards)"
        )


def decode_record(raw: bytes, spec: RecordSpec, where: str) -> dict:
    """Parses and validates record bytes; `where` (shard file + index) goes into every error."""
    try:
        rec = msgpack.unpackb(raw, raw=False)
    except Exception as e:  # msgpack raises several unrelated types on corrupt input
        raise UserError(
            f"{where}: record is not valid msgpack ({e}); the shard is corrupt, rewrite it"
        ) from e
    if not isinstance(rec, dict):
        raise UserError(f"{where}: record is not a msgpack map")
    if rec.get("schema_version") != SCHEMA_VERSION:
        raise UserError(
            f"{where}: schema_version {rec.get('schema_version')!r}, this reader needs {SCHEMA_VERSION}"
        )
    has_posterior = "mean" in rec and "logvar" in rec
    if not has_posterior and "latent" not in rec:
        raise UserError(f"{where}: missing field 'mean'+'logvar' (or 'latent')")
    for name in ("t5_encodings", "clip_encodings"):
        if name not in rec:
            raise UserError(f"{where}: missing field {name!r}")
    out = {"id": str(rec.get("id", "")), "caption": str(rec.get("caption", ""))}
    if rec.get("timestep") is not None:
        out["timestep"] = int(rec["timestep"])
    for name in ("mean", "logvar") if has_posterior else ("latent",):
        out[name] = _unpack_array(rec[name], name, where)
        _check_shape(out[name], spec.latent_shape, name, where)
    out["t5_encodings"] = _unpack_array(rec["t5_encodings"], "t5_encodings", where)
    _check_shape(out["t5_encodings"], (spec.txt_len, spec.t5_dim), "t5_encodings", where)
    out["clip_encodings"] = _unpack_array(rec["clip_encodings"], "clip_encodings", where)
    _check_shape(out["clip_encodings"], (spec.clip_dim,), "clip_encodings", where)
    return out


def write_shard(path: str | os.PathLike, samples: Iterable[Mapping]) -> int:
    """Writes samples to one shard atomically (temp file + rename); returns the record count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    writer = array_record_module.ArrayRecordWriter(str(tmp), "group_size:1")
    count = 0
    try:
        for sample in samples:
            writer.write(encode_record(sample))
            count += 1
    finally:
        writer.close()
    os.replace(tmp, path)
    return count


def write_empty_encodings(directory: str | os.PathLike, t5: np.ndarray, clip: np.ndarray) -> Path:
    path = Path(directory) / EMPTY_ENCODINGS
    np.savez(path, t5=np.asarray(t5, np.float32), clip=np.asarray(clip, np.float32))
    return path


def read_empty_encodings(directory: str | os.PathLike, spec: RecordSpec) -> tuple[np.ndarray, np.ndarray]:
    path = Path(directory) / EMPTY_ENCODINGS
    if not path.is_file():
        raise UserError(
            f"{path} is missing: CFG dropout needs the empty-prompt encodings; write them with "
            "`python -m flux_jax.prepare` or set data.cfg_dropout_prob=0"
        )
    try:
        with np.load(path) as f:
            t5, clip = f["t5"], f["clip"]
    except Exception as e:
        raise UserError(f"{path}: unreadable empty encodings ({e}); rewrite it") from e
    if t5.shape != (spec.txt_len, spec.t5_dim) or clip.shape != (spec.clip_dim,):
        raise UserError(
            f"{path}: t5 {t5.shape} / clip {clip.shape}, expected "
            f"{(spec.txt_len, spec.t5_dim)} / {(spec.clip_dim,)} (check data.txt_len)"
        )
    return t5.astype(np.float32), clip.astype(np.float32)


def _open_reader(path: Path):
    try:
        return array_record_module.ArrayRecordReader(str(path))
    except Exception as e:
        raise UserError(f"{path}: cannot open shard ({e}); it is truncated or not an ArrayRecord file") from e


class ShardSource:
    """grain RandomAccessDataSource over a shard directory, validating every record it returns.

    Readers are opened lazily per process so the source pickles cleanly into grain workers.
    """

    def __init__(self, directory: str | os.PathLike, spec: RecordSpec):
        self.paths = list_shards(directory)
        self.spec = spec
        counts = []
        for p in self.paths:
            try:
                reader = array_record_module.ArrayRecordReader(str(p))
                counts.append(reader.num_records())
                reader.close()
            except Exception as e:
                raise UserError(
                    f"{p}: cannot open shard ({e!r}); it is truncated or not an ArrayRecord file, rewrite it"
                ) from e
        self._offsets = np.cumsum([0, *counts])
        self._readers: dict[int, object] = {}

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getstate__(self):
        return {**self.__dict__, "_readers": {}}

    def locate(self, index: int) -> tuple[int, int]:
        shard = int(np.searchsorted(self._offsets, index, side="right")) - 1
        return shard, index - int(self._offsets[shard])

    def __getitem__(self, index: int) -> dict:
        index = int(index) % len(self)
        shard, local = self.locate(index)
        where = f"{self.paths[shard]} record {local}"
        if shard not in self._readers:
            self._readers[shard] = _open_reader(self.paths[shard])
        try:
            raw = self._readers[shard].read([local])[0]
        except Exception as e:
            raise UserError(
                f"{where}: cannot read ({e}); the shard is truncated or corrupt, rewrite it"
            ) from e
        return decode_record(raw, self.spec, where)

    def __repr__(self) -> str:
        return f"ShardSource({len(self.paths)} shards, {len(self)} records)"
