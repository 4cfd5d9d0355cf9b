import numpy as np
import pytest

from flux_jax import toy


def _pipe(**kw):
    args = dict(
        seed=0, split="train", batch_size=8, image_size=64, txt_len=6, context_in_dim=16, vec_in_dim=12
    )
    return toy.ToyPipeline(**(args | kw))


def test_batch_contract():
    b = next(_pipe())
    assert b["img"].shape == (8, 16, 64) and b["img"].dtype == np.float32
    assert b["img_ids"].shape == (8, 16, 3)
    assert b["txt"].shape == (8, 6, 16) and b["txt_ids"].shape == (8, 6, 3)
    assert b["y"].shape == (8, 12)
    assert not b["txt_ids"].any()
    ids = b["img_ids"][0].reshape(4, 4, 3)
    np.testing.assert_array_equal(ids[..., 0], 0)
    np.testing.assert_array_equal(ids[..., 1], np.repeat(np.arange(4)[:, None], 4, 1))
    np.testing.assert_array_equal(ids[..., 2], np.repeat(np.arange(4)[None, :], 4, 0))
    assert "timestep" not in b


def test_txt_in_the_model_compute_dtype():
    import jax.numpy as jnp

    f32 = next(_pipe(cfg_dropout_prob=0.5))
    b16 = next(_pipe(cfg_dropout_prob=0.5, txt_dtype="bfloat16"))
    assert f32["txt"].dtype == np.float32 and b16["txt"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(b16["txt"], np.asarray(jnp.asarray(f32["txt"]).astype(jnp.bfloat16)))
    np.testing.assert_array_equal(b16["y"], f32["y"])


def test_deterministic_and_resumable():
    a, b = _pipe(), _pipe()
    first = [next(a) for _ in range(3)]
    second = [next(b) for _ in range(3)]
    for x, y in zip(first, second):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert not np.array_equal(first[0]["img"], first[1]["img"])
    c = _pipe()
    c.set_state(a.get_state() | {"step": 1})
    np.testing.assert_array_equal(next(c)["img"], first[1]["img"])
    assert a.get_state() == {"step": 3}


def test_val_split_differs_and_carries_timesteps():
    train, val = next(_pipe()), next(_pipe(split="val", cfg_dropout_prob=1.0))
    assert not np.array_equal(train["img"], val["img"])
    np.testing.assert_array_equal(val["timestep"], np.arange(8) % 8)
    # Validation never drops captions.
    assert np.abs(val["txt"]).sum(axis=(1, 2)).min() > 0


def test_cfg_dropout_zeroes_whole_captions():
    b = next(_pipe(batch_size=256, cfg_dropout_prob=0.25))
    dropped = np.abs(b["txt"]).sum(axis=(1, 2)) == 0
    np.testing.assert_array_equal(dropped, np.abs(b["y"]).sum(axis=1) == 0)
    assert 0.15 < dropped.mean() < 0.35


def test_drawn_colour_decodes_back():
    latent = toy.draw_latent("red circle center", 16, np.random.default_rng(0))
    rgb = toy.decode(latent)
    np.testing.assert_allclose(rgb[8, 8], toy.COLOURS["red"], atol=1e-5)
    np.testing.assert_allclose(rgb[0, 0], 0.0)
    top_left = toy.draw_latent("blue square top-left", 16, np.random.default_rng(0))
    mass = np.abs(top_left).sum(axis=0)
    assert mass[:8, :8].sum() > 10 * mass[8:, 8:].sum()


def test_caption_embeddings_distinguish_captions():
    a = toy.embed_caption("red circle center", 4, 16, 8)
    b = toy.embed_caption("red square center", 4, 16, 8)
    np.testing.assert_array_equal(a[0][0], b[0][0])  # shared word "red"
    assert not np.array_equal(a[0][1], b[0][1])
    np.testing.assert_array_equal(a[0][3], 0.0)  # padding
    with pytest.raises(ValueError, match="txt_len"):
        toy.embed_caption("red circle center", 2, 16, 8)


def test_bad_image_size_names_field():
    with pytest.raises(ValueError, match="image_size"):
        _pipe(image_size=40)
