"""The latent side of the batch contract: BFL's 2x2 patch packing, its inverse, position ids, and the
validation timestep index.

NumPy only (the data loader's worker processes import it); ``pack`` and ``unpack`` use array methods,
so they take jax arrays as well.
"""

import numpy as np

LATENT_CHANNELS = 16  # FLUX autoencoder channels; a packed token holds 4 of each (2x2 patch)
# Validation examples carry an index k in [0, NUM_VAL_TIMESTEPS): flow.validation_timesteps turns it
# into t = k / NUM_VAL_TIMESTEPS (MLPerf's fixed validation timesteps).
NUM_VAL_TIMESTEPS = 8


def pack(z):
    """BFL's "... c (h ph) (w pw) -> ... (h w) (c ph pw)": (..., c, h, w) -> (..., h/2 * w/2, 4c)."""
    *lead, c, h, w = z.shape
    n = len(lead)
    x = z.reshape((*lead, c, h // 2, 2, w // 2, 2))
    x = x.transpose((*range(n), n + 1, n + 3, n, n + 2, n + 4))
    return x.reshape((*lead, (h // 2) * (w // 2), c * 4))


def unpack(x, height: int, width: int):
    """Inverse of ``pack``: (..., height/2 * width/2, 4c) -> (..., c, height, width)."""
    *lead, seq, feat = x.shape
    if seq != (height // 2) * (width // 2) or feat % 4:
        raise ValueError(f"cannot unpack {x.shape} into a {height}x{width} latent with 2x2 patches")
    n, c = len(lead), feat // 4
    x = x.reshape((*lead, height // 2, width // 2, c, 2, 2))
    x = x.transpose((*range(n), n + 2, n, n + 3, n + 1, n + 4))
    return x.reshape((*lead, c, height, width))


def image_ids(height: int, width: int) -> np.ndarray:
    """(height/2 * width/2, 3) positions of the packed tokens: axis 0 = 0, axis 1 = row, axis 2 = col."""
    ids = np.zeros((height // 2, width // 2, 3), np.float32)
    ids[..., 1] = np.arange(height // 2)[:, None]
    ids[..., 2] = np.arange(width // 2)[None, :]
    return ids.reshape(-1, 3)
