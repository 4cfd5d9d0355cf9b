"""Writes embedding shards (flux_jax.shards format) for data.source="shards".

    # (a) MLPerf preprocessed Arrow/Parquet files (columns t5_encodings, clip_encodings, mean, logvar)
    python -m flux_jax.prepare arrow --out DIR [--empty EMPTY.parquet] FILE_OR_DIR...
    # (b) a folder of images with captions in NAME.txt beside NAME.jpg
    python -m flux_jax.prepare images --out DIR --vae VAE_DIR --t5 T5_DIR --clip CLIP_DIR IMAGE_DIR

Shard k always holds input items [k * records_per_shard, (k + 1) * records_per_shard), and a shard
file only exists once complete, so rerunning the same command resumes where it stopped.
"""

import argparse
import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from flux_jax import cli, shards
from flux_jax.errors import UserError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
ARROW_COLUMNS = ("t5_encodings", "clip_encodings", "mean", "logvar")


def _to_array(value, shape: tuple[int, ...], column: str, where: str) -> np.ndarray:
    x = np.asarray(value, np.float32)
    if x.size != int(np.prod(shape)):
        raise UserError(f"{where}: column {column!r} has {x.size} values, expected shape {shape}")
    return x.reshape(shape)


def _arrow_files(inputs: list[str]) -> list[Path]:
    files = []
    for item in map(Path, inputs):
        files += (
            sorted(p for p in item.rglob("*") if p.suffix in (".parquet", ".arrow"))
            if item.is_dir()
            else [item]
        )
    if not files:
        raise UserError(f"no .parquet/.arrow files found in {inputs}")
    return files


