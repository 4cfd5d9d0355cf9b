import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flux_jax import latents, sample


@pytest.mark.parametrize("seq_len", [256, 1024, 4096])
def test_shifted_schedule_follows_formula(seq_len):
    got = np.asarray(sample.get_schedule(10, seq_len, shift=True))
    mu = 0.5 + (seq_len - 256) * (1.15 - 0.5) / (4096 - 256)
    t = np.linspace(1.0, 0.0, 11)
    with np.errstate(divide="ignore"):
        want = math.exp(mu) / (math.exp(mu) + (1.0 / t - 1.0))
    assert got.shape == (11,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert got[0] == 1.0 and got[-1] == 0.0
    assert np.all(np.diff(got) < 0)


def test_unshifted_schedule_is_linspace():
    np.testing.assert_allclose(np.asarray(sample.get_schedule(4, 4096, shift=False)), [1, 0.75, 0.5, 0.25, 0])


def _inputs(b=2, seq=16, txt_len=3):
    rng = np.random.default_rng(0)
    return dict(
        noise_packed=jnp.asarray(rng.standard_normal((b, seq, 64)), jnp.float32),
        img_ids=jnp.zeros((b, seq, 3)),
        txt=jnp.zeros((b, txt_len, 8)),
        txt_ids=jnp.zeros((b, txt_len, 3)),
        y=jnp.zeros((b, 8)),
    )


def test_constant_velocity_integrates_exactly():
    def apply_fn(variables, img, img_ids, txt, txt_ids, t, y, guidance):
        return jnp.broadcast_to(variables["v"], img.shape)

    inputs = _inputs()
    v = jnp.asarray(np.random.default_rng(1).standard_normal(64), jnp.float32)
    ts = sample.get_schedule(7, 1024, shift=True)
    out = sample.denoise(apply_fn, {"v": v}, timesteps=ts, **inputs)
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(inputs["noise_packed"] - v[None, None, :]), rtol=1e-5, atol=1e-5
    )


def test_linear_velocity_recovers_data_and_sees_time_and_guidance():
    # For x_t = (1 - t) x0 + t eps the exact velocity eps - x0 is (x_t - x0) / t; Euler on this
    # field is exact too, so sampling must land on x0 whatever the (shifted) schedule.
    x0 = jnp.asarray(np.random.default_rng(2).standard_normal((2, 16, 64)), jnp.float32)
    seen = []

    def apply_fn(variables, img, img_ids, txt, txt_ids, t, y, guidance):
        seen.append(guidance)
        assert t.shape == (img.shape[0],) and guidance.shape == (img.shape[0],)
        return (img - variables["x0"]) / t[:, None, None]

    ts = sample.get_schedule(5, 256, shift=True)
    out = sample.denoise(apply_fn, {"x0": x0}, timesteps=ts, guidance=3.5, **_inputs())
    np.testing.assert_allclose(np.asarray(out), np.asarray(x0), rtol=1e-4, atol=1e-4)
    assert seen, "apply_fn was never traced"


def test_classifier_free_guidance_combines_cond_and_uncond():
    def apply_fn(variables, img, img_ids, txt, txt_ids, t, y, guidance):
        # A velocity that depends only on the caption: its mean over tokens and features.
        v = jnp.mean(txt, axis=(1, 2)) + jnp.mean(y, axis=1)
        return jnp.broadcast_to(v[:, None, None], img.shape)

    inputs = _inputs()
    inputs["txt"] = jnp.full(inputs["txt"].shape, 2.0)
    uncond = (jnp.full((1, 3, 8), 0.5), jnp.zeros((1, 8)))
    ts = sample.get_schedule(4, 256, shift=False)
    out = sample.denoise(apply_fn, {}, timesteps=ts, uncond=uncond, cfg_scale=3.0, **inputs)
    want = inputs["noise_packed"] - (0.5 + 3.0 * (2.0 - 0.5))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_grid_and_png(tmp_path):
    from PIL import Image

    imgs = np.random.default_rng(4).uniform(size=(5, 8, 6, 3))
    grid = sample.make_grid(sample.to_uint8(imgs), cols=3, pad=1)
    assert grid.shape == (2 * 9 + 1, 3 * 7 + 1, 3)
    np.testing.assert_array_equal(grid[1:9, 8:14], sample.to_uint8(imgs[1]))
    paths = sample.write_images(str(tmp_path), imgs, [f"p{i}" for i in range(5)])
    assert len(paths) == 7
    np.testing.assert_array_equal(np.asarray(Image.open(paths[2])), sample.to_uint8(imgs[2]))


B, LATENT, TXT_LEN = 2, 8, 8


