import numpy as np
import pytest

from flux_jax import prepare, shards

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

SPEC = shards.RecordSpec(latent_shape=(16, 2, 2), txt_len=4, t5_dim=32, clip_dim=16)


def _table(n, offset=0):
    rows = np.arange(offset, offset + n, dtype=np.float32)
    return pa.table(
        {
            "t5_encodings": [np.full(4 * 32, r).tolist() for r in rows],
            "clip_encodings": [np.full(16, r).tolist() for r in rows],
            "mean": [np.full(64, r).tolist() for r in rows],
            "logvar": [np.full(64, -r).tolist() for r in rows],
        }
    )


def _arrow_args(tmp_path, *extra):
    return [
        "arrow",
        str(tmp_path / "in"),
        "--out",
        str(tmp_path / "out"),
        "--records-per-shard",
        "3",
        "--image-size",
        "16",
        "--txt-len",
        "4",
        "--t5-dim",
        "32",
        "--clip-dim",
        "16",
        *extra,
    ]


def test_arrow_to_shards_and_resume(tmp_path):
    (tmp_path / "in").mkdir()
    pq.write_table(_table(4), tmp_path / "in" / "a.parquet")
    pq.write_table(_table(3, offset=4), tmp_path / "in" / "b.parquet")
    pq.write_table(_table(1, offset=-1), tmp_path / "empty.parquet")
    prepare.main(_arrow_args(tmp_path, "--empty", str(tmp_path / "empty.parquet")))
    src = shards.ShardSource(tmp_path / "out", SPEC)
    assert len(src) == 7 and len(src.paths) == 3
    for i in range(7):
        assert np.all(src[i]["mean"] == i) and np.all(src[i]["logvar"] == -i)
    t5, _ = shards.read_empty_encodings(tmp_path / "out", SPEC)
    assert np.all(t5 == -1)
    (tmp_path / "out" / shards.shard_name(1)).unlink()
    before = (tmp_path / "out" / shards.shard_name(0)).stat().st_mtime_ns
    assert (
        prepare.write_shards(
            prepare.arrow_samples(prepare._arrow_files([str(tmp_path / "in")]), SPEC), tmp_path / "out", 3
        )
        == 1
    )
    assert (tmp_path / "out" / shards.shard_name(0)).stat().st_mtime_ns == before
    assert np.all(shards.ShardSource(tmp_path / "out", SPEC)[4]["mean"] == 4)


def test_arrow_bad_column(tmp_path):
    (tmp_path / "in").mkdir()
    pq.write_table(_table(2).drop_columns(["logvar"]), tmp_path / "in" / "a.parquet")
    with pytest.raises(ValueError, match="missing columns \\['logvar'\\]"):
        prepare.main(_arrow_args(tmp_path))
    pq.write_table(
        _table(2).drop_columns(["logvar"]).append_column("logvar", pa.array([[1.0], [2.0]])),
        tmp_path / "in" / "a.parquet",
    )
    with pytest.raises(ValueError, match="a.parquet row 0: column 'logvar'"):
        prepare.main(_arrow_args(tmp_path))


def _tiny_models(root):
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(8, 8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=16,
        layers_per_block=1,
        norm_num_groups=4,
    )
    vae.save_pretrained(root / "vae")
    vocab = {"[PAD]": 0, "[UNK]": 1, "</s>": 2, "a": 3, "red": 4, "cat": 5, "blue": 6, "dog": 7}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="</s>"
    )
    t5 = transformers.T5EncoderModel(
        transformers.T5Config(vocab_size=8, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    )
    clip = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            vocab_size=8,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=8,
            eos_token_id=2,
            pad_token_id=0,
        )
    )
    for name, model in (("t5", t5), ("clip", clip)):
        model.save_pretrained(root / name)
        fast.save_pretrained(root / name)


def test_images_to_shards_and_resume(tmp_path):
    PIL = pytest.importorskip("PIL.Image")
    _tiny_models(tmp_path)
    img_dir = tmp_path / "imgs"
    img_dir.mkdir()
    rng = np.random.default_rng(0)
    for i, caption in enumerate(["a red cat", "a blue dog", "", "red dog"]):
        PIL.fromarray(rng.integers(0, 255, (20 + i, 16, 3), dtype=np.uint8)).save(img_dir / f"im{i}.png")
        (img_dir / f"im{i}.txt").write_text(caption)
    out = tmp_path / "out"
    args = [
        "images",
        str(img_dir),
        "--out",
        str(out),
        "--vae",
        str(tmp_path / "vae"),
        "--t5",
        str(tmp_path / "t5"),
        "--clip",
        str(tmp_path / "clip"),
        "--image-size",
        "16",
        "--txt-len",
        "4",
        "--records-per-shard",
        "3",
        "--batch-size",
        "2",
    ]
    prepare.main(args)
    src = shards.ShardSource(out, SPEC)
    assert len(src) == 4 and [src[i]["id"] for i in range(4)] == ["im0", "im1", "im2", "im3"]
    assert src[1]["caption"] == "a blue dog" and np.all(np.isfinite(src[1]["t5_encodings"]))
    assert not np.array_equal(src[0]["mean"], src[1]["mean"])
    t5_empty, _ = shards.read_empty_encodings(out, SPEC)
    assert not np.allclose(t5_empty, src[0]["t5_encodings"])
    first = (out / shards.shard_name(0)).read_bytes()
    (out / shards.shard_name(1)).unlink()
    prepare.main(args)
    assert (out / shards.shard_name(0)).read_bytes() == first and len(shards.ShardSource(out, SPEC)) == 4
    (img_dir / "im0.txt").unlink()
    with pytest.raises(ValueError, match="im0.png has no caption file"):
        prepare.main(args)
