"""Built-in toy data: coloured shapes at positions, drawn straight into 16-channel latents.

Each sample comes from a caption "<colour> <shape> <position>" such as "red circle top-left". The
latent (16, S, S) holds the shape's mask times a fixed per-colour 16-vector, with small per-sample
jitter of position and size so the task is not pure memorisation. Caption embeddings are built from
fixed per-word vectors, so the text conditioning carries exactly the information needed. Everything
is a function of (seed, split, sample index): the iterator state is just the step.
"""

import itertools
import zlib

import ml_dtypes  # noqa: F401  (registers "bfloat16" with NumPy)
import numpy as np

from flux_jax import latents
from flux_jax.errors import UserError

COLOURS = {
    "red": (1.0, 0.1, 0.1),
    "green": (0.1, 0.9, 0.2),
    "blue": (0.15, 0.25, 1.0),
    "yellow": (1.0, 0.9, 0.1),
    "white": (1.0, 1.0, 1.0),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS = {
    "top-left": (0.3, 0.3),
    "top-right": (0.3, 0.7),
    "bottom-left": (0.7, 0.3),
    "bottom-right": (0.7, 0.7),
    "center": (0.5, 0.5),
}
CAPTIONS = tuple(" ".join(c) for c in itertools.product(COLOURS, SHAPES, POSITIONS))
# Latent magnitude chosen so the packed latents have roughly unit scale, like VAE latents after
# BFL's (z - shift) * scale.
LATENT_GAIN = 5.0


def _word_rng(word: str, salt: str) -> np.random.Generator:
    # crc32 instead of hash(): Python's str hash is salted per process.
    return np.random.default_rng(zlib.crc32(f"{salt}:{word}".encode()))


def word_vector(word: str, dim: int, salt: str = "txt") -> np.ndarray:
    """Fixed unit-variance vector for a word."""
    return _word_rng(word, salt).standard_normal(dim).astype(np.float32)


def colour_basis() -> np.ndarray:
    """(16, 3) matrix with orthonormal columns mapping RGB to latent channels."""
    q, _ = np.linalg.qr(np.random.default_rng(1234).standard_normal((latents.LATENT_CHANNELS, 3)))
    return q.astype(np.float32)


def decode(latent: np.ndarray) -> np.ndarray:
    """Fixed linear decoder: latent (..., 16, S, S) -> RGB (..., S, S, 3) in [0, 1]."""
    rgb = np.einsum("...chw,cr->...hwr", latent, colour_basis()) / LATENT_GAIN
    return np.clip(rgb, 0.0, 1.0)


def draw_latent(caption: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """Renders one caption into a (16, size, size) float32 latent."""
    colour, shape, position = caption.split(" ")
    cy, cx = POSITIONS[position]
    cy += rng.uniform(-0.05, 0.05)
    cx += rng.uniform(-0.05, 0.05)
    radius = rng.uniform(0.15, 0.22)
    grid = (np.arange(size, dtype=np.float32) + 0.5) / size
    yy, xx = np.meshgrid(grid, grid, indexing="ij")
    dy, dx = yy - cy, xx - cx
    if shape == "circle":
        mask = dy**2 + dx**2 <= radius**2
    elif shape == "square":
        mask = (np.abs(dy) <= radius * 0.85) & (np.abs(dx) <= radius * 0.85)
    else:
        mask = (dy <= radius * 0.8) & (dy >= -radius) & (np.abs(dx) <= (dy + radius) * 0.6)
    vec = colour_basis() @ np.asarray(COLOURS[colour], np.float32) * LATENT_GAIN
    return (vec[:, None, None] * mask[None].astype(np.float32)).astype(np.float32)


def embed_caption(caption: str, txt_len: int, context_in_dim: int, vec_in_dim: int):
    """Caption -> (txt (txt_len, context_in_dim), y (vec_in_dim)), like padded T5 and pooled CLIP."""
    words = caption.split(" ")
    if txt_len < len(words):
        raise UserError(f"data.txt_len={txt_len} is shorter than a toy caption ({len(words)} words).")
    txt = np.zeros((txt_len, context_in_dim), np.float32)
    for i, w in enumerate(words):
        txt[i] = word_vector(w, context_in_dim)
    y = np.mean([word_vector(w, vec_in_dim, salt="pooled") for w in words], axis=0)
    return txt, y.astype(np.float32)


class ToyPipeline:
    """Infinite iterator of packed toy batches, this process's rows of every global batch.

    Sample ``g`` of the stream (row ``g % global batch`` of batch ``g // global batch``) is a function
    of (seed, split, g) alone, so the global batches are the same whatever the process count, and
    the state (batches read) carries over between process counts. Each batch's "id" holds the global
    indices of its rows. Train batches apply CFG dropout (zeroed txt and y). Validation batches carry
    a "timestep" index 0..7, spread evenly within every global batch, and never drop the caption.
    """

    def __init__(
        self,
        *,
        seed: int,
        split: str,
        batch_size: int,
        image_size: int,
        txt_len: int,
        context_in_dim: int,
        vec_in_dim: int,
        cfg_dropout_prob: float = 0.0,
        process_index: int = 0,
        process_count: int = 1,
        txt_dtype: str = "float32",
    ):
        if split not in ("train", "val"):
            raise ValueError(f"toy data split={split!r} must be 'train' or 'val'.")
        if image_size % 16:
            raise UserError(f"data.image_size={image_size} must be a multiple of 16 (8x VAE, 2x2 patches).")
        self.seed, self.split, self.batch_size = seed, split, batch_size
        self.latent_size = image_size // 8
        self.txt_len, self.cfg_dropout_prob = txt_len, cfg_dropout_prob
        self.process_index, self.process_count = process_index, process_count
        self.txt_dtype = np.dtype(txt_dtype)  # the model's compute dtype, as data.RecordTransform
        self.step = 0
        self._captions = {c: embed_caption(c, txt_len, context_in_dim, vec_in_dim) for c in CAPTIONS}
        self._img_ids = latents.image_ids(self.latent_size, self.latent_size)

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])

    def __iter__(self):
        return self

    def row_indices(self, step: int) -> np.ndarray:
        """Global sample indices of this process's rows of batch ``step``: a contiguous block."""
        b = self.batch_size
        return step * b * self.process_count + self.process_index * b + np.arange(b)

    def _sample(self, index: int) -> tuple[str, np.ndarray, bool]:
        # The validation split uses its own stream, so held-out samples never repeat train ones.
        rng = np.random.default_rng([self.seed, 0 if self.split == "train" else 1, index])
        name = CAPTIONS[rng.integers(0, len(CAPTIONS))]
        latent = draw_latent(name, self.latent_size, rng)
        dropped = (
            self.split == "train" and self.cfg_dropout_prob > 0 and rng.uniform() < self.cfg_dropout_prob
        )
        return name, latent, dropped

    def __next__(self) -> dict:
        rows = self.row_indices(self.step)
        self.step += 1
        b = self.batch_size
        names, drawn, dropped = zip(*(self._sample(int(g)) for g in rows))
        keep = 1.0 - np.asarray(dropped, np.float32)
        batch = {
            "img": latents.pack(np.stack(drawn)),
            "img_ids": np.broadcast_to(self._img_ids, (b,) + self._img_ids.shape).copy(),
            "txt": np.stack([self._captions[n][0] for n in names]) * keep[:, None, None],
            "txt_ids": np.zeros((b, self.txt_len, 3), np.float32),
            "y": np.stack([self._captions[n][1] for n in names]) * keep[:, None],
            "id": rows.astype(np.int64),
        }
        batch["txt"] = batch["txt"].astype(self.txt_dtype)
        if self.split == "val":
            batch["timestep"] = (rows % latents.NUM_VAL_TIMESTEPS).astype(np.int32)
        return batch


def make_pipeline(
    config,
    split: str,
    process_index: int,
    process_count: int,
    *,
    context_in_dim: int,
    vec_in_dim: int,
    per_host_batch: int | None = None,
) -> ToyPipeline:
    """Toy pipeline for one host: per_host_batch (default global_batch_size / process_count) samples
    per batch."""
    return ToyPipeline(
        seed=config.seed,
        split=split,
        batch_size=per_host_batch or config.global_batch_size // process_count,
        image_size=config.data.image_size,
        txt_len=config.data.txt_len,
        context_in_dim=context_in_dim,
        vec_in_dim=vec_in_dim,
        cfg_dropout_prob=config.data.cfg_dropout_prob,
        process_index=process_index,
        process_count=process_count,
        txt_dtype=config.model.dtype,
    )
