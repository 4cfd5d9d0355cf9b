"""FLUX.1-schnell 12B, MLPerf Training Flux.1 recipe (as Primus' MI355X MLPerf config).

Run (one host of 8 GPUs, FSDP over all of them; see launch/ for multi-host):

    python -m flux_jax.train --config configs/flux_12b.py --workdir runs/12b \
        --config.data.path=/data/cc12m_shards --config.data.val_path=/data/coco_shards
    python -m flux_jax.train --config configs/flux_12b.py:fp8 --workdir runs/12b_fp8 ...

AdamW lr 2e-4 constant after 1600 warmup steps, wd 0.1, betas (0.9, 0.95), eps 1e-8, clip 1.0,
uniform timesteps, CFG dropout 0.1, GBS 512, 256 px (256 image + 256 text tokens). Quality target:
validation loss <= 0.586 (mean over t in {0, 1/8, ..., 7/8}). The model costs about 20.3 TFLOP per
sample (MLPerf's MODEL_TFLOP_PER_SAMPLE); FP8 is hybrid (E4M3 forward, E5M2 gradients) delayed
scaling with history 1, i.e. per-step scales.
"""

import pathlib
import runpy

import ml_collections

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = _base["base_config"]()
    c.seed = 42  # MLPerf reference seed
    c.model.preset = "flux-schnell"  # key of flux_jax.model.PRESETS
    c.model.scan_blocks = True  # 19 + 38 blocks: scanned, for compile time
    c.recompute_granularity = "full"  # activation checkpointing: 12B at 256 px needs it
    c.fp8_amax_history_len = 1  # per-step scales (MLPerf FP8)

    c.micro_batch_size = 8  # per data-parallel replica per forward/backward
    c.global_batch_size = 512  # MLPerf global batch
    c.train_iters = 5000  # optimizer steps
    c.lr = 2e-4  # MLPerf peak learning rate
    c.min_lr = 2e-4  # unused with constant decay
    c.lr_warmup_iters = 1600  # MLPerf warmup
    c.lr_decay_style = "constant"  # MLPerf: no decay
    c.weight_decay = 0.1  # MLPerf AdamW decay
    c.adam_beta2 = 0.95  # MLPerf AdamW beta2

    c.save_interval = 512  # steps between checkpoints (and one at the end)
    c.eval_interval = 512  # steps between validation passes (and one at the end)
    c.eval_iters = 10  # validation batches per pass

    c.timestep_sampling = "uniform"  # MLPerf timestep sampling
    c.target_val_loss = 0.586  # MLPerf quality target; stop once reached

    c.data.source = "shards"  # precomputed-embedding shards (python -m flux_jax.prepare)
    c.data.num_workers = 8  # loader worker processes (shards)
    c.mesh.data = 1  # no pure data parallelism: ...
    c.mesh.fsdp = -1  # ... parameters and optimizer state sharded over every device
    c.checkpoint.max_to_keep = 3  # recent checkpoints kept

    if arg == "fp8":
        # MLPerf FP8: hybrid formats, delayed scaling with a one-step history.
        c.fp8 = "hybrid"
    elif arg:
        raise ValueError(f"configs/flux_12b.py: unknown argument {arg!r}; use nothing or 'fp8'.")
    return c
