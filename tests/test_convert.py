"""Parity with diffusers' FluxTransformer2DModel through our converter, and BFL round trips."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flux_jax import convert
from flux_jax.model import PRESETS, Flux

torch = pytest.importorskip("torch")
transformer_flux = pytest.importorskip("diffusers.models.transformers.transformer_flux")


def _diffusers_model(guidance: bool, layers: int, single_layers: int):
    torch.manual_seed(0)
    model = transformer_flux.FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=layers,
        num_single_layers=single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=guidance,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    # Every weight random (norm scales around 1), small enough that float32 error stays ~1e-6.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 and p.shape[0] == 16 else 0.0))
    return model


def _inputs(batch: int = 2, h: int = 3, w: int = 4, n_txt: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    img_ids = np.stack([np.zeros_like(rows), rows, cols], -1).reshape(-1, 3).astype(np.float32)
    return dict(
        img=rng.normal(size=(batch, h * w, 64)).astype(np.float32),
        img_ids=img_ids,
        txt=rng.normal(size=(batch, n_txt, 32)).astype(np.float32),
        txt_ids=np.zeros((n_txt, 3), np.float32),
        t=np.array([0.25, 0.8][:batch], np.float32),
        y=rng.normal(size=(batch, 32)).astype(np.float32),
        guidance=np.array([3.5, 1.0][:batch], np.float32),
    )


def _torch_forward(model, x, guidance: bool) -> np.ndarray:
    with torch.no_grad():
        out = model(
            hidden_states=torch.from_numpy(x["img"]),
            encoder_hidden_states=torch.from_numpy(x["txt"]),
            pooled_projections=torch.from_numpy(x["y"]),
            timestep=torch.from_numpy(x["t"]),
            img_ids=torch.from_numpy(x["img_ids"]),
            txt_ids=torch.from_numpy(x["txt_ids"]),
            guidance=torch.from_numpy(x["guidance"]) if guidance else None,
            return_dict=False,
        )[0]
    return out.numpy()


def _jax_forward(params, variables, x, guidance: bool, **kwargs) -> np.ndarray:
    b = x["img"].shape[0]
    img_ids = np.broadcast_to(x["img_ids"], (b, *x["img_ids"].shape))
    txt_ids = np.broadcast_to(x["txt_ids"], (b, *x["txt_ids"].shape))
    apply = jax.jit(Flux(params, dtype=jnp.float32, **kwargs).apply)
    out = apply(
        variables, x["img"], img_ids, x["txt"], txt_ids, x["t"], x["y"], x["guidance"] if guidance else None
    )
    return np.asarray(out)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _params(guidance: bool, layers: int, single_layers: int):
    base = PRESETS["tiny-dev" if guidance else "tiny"]
    return dataclasses.replace(base, depth=layers, depth_single_blocks=single_layers)


@pytest.mark.parametrize("guidance,layers,single_layers", [(False, 1, 2), (True, 2, 1)])
def test_diffusers_parity_and_bfl_round_trip(guidance, layers, single_layers):
    model = _diffusers_model(guidance, layers, single_layers)
    params = _params(guidance, layers, single_layers)
    sd = model.state_dict()
    x = _inputs()
    expected = _torch_forward(model, x, guidance)

    variables = convert.load_torch_state_dict(sd, params)
    ours = _jax_forward(params, variables, x, guidance)
    assert ours.shape == expected.shape
    assert _rel(ours, expected) < 1e-5

    bfl = convert.export_bfl_state_dict(variables, params)
    assert "double_blocks.0.img_attn.qkv.weight" in bfl
    assert bfl["final_layer.adaLN_modulation.1.weight"].shape == (64, 32)
    prefixed = {f"model.diffusion_model.{k}": v for k, v in bfl.items()}
    reloaded = convert.load_torch_state_dict(prefixed, params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, reloaded, variables)
    again = convert.export_bfl_state_dict(reloaded, params)
    assert set(again) == set(bfl)
    for k in bfl:
        np.testing.assert_array_equal(again[k], bfl[k])


def test_scanned_conversion_matches_unscanned():
    params = _params(True, 2, 2)
    model = _diffusers_model(True, 2, 2)
    sd = model.state_dict()
    x = _inputs(h=2, w=5)
    plain = _jax_forward(params, convert.load_torch_state_dict(sd, params), x, True)
    scanned_vars = convert.load_torch_state_dict(sd, params, scan_blocks=True)
    qkv = scanned_vars["params"]["double_blocks_scan_0_2"]["img_attn"]["qkv"]
    assert qkv["kernel"].shape == (2, 32, 3, 32)
    scanned = _jax_forward(params, scanned_vars, x, True, scan_blocks=True)
    np.testing.assert_allclose(scanned, plain, rtol=1e-5, atol=1e-6)
    assert _rel(scanned, _torch_forward(model, x, True)) < 1e-5
    bfl = convert.export_bfl_state_dict(scanned_vars, params)
    np.testing.assert_array_equal(
        bfl["single_blocks.1.linear1.weight"],
        convert.export_bfl_state_dict(convert.load_torch_state_dict(sd, params), params)[
            "single_blocks.1.linear1.weight"
        ],
    )


def test_wrong_keys_are_all_reported():
    params = _params(False, 1, 1)
    sd = {k: v.numpy() for k, v in _diffusers_model(False, 1, 1).state_dict().items()}
    bfl = convert.export_bfl_state_dict(convert.load_torch_state_dict(sd, params), params)
    del bfl["double_blocks.0.img_attn.proj.bias"]
    bfl["single_blocks.7.linear1.weight"] = np.zeros((3, 3), np.float32)
    bfl["img_in.weight"] = np.zeros((32, 65), np.float32)
    with pytest.raises(ValueError) as err:
        convert.load_torch_state_dict(bfl, params)
    msg = str(err.value)
    assert "double_blocks.0.img_attn.proj.bias" in msg
    assert "single_blocks.7.linear1.weight" in msg
    assert "img_in.weight: got (32, 65), expected (32, 64)" in msg

    del sd["transformer_blocks.0.attn.to_k.weight"]
    with pytest.raises(ValueError, match="transformer_blocks.0.attn.to_k.weight"):
        convert.load_torch_state_dict(sd, params)


def test_cli_import_and_export(tmp_path):
    from safetensors.numpy import load_file, save_file

    params = PRESETS["tiny"]
    sd = {k: v.numpy() for k, v in _diffusers_model(False, 1, 1).state_dict().items()}
    save_file(sd, str(tmp_path / "diffusers.safetensors"))
    convert.main(
        ["--input", str(tmp_path), "--preset", "tiny", "--output", str(tmp_path / "out/p.safetensors")]
    )
    flat = load_file(tmp_path / "out/p.safetensors")
    assert flat["double_blocks_0/img_attn/qkv/kernel"].shape == (32, 3, 32)
    convert.main(
        [
            "--input",
            str(tmp_path / "out/p.safetensors"),
            "--preset",
            "tiny",
            "--to",
            "bfl",
            "--output",
            str(tmp_path / "bfl.safetensors"),
        ]
    )
    exported = load_file(tmp_path / "bfl.safetensors")
    expected = convert.export_bfl_state_dict(convert.load_torch_state_dict(sd, params), params)
    assert set(exported) == set(expected)
    for k in expected:
        np.testing.assert_array_equal(exported[k], expected[k])
