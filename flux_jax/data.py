"""grain input pipelines: precomputed-embedding shards, mock data (real shapes), and the toy set.

Every pipeline yields per-host batches (dict of numpy arrays, see the batch contract in DESIGN.md,
plus "id": the records' ids) and is a grain DatasetIterator, so `get_state()` / `set_state()`
checkpoint its position exactly. Process p of P reads rows p*b..(p+1)*b of every global batch of
b*P records, so together the processes read exactly the global batches one process would, and the
position (global batches read) carries over between process counts.

Per-record randomness (VAE resample, CFG dropout) comes from a generator seeded with
(config.seed, split, global record index), so it is the same whatever the worker count, host
count or restart point, and fresh in every epoch (the index keeps growing across epochs).
"""

import dataclasses

import grain
import numpy as np

from flux_jax import latents, shards
from flux_jax.errors import UserError

VAE_SCALE = 0.3611
VAE_SHIFT = 0.1159
_SPLIT_IDS = {"train": 0, "val": 1}


def scale_latent(z: np.ndarray) -> np.ndarray:
    return (VAE_SCALE * (z - VAE_SHIFT)).astype(np.float32)


def resample_latent(mean: np.ndarray, logvar: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw from the VAE posterior N(mean, exp(logvar))."""
    mean = mean.astype(np.float32)
    eps = rng.standard_normal(mean.shape, dtype=np.float32)
    return mean + np.exp(0.5 * logvar.astype(np.float32)) * eps


def record_rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, _SPLIT_IDS[split], index])


@dataclasses.dataclass(frozen=True)
class RecordTransform:
    """Raw record -> one training/validation example of the batch contract (picklable for workers)."""

    seed: int
    split: str
    cfg_dropout_prob: float
    empty_t5: np.ndarray | None
    empty_clip: np.ndarray | None
    # T5 embeddings leave in the model's compute dtype: the model casts them to it before txt_in,
    # so no value changes, and for BF16 the largest array of a batch (256 x 4096 per sample) is
    # half the bytes in host memory, between worker processes and on its way to the device.
    txt_dtype: str = "float32"

    def __call__(self, index: int, rec: dict) -> dict:
        rng = record_rng(self.seed, self.split, index)
        # Draw order (resample, then dropout) is fixed so a record's example never depends on others.
        if "latent" in rec:
            z = rec["latent"].astype(np.float32)
        else:
            z = resample_latent(rec["mean"], rec["logvar"], rng)
        drop = rng.uniform() < self.cfg_dropout_prob if self.split == "train" else False
        txt, y = rec["t5_encodings"], rec["clip_encodings"]
        if drop:
            txt, y = self.empty_t5, self.empty_clip
        _, h, w = z.shape
        out = {
            "id": str(rec.get("id", "")) or f"record-{index}",
            "img": latents.pack(scale_latent(z)),
            "img_ids": latents.image_ids(h, w),
            "txt": np.asarray(txt, shards.np_dtype(self.txt_dtype)),
            "txt_ids": np.zeros((txt.shape[0], 3), np.float32),
            "y": np.asarray(y, np.float32),
        }
        if self.split == "val":
            out["timestep"] = np.int32(rec.get("timestep", index % latents.NUM_VAL_TIMESTEPS))
        return out


class MockSource:
    """Random records with real MLPerf shapes, like Primus' PreGeneratedMockFluxDataset.

    A small pool of records is generated once per process and indexed cyclically: generating a
    (256, 4096) encoding per read would make the mock slower than the real shards.
    """

    def __init__(self, spec: shards.RecordSpec, num_records: int, seed: int = 0, pool_size: int = 16):
        self.spec, self.num_records, self.seed, self.pool_size = spec, num_records, seed, pool_size
        self._pool: list[dict] | None = None

    def __len__(self) -> int:
        return self.num_records

    def __getstate__(self):
        return {**self.__dict__, "_pool": None}

    def _make(self, i: int) -> dict:
        rng = np.random.default_rng([self.seed, 7, i])
        s = self.spec
        return {
            "mean": rng.standard_normal(s.latent_shape, dtype=np.float32),
            "logvar": np.full(s.latent_shape, -4.0, np.float32),
            "t5_encodings": rng.standard_normal((s.txt_len, s.t5_dim), dtype=np.float32),
            "clip_encodings": rng.standard_normal((s.clip_dim,), dtype=np.float32),
        }

    def __getitem__(self, index: int) -> dict:
        if self._pool is None:
            self._pool = [self._make(i) for i in range(self.pool_size)]
        index = int(index) % self.num_records
        return {"id": f"mock-{index}", **self._pool[index % self.pool_size]}


def record_spec(config, context_in_dim: int, vec_in_dim: int) -> shards.RecordSpec:
    """The stored record shapes for config.data and the model's text / pooled widths."""
    size = int(config.data.image_size)
    if size % 16:
        raise UserError(f"data.image_size={size} must be a multiple of 16 (8x VAE, 2x2 patches)")
    latent_shape = (latents.LATENT_CHANNELS, size // 8, size // 8)
    return shards.RecordSpec(latent_shape, int(config.data.txt_len), int(context_in_dim), int(vec_in_dim))


def _default_host_batch(config, process_count: int) -> int:
    if config.global_batch_size % process_count:
        raise UserError(
            f"global_batch_size={config.global_batch_size} is not divisible by the {process_count} "
            "processes: pick a multiple"
        )
    return config.global_batch_size // process_count


def build_dataset(
    source,
    *,
    seed: int,
    split: str,
    per_host_batch: int,
    process_index: int,
    process_count: int,
    shuffle: bool,
    cfg_dropout_prob: float,
    empty: tuple[np.ndarray, np.ndarray] | None,
    num_workers: int,
    txt_dtype: str = "float32",
) -> grain.IterDataset:
    """grain graph: [shuffle, repeat] -> transform (global index) -> batch -> host slice -> workers.

    Batching before the host slice gives each process one contiguous block of every global batch,
    and makes the iterator's position count batches, the same number on every process count.
    """
    if split not in _SPLIT_IDS:
        raise ValueError(f"split={split!r} must be 'train' or 'val'")
    if len(source) < process_count * per_host_batch and split == "val":
        raise UserError(
            f"validation data has {len(source)} records, fewer than one global batch "
            f"({process_count} x {per_host_batch}): add records to data.val_path or lower the batch"
        )
    ds = grain.MapDataset.source(source)
    if split == "train":
        if shuffle:
            ds = ds.shuffle(seed=seed)
        # After shuffle, repeat passes epoch-unique indices down, so every epoch gets a new order.
        ds = ds.repeat()
    empty_t5, empty_clip = empty if empty is not None else (None, None)
    transform = RecordTransform(
        seed, split, cfg_dropout_prob if split == "train" else 0.0, empty_t5, empty_clip, txt_dtype
    )
    ds = ds.map_with_index(transform)
    ds = ds.batch(per_host_batch, drop_remainder=True)
    if split == "val":  # every process gets the same number of batches
        ds = ds[: len(ds) - len(ds) % process_count]
    ds = ds[process_index::process_count]
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=2))
    if num_workers > 0:
        from absl import flags

        # grain's worker startup reads absl flags; outside absl.app they were never parsed.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers, per_worker_buffer_size=2))
        # Worker batches arrive in shared memory, freed when the last view of them is deleted.
        # A batch the program still holds at exit (on CPU, device_put even keeps the numpy buffer)
        # is never freed, and Python warns of leaked shared_memory objects; so each batch is
        # copied into process memory here and its shared memory freed at once.
        it = it.map(_to_process_memory)
    return it


