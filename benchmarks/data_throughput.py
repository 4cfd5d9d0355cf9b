"""Samples/s of the shard pipeline (flux_jax.data, source="shards") at MLPerf 256 px shapes.

    python -m benchmarks.data_throughput [--records 128] [--batch 16] [--workers 0,2] [--dtype float16]
        [--model-dtype float32,bfloat16]

Writes synthetic shards (16x32x32 mean/logvar, 256x4096 T5, 768 CLIP) to a temp folder, then times
full per-host batches (read + validate + resample + CFG dropout + pack + batch) after one warm-up batch.
The pipeline hands T5 embeddings over in the model's compute dtype (--model-dtype).
"""

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import ml_collections
import numpy as np

from flux_jax import data, shards


def _config(path: str, workers: int, model_dtype: str) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.global_batch_size = 16
    c.model = ml_collections.ConfigDict(
        {"preset": "flux-schnell", "context_in_dim": 4096, "vec_in_dim": 768, "dtype": model_dtype}
    )
    c.data = ml_collections.ConfigDict(
        {
            "source": "shards",
            "path": path,
            "val_path": path,
            "image_size": 256,
            "txt_len": 256,
            "cfg_dropout_prob": 0.1,
            "num_workers": workers,
            "shuffle": True,
        }
    )
    return c


def write_synthetic(path: Path, records: int, dtype: str, per_shard: int = 64) -> None:
    rng = np.random.default_rng(0)
    np_dtype = shards.np_dtype(dtype)

    def sample(i):
        return {
            "id": str(i),
            "mean": rng.standard_normal((16, 32, 32), dtype=np.float32),
            "logvar": np.full((16, 32, 32), -4.0, np.float32),
            "t5_encodings": rng.standard_normal((256, 4096), dtype=np.float32).astype(np_dtype),
            "clip_encodings": rng.standard_normal(768, dtype=np.float32),
        }

    for k in range(0, records, per_shard):
        shards.write_shard(
            path / shards.shard_name(k // per_shard),
            (sample(i) for i in range(k, min(records, k + per_shard))),
        )
    shards.write_empty_encodings(path, np.zeros((256, 4096)), np.zeros(768))


def measure(path: str, workers: int, batch: int, batches: int, model_dtype: str) -> float:
    dims = dict(context_in_dim=4096, vec_in_dim=768)  # the FLUX.1 T5 and CLIP widths of the shards
    it = data.make_pipeline(_config(path, workers, model_dtype), "train", 0, 1, per_host_batch=batch, **dims)
    try:
        next(it)
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        return batch * batches / (time.perf_counter() - start)
    finally:
        if hasattr(it, "close"):
            it.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--workers", default="0,2")
    p.add_argument("--dtype", default="float16", choices=shards.FLOAT_DTYPES)
    p.add_argument("--model-dtype", default="float32,bfloat16", help="comma list of model.dtype values")
    args = p.parse_args()
    host = platform.processor() or platform.machine()
    print(f"host: {host}, {os.cpu_count()} cores; T5 stored as {args.dtype}")
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        write_synthetic(Path(tmp), args.records, args.dtype)
        print(f"wrote {args.records} records in {time.perf_counter() - start:.1f}s")
        for model_dtype in args.model_dtype.split(","):
            for w in map(int, args.workers.split(",")):
                rate = measure(tmp, w, args.batch, args.batches, model_dtype)
                print(f"model.dtype={model_dtype} num_workers={w} batch={args.batch}: {rate:.1f} samples/s")


if __name__ == "__main__":
    main()
