import numpy as np
import pytest

from flux_jax import shards

SPEC = shards.RecordSpec(latent_shape=(16, 4, 4), txt_len=8, t5_dim=32, clip_dim=16)


def _sample(i, **overrides):
    rng = np.random.default_rng(i)
    s = {
        "id": f"s{i}",
        "caption": f"caption {i}",
        "mean": rng.standard_normal((16, 4, 4)).astype(np.float32),
        "logvar": rng.standard_normal((16, 4, 4)).astype(np.float16),
        "t5_encodings": rng.standard_normal((8, 32)).astype(np.float32),
        "clip_encodings": rng.standard_normal(16).astype(np.float32),
    }
    s.update(overrides)
    return {k: v for k, v in s.items() if v is not None}


def _write(tmp_path, samples_per_shard):
    for i, samples in enumerate(samples_per_shard):
        shards.write_shard(tmp_path / shards.shard_name(i), samples)
    return tmp_path


def test_roundtrip_across_shards(tmp_path):
    samples = [_sample(i) for i in range(5)]
    _write(tmp_path, [samples[:3], samples[3:]])
    src = shards.ShardSource(tmp_path, SPEC)
    assert len(src) == 5
    for i, s in enumerate(samples):
        rec = src[i]
        assert rec["id"] == s["id"] and rec["caption"] == s["caption"]
        np.testing.assert_array_equal(rec["mean"], s["mean"])
        assert rec["logvar"].dtype == np.float16
        np.testing.assert_array_equal(rec["t5_encodings"], s["t5_encodings"])
    assert src.locate(4) == (1, 1)


def test_latent_only_and_timestep(tmp_path):
    s = _sample(0, mean=None, logvar=None, latent=np.ones((16, 4, 4), np.float32), timestep=5)
    _write(tmp_path, [[s]])
    rec = shards.ShardSource(tmp_path, SPEC)[0]
    assert rec["timestep"] == 5 and "mean" not in rec
    np.testing.assert_array_equal(rec["latent"], s["latent"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"t5_encodings": None}, "missing field 't5_encodings'"),
        ({"logvar": None}, "missing field 'mean'"),
        ({"clip_encodings": np.zeros(15, np.float32)}, "'clip_encodings' has shape"),
        ({"mean": np.zeros((16, 4, 5), np.float32)}, "'mean' has shape"),
    ],
)
def test_bad_record_names_shard_and_index(tmp_path, overrides, message):
    _write(tmp_path, [[_sample(0), _sample(1, **overrides)]])
    src = shards.ShardSource(tmp_path, SPEC)
    src[0]
    with pytest.raises(ValueError, match=message) as e:
        src[1]
    assert "shard-00000.array_record record 1" in str(e.value)


def test_wrong_dtype_rejected_on_write_and_read(tmp_path):
    with pytest.raises(ValueError, match="dtype int32"):
        shards.encode_record(_sample(0, mean=np.zeros((16, 4, 4), np.int32)))
    raw = shards.encode_record(_sample(0))
    bad = raw.replace(b"float16", b"int16\x00\x00"[:7])
    with pytest.raises(ValueError, match="f.shard record 3"):
        shards.decode_record(bad, SPEC, "f.shard record 3")


def test_truncated_shard(tmp_path):
    _write(tmp_path, [[_sample(i) for i in range(4)]])
    path = tmp_path / shards.shard_name(0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])
    with pytest.raises(ValueError, match="shard-00000.array_record"):
        shards.ShardSource(tmp_path, SPEC)


def test_corrupt_record_bytes():
    with pytest.raises(ValueError, match="x record 0"):
        shards.decode_record(b"\xc1\xc1garbage", SPEC, "x record 0")


def test_missing_directory_and_empty_encodings(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        shards.list_shards(tmp_path / "nope")
    with pytest.raises(ValueError, match="no \\*.array_record"):
        shards.list_shards(tmp_path)
    with pytest.raises(ValueError, match="empty_encodings.npz is missing"):
        shards.read_empty_encodings(tmp_path, SPEC)
    shards.write_empty_encodings(tmp_path, np.ones((8, 32)), np.zeros(16))
    t5, clip = shards.read_empty_encodings(tmp_path, SPEC)
    assert t5.shape == (8, 32) and clip.shape == (16,) and t5.dtype == np.float32
    with pytest.raises(ValueError, match="check data.txt_len"):
        shards.read_empty_encodings(tmp_path, shards.RecordSpec((16, 4, 4), 9, 32, 16))
