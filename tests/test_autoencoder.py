import numpy as np
import pytest

from flux_jax import autoencoder

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

CHANNELS = (32, 64)


def _torch_vae(post_quant_conv: bool):
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=CHANNELS,
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=8,
        use_quant_conv=post_quant_conv,
        use_post_quant_conv=post_quant_conv,
    ).eval()
    # Default init leaves GroupNorm at identity and biases at zero; randomise so every weight counts.
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return vae


def _params(post_quant_conv: bool) -> autoencoder.DecoderParams:
    return autoencoder.DecoderParams(
        block_out_channels=CHANNELS, layers_per_block=1, norm_groups=8, post_quant_conv=post_quant_conv
    )


def _rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("post_quant_conv", [False, True])
def test_decode_matches_diffusers(post_quant_conv):
    vae = _torch_vae(post_quant_conv)
    params = _params(post_quant_conv)
    variables = autoencoder.load_decoder_state_dict(
        {k: v.numpy() for k, v in vae.state_dict().items()}, params
    )
    z = np.random.default_rng(0).standard_normal((2, 16, 6, 8)).astype(np.float32)
    with torch.no_grad():
        # FLUX pipelines unscale latents before vae.decode; decode_nchw must do the same.
        ref = vae.decode(torch.from_numpy(z / params.scale_factor + params.shift_factor)).sample.numpy()
    out = autoencoder.decode_nchw(variables, z, params)
    assert out.shape == (2, 12, 16, 3)
    assert _rel_err(np.transpose(np.asarray(out), (0, 3, 1, 2)), ref) < 1e-4


def test_bfl_names_load_the_same_weights():
    vae = _torch_vae(False)
    params = _params(False)
    sd = {k: v.numpy() for k, v in vae.state_dict().items()}
    from_diffusers = autoencoder.load_decoder_state_dict(sd, params)
    bfl = {}
    for k, v in sd.items():
        name = autoencoder._diffusers_to_bfl_name(k, len(CHANNELS))
        # BFL keeps the attention projections as 1x1 convs.
        if ".attn_1." in name and name.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]
        bfl[name] = v
    assert any(k.startswith("decoder.up.1.upsample.") for k in bfl)
    from_bfl = autoencoder.load_decoder_state_dict(bfl, params)
    import jax

    for a, b in zip(jax.tree.leaves(from_diffusers), jax.tree.leaves(from_bfl), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mismatched_params_raise_clear_error():
    sd = {k: v.numpy() for k, v in _torch_vae(False).state_dict().items()}
    wrong = autoencoder.DecoderParams(block_out_channels=(32, 64, 64), layers_per_block=1, norm_groups=8)
    with pytest.raises(ValueError, match="DecoderParams"):
        autoencoder.load_decoder_state_dict(sd, wrong)


def test_load_autoencoder_from_diffusers_folder(tmp_path):
    vae = _torch_vae(True)
    vae.register_to_config(scaling_factor=0.5, shift_factor=0.25)
    vae.save_pretrained(str(tmp_path))
    params, variables = autoencoder.load_autoencoder(str(tmp_path))
    assert params == autoencoder.DecoderParams(
        block_out_channels=CHANNELS,
        layers_per_block=1,
        norm_groups=8,
        scale_factor=0.5,
        shift_factor=0.25,
        post_quant_conv=True,
    )
    z = np.random.default_rng(1).standard_normal((1, 16, 4, 4)).astype(np.float32)
    with torch.no_grad():
        ref = vae.decode(torch.from_numpy(z / 0.5 + 0.25)).sample.numpy()
    out = np.transpose(np.asarray(autoencoder.decode_nchw(variables, z, params)), (0, 3, 1, 2))
    assert _rel_err(out, ref) < 1e-4
    with pytest.raises(ValueError, match="--ae"):
        autoencoder.load_autoencoder(str(tmp_path / "missing.safetensors"))


def test_flux_sized_diffusers_vae_maps_onto_flux_ae():
    # FLUX.1's diffusers VAE config: four levels, 16 latent channels, no quant convs.
    vae = diffusers.AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        latent_channels=16,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    sd = {k: v.detach().numpy() for k, v in vae.state_dict().items() if k.startswith("decoder.")}
    variables = autoencoder.load_decoder_state_dict(sd, autoencoder.FLUX_AE)
    # Every decoder tensor is used exactly once.
    import jax

    assert sum(x.size for x in jax.tree.leaves(variables)) == sum(v.size for v in sd.values())
