"""The train-step benchmark shapes, one table for benchmarks/step.py (ours) and benchmarks/torch_peer.py
(the PyTorch peer), so both time the same model and batch.

Width 3072 (24 heads of 128) and the 12B model's other dimensions, except ``tiny`` (the "tiny"
preset, a few thousand parameters: checks the benchmarks themselves, on a CPU).
"""

SHAPES = {
    # name: (double blocks, single blocks, batch, image tokens per side, text tokens)
    "block": (2, 4, 4, 32, 512),  # 512 px
    "1024px": (2, 4, 1, 64, 512),
    "mlperf": (2, 4, 16, 16, 256),  # 256 px; step.py --depth / --single / --batch change it
    "535m": (1, 1, 2, 16, 256),  # flux-535m at Primus's BF16 micro batch (FP8: 4)
    "tiny": (1, 1, 2, 2, 4),
}


def preset_for(shape: str) -> str:
    """The flux_jax.model preset whose dimensions a shape takes (its depths are the shape's)."""
    return "tiny" if shape == "tiny" else "flux-535m"


def params_for(shape: str):
    """The FluxParams a shape trains: its preset's dimensions with the shape's depths."""
    import dataclasses

    from flux_jax.model import PRESETS

    depth, single, *_ = SHAPES[shape]
    return dataclasses.replace(PRESETS[preset_for(shape)], depth=depth, depth_single_blocks=single)