def _arrow_batches(path: Path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise UserError("reading Arrow/Parquet needs pyarrow: `pip install pyarrow`") from e
    if path.suffix == ".parquet":
        yield from pq.ParquetFile(path).iter_batches(batch_size=64)
    else:
        with pa.memory_map(str(path)) as source:
            try:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                batches = pa.ipc.open_stream(source)
            yield from batches


def arrow_samples(files: list[Path], spec: shards.RecordSpec) -> Iterator[dict]:
    """Rows of MLPerf preprocessed files as shard samples, in file order."""
    shapes = {
        "t5_encodings": (spec.txt_len, spec.t5_dim),
        "clip_encodings": (spec.clip_dim,),
        "mean": spec.latent_shape,
        "logvar": spec.latent_shape,
    }
    for path in files:
        row = 0
        for batch in _arrow_batches(path):
            missing = [c for c in ARROW_COLUMNS if c not in batch.schema.names]
            if missing:
                raise UserError(f"{path}: missing columns {missing}; MLPerf files have {ARROW_COLUMNS}")
            cols = {c: batch.column(c).to_pylist() for c in ARROW_COLUMNS}
            extra = {
                c: batch.column(c).to_pylist()
                for c in ("caption", "id", "timestep")
                if c in batch.schema.names
            }
            for i in range(batch.num_rows):
                where = f"{path} row {row}"
                sample = {c: _to_array(cols[c][i], shapes[c], c, where) for c in ARROW_COLUMNS}
                sample["id"] = str(extra["id"][i]) if "id" in extra else f"{path.stem}-{row}"
                sample["caption"] = str(extra.get("caption", [""] * batch.num_rows)[i] or "")
                if "timestep" in extra:
                    sample["timestep"] = int(extra["timestep"][i])
                yield sample
                row += 1


def write_shards(samples: Iterator[dict], out: Path, records_per_shard: int, total: int | None = None) -> int:
    """Writes consecutive chunks of `samples`, skipping (but consuming) shards already on disk."""
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    with tqdm(total=total, unit="rec", desc=f"shards -> {out}") as bar:
        for k in itertools.count():
            chunk = list(itertools.islice(samples, records_per_shard))
            if not chunk:
                break
            path = out / shards.shard_name(k)
            if not path.exists():
                shards.write_shard(path, chunk)
                written += 1
            bar.update(len(chunk))
    return written


class Encoders:
    """Frozen VAE, T5 and CLIP text encoders loaded from local folders (diffusers/transformers)."""

    def __init__(self, vae: str, t5: str, clip: str, txt_len: int, device: str = "cpu"):
        import torch
        from diffusers import AutoencoderKL
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        self.torch, self.device, self.txt_len = torch, device, txt_len
        self.vae = AutoencoderKL.from_pretrained(vae).to(device).eval()
        self.t5 = T5EncoderModel.from_pretrained(t5).to(device).eval()
        self.clip = CLIPTextModel.from_pretrained(clip).to(device).eval()
        self.t5_tok = AutoTokenizer.from_pretrained(t5)
        self.clip_tok = AutoTokenizer.from_pretrained(clip)

    def encode_text(self, captions: list[str]) -> tuple[np.ndarray, np.ndarray]:
        with self.torch.no_grad():
            t = self.t5_tok(
                captions, padding="max_length", max_length=self.txt_len, truncation=True, return_tensors="pt"
            )
            t5 = self.t5(input_ids=t["input_ids"].to(self.device)).last_hidden_state
            max_clip = self.clip.config.max_position_embeddings
            c = self.clip_tok(
                captions, padding="max_length", max_length=max_clip, truncation=True, return_tensors="pt"
            )
            clip = self.clip(input_ids=c["input_ids"].to(self.device)).pooler_output
        return t5.float().cpu().numpy(), clip.float().cpu().numpy()

    def encode_images(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """images (B, H, W, 3) uint8 -> VAE posterior mean, logvar (B, C, H/8, W/8)."""
        x = self.torch.from_numpy(images).permute(0, 3, 1, 2).float().div(127.5).sub(1.0).to(self.device)
        with self.torch.no_grad():
            dist = self.vae.encode(x).latent_dist
        return dist.mean.float().cpu().numpy(), dist.logvar.float().cpu().numpy()


def _load_image(path: Path, size: int) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        scale = size / min(im.size)
        im = im.resize(
            (max(size, round(im.width * scale)), max(size, round(im.height * scale))), Image.BICUBIC
        )
        left, top = (im.width - size) // 2, (im.height - size) // 2
        return np.asarray(im.crop((left, top, left + size, top + size)), np.uint8)


def image_items(folder: Path) -> list[tuple[Path, str]]:
    if not folder.is_dir():
        raise UserError(f"image folder {folder} does not exist")
    items = []
    for p in sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES):
        txt = p.with_suffix(".txt")
        if not txt.is_file():
            raise UserError(f"{p} has no caption file {txt}: write one (it may be empty)")
        items.append((p, txt.read_text().strip()))
    if not items:
        raise UserError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {folder}")
    return items


def image_samples(items, enc: Encoders, size: int, batch_size: int, skip: int = 0) -> Iterator[dict]:
    for start in range(skip, len(items), batch_size):
        chunk = items[start : start + batch_size]
        mean, logvar = enc.encode_images(np.stack([_load_image(p, size) for p, _ in chunk]))
        t5, clip = enc.encode_text([c for _, c in chunk])
        for i, (p, caption) in enumerate(chunk):
            yield {
                "id": p.stem,
                "caption": caption,
                "mean": mean[i],
                "logvar": logvar[i],
                "t5_encodings": t5[i],
                "clip_encodings": clip[i],
            }


def prepare_images(args) -> int:
    items = image_items(Path(args.input[0]))
    out = Path(args.out)
    complete = 0
    while (out / shards.shard_name(complete)).exists():
        complete += 1
    skip = min(complete * args.records_per_shard, len(items))
    enc = Encoders(args.vae, args.t5, args.clip, args.txt_len, args.device)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / shards.EMPTY_ENCODINGS).exists():
        t5, clip = enc.encode_text([""])
        shards.write_empty_encodings(out, t5[0], clip[0])
    # Encoding is the expensive part, so finished shards are skipped before encoding, not after.
    samples = itertools.chain(
        iter([{}] * skip), image_samples(items, enc, args.image_size, args.batch_size, skip)
    )
    return write_shards(samples, out, args.records_per_shard, total=len(items))


