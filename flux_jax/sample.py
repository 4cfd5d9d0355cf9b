"""Euler sampling with the FLUX schedule and PNG export.

CLI: python -m flux_jax.sample --workdir W --config configs/toy.py --num_steps N --out DIR
restores the newest checkpoint's params, samples toy captions (or the first validation batch of
stored encodings), decodes them (toy linear decoder, or the FLUX autoencoder given --ae) and writes
one PNG per sample plus grid.png and prompts.txt. The toy decoder works at latent resolution
(image_size / 8), so its images are enlarged 8x, each latent pixel an 8x8 block.
"""

import argparse
import functools
import json
import math
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from flux_jax import cli, flow, latents
from flux_jax.config_cli import load_config
from flux_jax.errors import UserError


def get_schedule(num_steps: int, image_seq_len: int, shift: bool) -> jax.Array:
    """num_steps + 1 timesteps from 1 to 0; shifted by sequence length for dev-style models."""
    return flow.get_schedule(num_steps, image_seq_len, shift=shift)


# apply_fn(variables, img, img_ids, txt, txt_ids, timesteps (B,), y, guidance (B,) | None) -> velocity
ApplyFn = Callable[..., jax.Array]


@functools.partial(jax.jit, static_argnums=0)
def denoise(
    apply_fn: ApplyFn,
    variables,
    noise_packed,
    img_ids,
    txt,
    txt_ids,
    y,
    timesteps,
    guidance=None,
    uncond=None,
    cfg_scale=1.0,
):
    """Integrates the velocity field from timesteps[0] (noise) to timesteps[-1] with Euler steps.

    `uncond=(txt, y)` turns on classifier-free guidance, pred = u + cfg_scale * (c - u), for models
    trained with caption dropout; both halves go through one batched model call.
    """
    b = noise_packed.shape[0]
    guidance_vec = None if guidance is None else jnp.full((b,), guidance, jnp.float32)
    if uncond is not None:
        txt = jnp.concatenate([txt, jnp.broadcast_to(uncond[0], txt.shape)])
        y = jnp.concatenate([y, jnp.broadcast_to(uncond[1], y.shape)])
        img_ids, txt_ids = jnp.concatenate([img_ids, img_ids]), jnp.concatenate([txt_ids, txt_ids])
        guidance_vec = None if guidance_vec is None else jnp.concatenate([guidance_vec, guidance_vec])

    def step(img, ts):
        t_curr, t_prev = ts
        x = img if uncond is None else jnp.concatenate([img, img])
        t_vec = jnp.full((x.shape[0],), t_curr, jnp.float32)
        pred = apply_fn(variables, x, img_ids, txt, txt_ids, t_vec, y, guidance_vec).astype(img.dtype)
        if uncond is not None:
            pred = pred[b:] + cfg_scale * (pred[:b] - pred[b:])
        return img + (t_prev - t_curr) * pred, None

    pairs = jnp.stack([timesteps[:-1], timesteps[1:]], axis=-1)
    img, _ = jax.lax.scan(step, noise_packed.astype(jnp.float32), pairs)
    return img


def flux_apply_fn(model) -> ApplyFn:
    """Adapter from a flux_jax.model.Flux to denoise's apply_fn."""

    def apply_fn(variables, img, img_ids, txt, txt_ids, t, y, guidance):
        return model.apply(variables, img, img_ids, txt, txt_ids, t, y, guidance=guidance)

    return apply_fn


def to_uint8(images: np.ndarray) -> np.ndarray:
    """Float images in [0, 1] (N, H, W, 3) -> uint8."""
    return np.round(np.clip(np.asarray(images, np.float32), 0.0, 1.0) * 255.0).astype(np.uint8)


def make_grid(images: np.ndarray, cols: int | None = None, pad: int = 2) -> np.ndarray:
    """(N, H, W, C) -> one (rows*(H+pad)+pad, cols*(W+pad)+pad, C) image on a black background."""
    n, h, w, c = images.shape
    cols = cols or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = np.zeros((rows * (h + pad) + pad, cols * (w + pad) + pad, c), images.dtype)
    for i, im in enumerate(images):
        r, k = divmod(i, cols)
        grid[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + k * (w + pad) : pad + k * (w + pad) + w] = (
            im
        )
    return grid


