"""Toy run: the built-in coloured-shapes data and the "toy" model preset, on CPU in a few minutes.

Run (from the repository root):

    python -m flux_jax.train --config configs/toy.py --workdir /tmp/flux_toy

Add ``:fp8`` to the config path for the FP8 (E4M3, delayed scaling) variant. Expected figures are
recorded in the README: the training loss starts near 1.2 (step 10), is near 0.3 by step 30 and
about 0.05 at step 300 (validation loss about 0.21); 300 steps take about 2 minutes on 2 idle CPU
cores (8 minutes measured on 2 shared ones), and samples then show the caption's colour
as a blob near the caption's position.
"""

import pathlib
import runpy

import ml_collections

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = _base["base_config"]()
    c.model.preset = "toy"  # 2 + 4 blocks of width 256
    c.model.dtype = "float32"  # CPU has slow bf16 matmuls
    c.fp8_amax_history_len = 16  # a short run: a short history
    c.fp8_amax_compute_algo = "max"  # over the 16 steps

    c.micro_batch_size = 16  # one micro batch per step on one device
    c.global_batch_size = 16  # images per step
    c.train_iters = 300  # about 2 minutes on 2 idle CPU cores
    c.lr = 1e-3  # a small model learns fast
    c.min_lr = 1e-4  # cosine floor
    c.lr_warmup_iters = 10  # short warmup for a short run
    c.save_interval = 100  # three checkpoints in a run
    c.eval_interval = 100  # three validation passes
    c.eval_iters = 4  # 64 validation images per pass

    c.data.source = "toy"  # built-in coloured shapes (flux_jax.toy)
    c.data.image_size = 128  # 64 image tokens
    c.data.txt_len = 8  # captions have three words
    c.data.num_workers = 0  # toy batches are drawn in process

    if arg == "fp8":
        c.fp8 = "e4m3"
    elif arg:
        raise ValueError(f"configs/toy.py: unknown argument {arg!r}; use nothing or 'fp8'.")
    return c