def _to_process_memory(batch: dict) -> dict:
    return {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


def make_pipeline(
    config,
    split: str,
    process_index: int,
    process_count: int,
    *,
    context_in_dim: int,
    vec_in_dim: int,
    per_host_batch: int | None = None,
    mock_records: int = 4096,
):
    """Iterator of per-host batches for config.data.source "shards" or "mock" (``setup.make_pipeline``
    dispatches every source, toy included, with the model's text / pooled widths).

    per_host_batch: samples this host yields per call (micro_batch_size x this host's
    data-parallel share); defaults to global_batch_size / process_count.
    """
    source_name = config.data.source
    if source_name not in ("shards", "mock"):
        raise UserError(
            f"data.source={source_name!r}: the grain pipeline reads 'shards' or 'mock' ('toy' is "
            "flux_jax.toy); pick one of 'toy', 'shards', 'mock'"
        )
    batch = per_host_batch or _default_host_batch(config, process_count)
    spec = record_spec(config, context_in_dim, vec_in_dim)
    cfg_p = float(config.data.cfg_dropout_prob)
    if not 0.0 <= cfg_p <= 1.0:
        raise UserError(f"data.cfg_dropout_prob={cfg_p} must be in [0, 1]")
    if source_name == "mock":
        source = MockSource(spec, mock_records, seed=_SPLIT_IDS.get(split, 0))
        rng = np.random.default_rng([config.seed, 99])
        empty = (
            rng.standard_normal((spec.txt_len, spec.t5_dim), dtype=np.float32),
            rng.standard_normal((spec.clip_dim,), dtype=np.float32),
        )
    else:
        field = "data.path" if split == "train" else "data.val_path"
        path = config.data.path if split == "train" else config.data.val_path
        if not path:
            raise UserError(
                f"{field} is empty: set it to a shard folder written by `python -m flux_jax.prepare`"
            )
        source = shards.ShardSource(path, spec)
        # The empty encodings live beside the training shards; validation never drops captions.
        empty = shards.read_empty_encodings(path, spec) if split == "train" and cfg_p > 0 else None
    ds = build_dataset(
        source,
        seed=int(config.seed),
        split=split,
        per_host_batch=batch,
        process_index=process_index,
        process_count=process_count,
        shuffle=bool(config.data.shuffle),
        cfg_dropout_prob=cfg_p,
        empty=empty,
        num_workers=int(config.data.num_workers),
        txt_dtype=config.model.dtype,
    )
    return iter(ds)
