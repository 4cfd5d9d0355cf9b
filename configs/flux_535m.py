"""FLUX 535M (1 double + 1 single block, width 3072) on mock 256 px data, as Primus
flux_535m_pretrain.yaml / flux_535m_pretrain_fp8.yaml.

Run on one GPU:

    python -m flux_jax.train --config configs/flux_535m.py --workdir runs/535m
    python -m flux_jax.train --config configs/flux_535m.py:fp8 --workdir runs/535m_fp8

BF16 uses MBS 2 / GBS 16 (8 accumulation steps on one GPU); FP8 uses MBS 4 / GBS 32 with E4M3
delayed scaling (margin 0, history 1024, most_recent, FP8 wgrad). Primus reports 20-30 (BF16) and
30-50 (FP8) steps/s on one MI300X (unverified claims). Measured on one H200 with
`--config.data.source=toy` (benchmarks/RESULTS.md, seventh run): BF16 20.7 steps/s (332 images/s),
FP8 12.3-14.0 steps/s (395-449 images/s).
"""

import pathlib
import runpy

import ml_collections

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = _base["base_config"]()
    c.model.preset = "flux-535m"  # key of flux_jax.model.PRESETS
    c.micro_batch_size = 2  # Primus BF16 micro batch
    c.global_batch_size = 16  # Primus BF16 global batch
    c.data.source = "mock"  # random records with the real shapes, as Primus' mock dataset
    c.data.cfg_dropout_prob = 0.0  # Primus FluxConfig default

    if arg == "fp8":
        # flux_535m_pretrain_fp8.yaml: E4M3 delayed scaling, larger batch.
        c.fp8 = "e4m3"
        c.micro_batch_size = 4
        c.global_batch_size = 32
    elif arg:
        raise ValueError(f"configs/flux_535m.py: unknown argument {arg!r}; use nothing or 'fp8'.")
    return c