def prepare_arrow(args) -> int:
    spec = shards.RecordSpec(
        (16, args.image_size // 8, args.image_size // 8), args.txt_len, args.t5_dim, args.clip_dim
    )
    out = Path(args.out)
    if args.empty:
        row = next(iter(_arrow_batches(Path(args.empty))))
        t5 = _to_array(
            row.column("t5_encodings").to_pylist()[0], (spec.txt_len, spec.t5_dim), "t5_encodings", args.empty
        )
        clip = _to_array(
            row.column("clip_encodings").to_pylist()[0], (spec.clip_dim,), "clip_encodings", args.empty
        )
        out.mkdir(parents=True, exist_ok=True)
        shards.write_empty_encodings(out, t5, clip)
    return write_shards(arrow_samples(_arrow_files(args.input), spec), out, args.records_per_shard)


_EPILOG = """\
Examples:
  python -m flux_jax.prepare arrow --out data/train --empty empty.parquet mlperf/train/
  python -m flux_jax.prepare images --out data/train --vae sd-vae/ --t5 t5-v1_1-xxl/ \\
      --clip clip-vit-large-patch14/ --image-size 256 photos/

Then train with --config.data.source=shards --config.data.path=data/train (and data.val_path for
validation shards written the same way). Rerunning the same command resumes: complete shards are kept.
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m flux_jax.prepare",
        description=__doc__.split("\n")[0],
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "mode",
        choices=("arrow", "images"),
        help="arrow: convert MLPerf preprocessed Arrow/Parquet files (T5/CLIP encodings and VAE latents "
        "already computed); images: encode a folder of images with captions (NAME.txt beside NAME.jpg)",
    )
    p.add_argument(
        "input", nargs="+", help="arrow: .parquet/.arrow files or folders of them; images: one image folder"
    )
    p.add_argument("--out", required=True, help="shard folder to write (use it as config data.path)")
    p.add_argument(
        "--records-per-shard", type=int, default=1024, help="samples per shard file (default 1024)"
    )
    p.add_argument(
        "--image-size",
        type=int,
        default=256,
        help="pixels, a multiple of 16; must equal the training config's data.image_size (default 256)",
    )
    p.add_argument(
        "--txt-len", type=int, default=256, help="T5 tokens per caption; = config data.txt_len (default 256)"
    )
    p.add_argument(
        "--t5-dim", type=int, default=4096, help="T5 embedding width; = the model's context_in_dim (4096)"
    )
    p.add_argument(
        "--clip-dim", type=int, default=768, help="pooled CLIP width; = the model's vec_in_dim (768)"
    )
    p.add_argument(
        "--empty",
        help="arrow: a Parquet/Arrow file whose first row holds the empty-prompt T5/CLIP encodings, "
        "used for caption dropout (data.cfg_dropout_prob > 0); images mode encodes them itself",
    )
    p.add_argument("--vae", help="images: local diffusers AutoencoderKL folder (required for images)")
    p.add_argument("--t5", help="images: local T5EncoderModel + tokenizer folder (required for images)")
    p.add_argument("--clip", help="images: local CLIPTextModel + tokenizer folder (required for images)")
    p.add_argument("--batch-size", type=int, default=16, help="images: images encoded at once (default 16)")
    p.add_argument(
        "--device",
        default="cpu",
        help="images: torch device for the encoders, e.g. cpu or cuda (default cpu)",
    )
    args = p.parse_args(argv)
    if args.mode == "images" and not (args.vae and args.t5 and args.clip):
        p.error("images mode needs --vae, --t5 and --clip")
    if args.image_size % 16:
        p.error(f"--image-size={args.image_size} must be a multiple of 16")
    for name in ("records_per_shard", "batch_size", "txt_len", "t5_dim", "clip_dim", "image_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    n = prepare_arrow(args) if args.mode == "arrow" else prepare_images(args)
    print(f"wrote {n} new shard(s) to {args.out}")


if __name__ == "__main__":
    cli.run(main)