def upscale(images: np.ndarray, factor: int) -> np.ndarray:
    """(N, H, W, C) -> (N, H * factor, W * factor, C), each pixel repeated (nearest neighbour)."""
    return np.repeat(np.repeat(images, factor, axis=1), factor, axis=2)


def write_png(path: str, image: np.ndarray) -> None:
    from PIL import Image

    Image.fromarray(image).save(path)


def write_images(out_dir: str, images: np.ndarray, prompts: list[str]) -> list[str]:
    """Writes NNN.png per image, grid.png and prompts.txt; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    images = to_uint8(images)
    paths = []
    for i, im in enumerate(images):
        paths.append(os.path.join(out_dir, f"{i:03d}.png"))
        write_png(paths[-1], im)
    paths.append(os.path.join(out_dir, "grid.png"))
    write_png(paths[-1], make_grid(images))
    paths.append(os.path.join(out_dir, "prompts.txt"))
    with open(paths[-1], "w") as f:
        f.write("".join(f"{i:03d}\t{p}\n" for i, p in enumerate(prompts)))
    return paths


# ---- CLI ----------------------------------------------------------------------------------------


def _saved_config(step_dir) -> dict | None:
    meta = step_dir / "config" / "metadata"
    return json.loads(meta.read_text()) if meta.exists() else None


def _conditioning(config, fp, num_images: int, prompts: list[str] | None):
    """(prompts, txt, y, latent size) from toy captions or the first validation batch."""
    size = config.data.image_size // 8
    if config.data.source == "toy":
        from flux_jax import toy

        prompts = prompts or [toy.CAPTIONS[(i * 7) % len(toy.CAPTIONS)] for i in range(num_images)]
        enc = [toy.embed_caption(p, config.data.txt_len, fp.context_in_dim, fp.vec_in_dim) for p in prompts]
        return prompts, np.stack([e[0] for e in enc]), np.stack([e[1] for e in enc]), size
    if prompts:
        raise UserError(
            "--prompt only works with data.source='toy'; real prompts need stored T5/CLIP encodings"
        )
    from flux_jax import setup

    pipeline = setup.make_pipeline(config, "val", 0, 1, fp=fp, per_host_batch=num_images)
    try:
        batch = next(iter(pipeline))
    finally:
        pipeline.close()  # stops loader workers and frees their shared memory
    names = [f"val[{i}]" for i in range(num_images)]
    return names, np.asarray(batch["txt"]), np.asarray(batch["y"]), size


def _empty_caption(config, fp, txt, y):
    """The encodings training swapped in for dropped captions: stored ones for shards, else zeros."""
    if config.data.source == "shards":
        from flux_jax import data, shards

        t5, clip = shards.read_empty_encodings(
            config.data.path, data.record_spec(config, fp.context_in_dim, fp.vec_in_dim)
        )
        return jnp.asarray(t5)[None], jnp.asarray(clip)[None]
    # The toy and mock pipelines drop captions by zeroing txt and y.
    return jnp.zeros_like(txt[:1]), jnp.zeros_like(y[:1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flux_jax.sample")
    parser.add_argument("--workdir", required=True, help="training workdir holding checkpoints/")
    parser.add_argument("--config", required=True, help="configs/NAME.py[:arg] the run used")
    parser.add_argument("--out", required=True, help="directory for the PNGs")
    parser.add_argument("--num_steps", type=int, default=None, help="default: 4 (no shift) or 50")
    parser.add_argument("--num_images", type=int, default=8)
    parser.add_argument("--prompt", action="append", default=None, help="toy caption (repeatable)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--guidance", type=float, default=3.5, help="guidance for guidance_embed models")
    parser.add_argument(
        "--shift", choices=("auto", "on", "off"), default="auto", help="auto: on for guidance models"
    )
    parser.add_argument(
        "--ae", default=None, help="BFL ae.safetensors or diffusers vae folder (non-toy data)"
    )
    parser.add_argument("--cfg_scale", type=float, default=1.0, help=">1: CFG against empty (zero) captions")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from flux_jax import checkpoint, model, setup, toy

    config = load_config(args.config)
    if not os.path.isdir(args.workdir):
        raise UserError(
            f"--workdir {args.workdir} does not exist, so it has no checkpoints to sample from: train "
            f"there first (python -m flux_jax.train --config {args.config} --workdir {args.workdir}) or "
            "point --workdir at a run directory."
        )
    ckpt = checkpoint.Checkpointer(args.workdir, config)
    saved_steps = ckpt.all_steps()
    if not saved_steps:
        raise UserError(
            f"--workdir {args.workdir} has no checkpoints (looked in {ckpt.directory}): train there first "
            f"(python -m flux_jax.train --config {args.config} --workdir {args.workdir}) or point --workdir "
            "at a run directory."
        )
    step = args.step if args.step is not None else max(saved_steps)
    if step not in saved_steps:
        raise UserError(f"--step {step}: no such checkpoint in {ckpt.directory}; saved steps: {saved_steps}")
    step_dir = ckpt.directory / str(step)
    saved = _saved_config(step_dir)
    # The checkpoint's own config wins: it records command-line overrides the file does not.
    config = ml_collections.ConfigDict(saved) if saved else config
    if not args.ae and config.data.source != "toy":
        raise UserError(
            f"data.source={config.data.source!r} latents need a real decoder: pass --ae (BFL "
            "ae.safetensors or a diffusers vae folder)"
        )
    fp = setup.flux_params(config)
    params = checkpoint.read_params(step_dir)
    flux = model.Flux(fp, dtype=jnp.dtype(config.model.dtype), scan_blocks=bool(config.model.scan_blocks))

    prompts = args.prompt[: args.num_images] if args.prompt else None
    prompts, txt, y, size = _conditioning(config, fp, args.num_images, prompts)
    n = len(prompts)
    seq_len = (size // 2) ** 2
    shift = fp.guidance_embed if args.shift == "auto" else args.shift == "on"
    num_steps = args.num_steps or (50 if shift else 4)
    noise = jax.random.normal(jax.random.key(args.seed), (n, seq_len, fp.in_channels), jnp.float32)
    uncond = None if args.cfg_scale == 1.0 else _empty_caption(config, fp, txt, y)
    img_ids = jnp.broadcast_to(jnp.asarray(latents.image_ids(size, size)), (n, seq_len, 3))
    out = denoise(
        flux_apply_fn(flux),
        {"params": params},
        noise,
        img_ids,
        jnp.asarray(txt),
        jnp.zeros((n, txt.shape[1], 3), jnp.float32),
        jnp.asarray(y),
        get_schedule(num_steps, seq_len, shift),
        args.guidance if fp.guidance_embed else None,
        uncond,
        args.cfg_scale,
    )
    unpacked = np.asarray(latents.unpack(out, size, size))
    if args.ae:
        from flux_jax import autoencoder

        ae_params, ae_vars = autoencoder.load_autoencoder(args.ae)
        images = (np.asarray(autoencoder.decode_nchw(ae_vars, unpacked, ae_params)) + 1.0) / 2.0
        note = ""
    else:
        # The toy data has no VAE: its images are the latents through a fixed colour map, at latent
        # resolution. Each latent pixel becomes an 8x8 block, the size a VAE would decode it to.
        factor = config.data.image_size // size
        images = upscale(toy.decode(unpacked), factor)
        note = (
            f" (toy decoder: {size}x{size} latents shown as {images.shape[1]}x{images.shape[2]} images, "
            f"each latent pixel as an {factor}x{factor} block)"
        )
    if jax.process_index() == 0:  # every process of a multi-process job computed the same images
        paths = write_images(args.out, images, prompts)
        print(f"step {step}: {n} samples, {num_steps} steps, shift={shift} -> {paths[-2]}{note}")


if __name__ == "__main__":
    cli.run(main)
