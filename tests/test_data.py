import ml_collections
import numpy as np
import pytest

from flux_jax import data, shards

SPEC = shards.RecordSpec(latent_shape=(16, 4, 4), txt_len=8, t5_dim=32, clip_dim=16)


def _config(path="", source="shards", **data_overrides):
    c = ml_collections.ConfigDict()
    c.seed = 3
    c.global_batch_size = 4
    c.model = ml_collections.ConfigDict(
        {"preset": "none", "context_in_dim": 32, "vec_in_dim": 16, "dtype": "float32"}
    )
    c.data = ml_collections.ConfigDict(
        {
            "source": source,
            "path": str(path),
            "val_path": str(path),
            "image_size": 32,
            "txt_len": 8,
            "cfg_dropout_prob": 0.0,
            "num_workers": 0,
            "shuffle": True,
        }
    )
    c.data.update(data_overrides)
    return c


def _pipeline(config, split, process_index, process_count, **kwargs):
    dims = dict(context_in_dim=config.model.context_in_dim, vec_in_dim=config.model.vec_in_dim)
    return data.make_pipeline(config, split, process_index, process_count, **dims, **kwargs)


def _write_dataset(tmp_path, n=12, with_timestep=False):
    rng = np.random.default_rng(0)
    samples = []
    for i in range(n):
        s = {
            "id": str(i),
            "mean": np.full((16, 4, 4), float(i), np.float32),
            "logvar": np.full((16, 4, 4), -30.0, np.float32),
            "t5_encodings": np.full((8, 32), float(i), np.float32),
            "clip_encodings": rng.standard_normal(16).astype(np.float32),
        }
        if with_timestep:
            s["timestep"] = 7 - i % 8
        samples.append(s)
    shards.write_shard(tmp_path / shards.shard_name(0), samples[: n // 2])
    shards.write_shard(tmp_path / shards.shard_name(1), samples[n // 2 :])
    shards.write_empty_encodings(tmp_path, np.full((8, 32), -1.0), np.full(16, -1.0))
    return tmp_path


def _record_ids(batch):
    # Every latent value of record i is i before scaling, so the id is recoverable from img.
    return np.round(batch["img"][:, 0, 0] / data.VAE_SCALE + data.VAE_SHIFT).astype(int)


def test_resample_statistics():
    rng = np.random.default_rng(0)
    mean = np.full((16, 64, 64), 2.0, np.float32)
    z = data.resample_latent(mean, np.full_like(mean, np.log(0.25)), rng)
    assert abs(z.mean() - 2.0) < 0.01 and abs(z.std() - 0.5) < 0.01
    np.testing.assert_allclose(data.scale_latent(np.array([1.1159])), [0.3611], rtol=1e-6)


def test_txt_leaves_in_the_model_compute_dtype(tmp_path):
    # BF16 models get BF16 T5 embeddings: the same bits the model's own cast of the float32 batch gives.
    import jax.numpy as jnp

    path = _write_dataset(tmp_path)
    f32 = next(_pipeline(_config(path), "train", 0, 1, per_host_batch=4))
    config = _config(path)
    config.model.dtype = "bfloat16"
    b16 = next(_pipeline(config, "train", 0, 1, per_host_batch=4))
    assert f32["txt"].dtype == np.float32 and b16["txt"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(b16["txt"], np.asarray(jnp.asarray(f32["txt"]).astype(jnp.bfloat16)))
    for key in ("img", "img_ids", "txt_ids", "y"):
        assert b16[key].dtype == np.float32
        np.testing.assert_array_equal(b16[key], f32[key])


def test_batch_contract_and_order_covers_epoch(tmp_path):
    it = _pipeline(_config(_write_dataset(tmp_path)), "train", 0, 1, per_host_batch=4)
    batches = [next(it) for _ in range(3)]
    b = batches[0]
    assert b["img"].shape == (4, 4, 64) and b["img"].dtype == np.float32
    assert b["img_ids"].shape == (4, 4, 3) and b["txt"].shape == (4, 8, 32)
    assert b["txt_ids"].shape == (4, 8, 3) and not b["txt_ids"].any() and b["y"].shape == (4, 16)
    ids = np.concatenate([_record_ids(x) for x in batches])
    assert sorted(ids) == list(range(12)), "one epoch must visit each record once"
    np.testing.assert_array_equal(batches[0]["txt"][:, 0, 0], _record_ids(batches[0]))
    epoch2 = np.concatenate([_record_ids(next(it)) for _ in range(3)])
    assert sorted(epoch2) == list(range(12)) and not np.array_equal(ids, epoch2)


def test_state_restore_and_hosts_disjoint(tmp_path):
    cfg = _config(_write_dataset(tmp_path))
    it = _pipeline(cfg, "train", 0, 1, per_host_batch=2)
    next(it)
    state = it.get_state()
    expected = [next(it)["img"] for _ in range(2)]
    fresh = _pipeline(cfg, "train", 0, 1, per_host_batch=2)
    fresh.set_state(state)
    for e in expected:
        np.testing.assert_array_equal(next(fresh)["img"], e)
    hosts = [_pipeline(cfg, "train", p, 2, per_host_batch=2) for p in range(2)]
    seen = [np.concatenate([_record_ids(next(h)) for _ in range(3)]) for h in hosts]
    assert not set(seen[0]) & set(seen[1]) and len(set(seen[0]) | set(seen[1])) == 12


def test_cfg_dropout(tmp_path):
    path = _write_dataset(tmp_path)
    it = _pipeline(_config(path, cfg_dropout_prob=1.0), "train", 0, 1, per_host_batch=4)
    b = next(it)
    assert np.all(b["txt"] == -1.0) and np.all(b["y"] == -1.0)
    it = _pipeline(_config(path, cfg_dropout_prob=0.5), "train", 0, 1, per_host_batch=4)
    dropped = [np.all(next(it)["y"] == -1.0, axis=1) for _ in range(12)]
    frac = np.concatenate(dropped).mean()
    assert 0.25 < frac < 0.75
    val = next(_pipeline(_config(path, cfg_dropout_prob=1.0), "val", 0, 1, per_host_batch=4))
    assert not np.any(val["y"] == -1.0)


def test_validation_split_timesteps(tmp_path):
    path = _write_dataset(tmp_path / "a")
    val = list(_pipeline(_config(path), "val", 0, 1, per_host_batch=4))
    assert len(val) == 3
    np.testing.assert_array_equal(np.concatenate([_record_ids(b) for b in val]), np.arange(12))
    np.testing.assert_array_equal(np.concatenate([b["timestep"] for b in val]), np.arange(12) % 8)
    path = _write_dataset(tmp_path / "b", with_timestep=True)
    b = next(_pipeline(_config(path), "val", 0, 1, per_host_batch=4))
    np.testing.assert_array_equal(b["timestep"], [7, 6, 5, 4])


def test_mock_real_shapes():
    cfg = _config(source="mock", image_size=256, txt_len=256)
    cfg.model.context_in_dim, cfg.model.vec_in_dim = 4096, 768
    it = _pipeline(cfg, "train", 0, 1, per_host_batch=2, mock_records=8)
    b = next(it)
    assert b["img"].shape == (2, 256, 64) and b["txt"].shape == (2, 256, 4096) and b["y"].shape == (2, 768)
    again = next(_pipeline(cfg, "train", 0, 1, per_host_batch=2, mock_records=8))
    np.testing.assert_array_equal(b["img"], again["img"])


def test_user_errors(tmp_path):
    with pytest.raises(ValueError, match="data.path is empty"):
        _pipeline(_config(""), "train", 0, 1)
    with pytest.raises(ValueError, match="data.source='bogus'"):
        _pipeline(_config(source="bogus"), "train", 0, 1)
    with pytest.raises(ValueError, match="data.image_size=40"):
        _pipeline(_config(tmp_path, image_size=40), "train", 0, 1)
    path = _write_dataset(tmp_path)
    with pytest.raises(ValueError, match="check data.image_size"):
        next(_pipeline(_config(path, image_size=64), "train", 0, 1))
    with pytest.raises(ValueError, match="global_batch_size=4 is not divisible"):
        _pipeline(_config(path), "train", 0, 3)


def test_worker_processes_match_in_process(tmp_path):
    path = _write_dataset(tmp_path)
    ref = _pipeline(_config(path), "train", 0, 1, per_host_batch=2)
    it = _pipeline(_config(path, num_workers=1), "train", 0, 1, per_host_batch=2)
    try:
        for _ in range(3):
            np.testing.assert_array_equal(next(it)["img"], next(ref)["img"])
    finally:
        it.close()