@pytest.fixture(scope="module")
def tiny_dev():
    """(model, unboxed variables) for the tiny-dev preset, final layer randomised (it starts at 0)."""
    import flax.linen as nn

    model_mod = pytest.importorskip("flux_jax.model")
    fp = model_mod.PRESETS["tiny-dev"]
    flux = model_mod.Flux(fp, dtype=jnp.float32)
    seq = (LATENT // 2) ** 2
    variables = jax.jit(flux.init)(
        jax.random.key(0),
        jnp.zeros((B, seq, fp.in_channels)),
        jnp.zeros((B, seq, 3)),
        jnp.zeros((B, TXT_LEN, fp.context_in_dim)),
        jnp.zeros((B, TXT_LEN, 3)),
        jnp.ones((B,)),
        jnp.zeros((B, fp.vec_in_dim)),
        jnp.ones((B,)),
    )
    params = nn.unbox(variables["params"])
    rng = np.random.default_rng(5)
    params["final_layer"] = jax.tree.map(
        lambda x: np.asarray(0.05 * rng.standard_normal(x.shape), np.float32), params["final_layer"]
    )
    return flux, jax.tree.map(np.asarray, params)


def test_tiny_flux_denoise_shapes(tiny_dev):
    flux, params = tiny_dev
    fp = flux.params
    seq = (LATENT // 2) ** 2
    img_ids = jnp.broadcast_to(jnp.asarray(latents.image_ids(LATENT, LATENT)), (B, seq, 3))
    txt = jnp.ones((B, TXT_LEN, fp.context_in_dim))
    txt_ids = jnp.zeros((B, TXT_LEN, 3))
    y = jnp.ones((B, fp.vec_in_dim))
    noise = jax.random.normal(jax.random.key(0), (B, seq, fp.in_channels))
    ts = sample.get_schedule(3, seq, shift=True)
    apply_fn = sample.flux_apply_fn(flux)
    out = sample.denoise(apply_fn, {"params": params}, noise, img_ids, txt, txt_ids, y, ts, 2.0)
    assert out.shape == noise.shape
    assert np.all(np.isfinite(np.asarray(out)))
    assert not np.allclose(np.asarray(out), np.asarray(noise))
    # The guidance value reaches the model (guidance_in embedding).
    other = sample.denoise(apply_fn, {"params": params}, noise, img_ids, txt, txt_ids, y, ts, 5.0)
    assert not np.allclose(np.asarray(out), np.asarray(other))
    assert latents.unpack(out, LATENT, LATENT).shape == (B, 16, LATENT, LATENT)


def test_cli_samples_from_checkpoint(tmp_path, tiny_dev, caplog):
    checkpoint = pytest.importorskip("flux_jax.checkpoint")
    _, params = tiny_dev
    config = sample.load_config("configs/toy.py")
    config.model.preset = "tiny-dev"
    config.data.image_size = LATENT * 8
    config.data.txt_len = TXT_LEN
    ckpt = checkpoint.Checkpointer(str(tmp_path / "w"), config)
    ckpt.save(3, {"step": np.int32(3), "params": params}, force=True)
    ckpt.wait_until_finished()
    ckpt.close()
    out = tmp_path / "out"
    # The CLI must take the model from the checkpoint's saved config, not the file's "toy" preset.
    with caplog.at_level("WARNING"):
        sample.main(
            ["--workdir", str(tmp_path / "w"), "--config", "configs/toy.py", "--num_steps", "2"]
            + ["--num_images", str(B), "--out", str(out), "--cfg_scale", "2.0"]
        )
    assert "Metadata file does not exist" not in caplog.text  # params are read without orbax warnings
    assert sorted(os.listdir(out)) == ["000.png", "001.png", "grid.png", "prompts.txt"]
    from PIL import Image

    # The toy decoder works at latent resolution; each latent pixel is shown as an 8x8 block.
    image = np.asarray(Image.open(out / "000.png"))
    assert image.shape == (LATENT * 8, LATENT * 8, 3)
    np.testing.assert_array_equal(image, sample.upscale(image[::8, ::8][None], 8)[0])
    assert len((out / "prompts.txt").read_text().splitlines()) == B


def test_cli_decodes_stored_encodings_with_autoencoder(tmp_path, tiny_dev):
    checkpoint = pytest.importorskip("flux_jax.checkpoint")
    diffusers = pytest.importorskip("diffusers")
    _, params = tiny_dev
    vae = diffusers.AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 32),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=8,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    vae.save_pretrained(str(tmp_path / "vae"))
    config = sample.load_config("configs/toy.py")
    config.model.preset = "tiny-dev"
    config.data.source = "mock"
    config.data.image_size = LATENT * 8
    config.data.txt_len = TXT_LEN
    ckpt = checkpoint.Checkpointer(str(tmp_path / "w"), config)
    ckpt.save(1, {"step": np.int32(1), "params": params}, force=True)
    ckpt.wait_until_finished()
    ckpt.close()
    args = ["--workdir", str(tmp_path / "w"), "--config", "configs/toy.py", "--num_steps", "2"]
    with pytest.raises(ValueError, match="--ae"):
        sample.main(args + ["--num_images", str(B), "--out", str(tmp_path / "none")])
    sample.main(
        args + ["--num_images", str(B), "--out", str(tmp_path / "out"), "--ae", str(tmp_path / "vae")]
    )
    from PIL import Image

    # Two decoder levels upsample the 8x8 latent once.
    assert np.asarray(Image.open(tmp_path / "out" / "000.png")).shape == (16, 16, 3)
    assert (tmp_path / "out" / "prompts.txt").read_text().splitlines() == ["000\tval[0]", "001\tval[1]"]


def test_cli_without_checkpoints_says_to_train_first(tmp_path):
    with pytest.raises(ValueError, match=r"has no checkpoints .* train there first"):
        sample.main(["--workdir", str(tmp_path / "w"), "--config", "configs/toy.py", "--out", str(tmp_path)])


def test_cli_with_a_missing_step_lists_the_saved_ones(tmp_path):
    from flux_jax import checkpoint

    config = sample.load_config("configs/toy.py")
    ckpt = checkpoint.Checkpointer(str(tmp_path / "w"), config)
    ckpt.save(3, {"step": np.int32(3), "params": {"w": np.zeros(2, np.float32)}}, force=True)
    ckpt.wait_until_finished()
    ckpt.close()
    args = ["--workdir", str(tmp_path / "w"), "--config", "configs/toy.py", "--out", str(tmp_path)]
    args += ["--step", "7"]
    with pytest.raises(ValueError, match=r"--step 7: no such checkpoint .*saved steps: \[3\]"):
        sample.main(args)
