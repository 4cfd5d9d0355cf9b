"""FLUX autoencoder decoder (latent -> RGB) in Flax linen, NHWC, plus torch state-dict conversion.

Mirrors BFL's `modules/autoencoder.py` Decoder (the same network as diffusers' AutoencoderKL
decoder): conv_in, mid (resnet, single-head attention, resnet), up levels of resnets with nearest x2
upsampling, GroupNorm + swish + conv_out. Only the decoder is needed to look at samples.
"""

import dataclasses
import functools
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flux_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class DecoderParams:
    # Channels per resolution level, lowest level (full resolution) first, as diffusers'
    # block_out_channels (= BFL ch * ch_mult).
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2  # BFL num_res_blocks; each up level has layers_per_block + 1 resnets
    z_channels: int = 16
    out_channels: int = 3
    norm_groups: int = 32
    scale_factor: float = 0.3611
    shift_factor: float = 0.1159
    post_quant_conv: bool = False  # diffusers AutoencoderKL option; FLUX's AE has none


FLUX_AE = DecoderParams()


def _conv(features: int, kernel: int, name: str, dtype: Any) -> nn.Conv:
    pad = kernel // 2
    return nn.Conv(features, (kernel, kernel), padding=((pad, pad), (pad, pad)), dtype=dtype, name=name)


def _norm(groups: int, name: str, dtype: Any) -> nn.GroupNorm:
    # Two-pass variance: the fast E[x^2]-E[x]^2 form loses precision against torch's GroupNorm.
    return nn.GroupNorm(num_groups=groups, epsilon=1e-6, use_fast_variance=False, dtype=dtype, name=name)


class ResnetBlock(nn.Module):
    out_channels: int
    groups: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = nn.swish(_norm(self.groups, "norm1", self.dtype)(x))
        h = _conv(self.out_channels, 3, "conv1", self.dtype)(h)
        h = nn.swish(_norm(self.groups, "norm2", self.dtype)(h))
        h = _conv(self.out_channels, 3, "conv2", self.dtype)(h)
        if x.shape[-1] != self.out_channels:
            x = _conv(self.out_channels, 1, "nin_shortcut", self.dtype)(x)
        return x + h


class AttnBlock(nn.Module):
    groups: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        b, h, w, c = x.shape
        y = _norm(self.groups, "norm", self.dtype)(x).reshape(b, h * w, c)
        q, k, v = (nn.Dense(c, dtype=self.dtype, name=n)(y) for n in ("q", "k", "v"))
        logits = jnp.einsum("bqc,bkc->bqk", q, k, preferred_element_type=jnp.float32) / np.sqrt(c)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        out = jnp.einsum("bqk,bkc->bqc", probs, v)
        out = nn.Dense(c, dtype=self.dtype, name="proj_out")(out)
        return x + out.reshape(b, h, w, c)


class Upsample(nn.Module):
    channels: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        return _conv(self.channels, 3, "conv", self.dtype)(x)


class Decoder(nn.Module):
    """`__call__` takes raw VAE latents (B, H, W, z); `decode` takes FLUX-scaled latents."""

    params: DecoderParams = FLUX_AE
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, z):
        p = self.params
        g = p.norm_groups
        if p.post_quant_conv:
            z = _conv(p.z_channels, 1, "post_quant_conv", self.dtype)(z)
        chans = p.block_out_channels
        h = _conv(chans[-1], 3, "conv_in", self.dtype)(z)
        h = ResnetBlock(chans[-1], g, self.dtype, name="mid_block_1")(h)
        h = AttnBlock(g, self.dtype, name="mid_attn_1")(h)
        h = ResnetBlock(chans[-1], g, self.dtype, name="mid_block_2")(h)
        # BFL numbers levels by resolution (up_0 = full resolution) and runs them top-down.
        for level in reversed(range(len(chans))):
            for j in range(p.layers_per_block + 1):
                h = ResnetBlock(chans[level], g, self.dtype, name=f"up_{level}_block_{j}")(h)
            if level != 0:
                h = Upsample(chans[level], self.dtype, name=f"up_{level}_upsample")(h)
        h = nn.swish(_norm(g, "norm_out", self.dtype)(h))
        return _conv(p.out_channels, 3, "conv_out", self.dtype)(h).astype(jnp.float32)

    def decode(self, z):
        return self(z / self.params.scale_factor + self.params.shift_factor)


@functools.partial(jax.jit, static_argnums=2)
def decode_nchw(variables, z_nchw, params: DecoderParams = FLUX_AE):
    """FLUX-scaled latents (B, z, h, w) -> NHWC images (B, H, W, 3), values about [-1, 1]."""
    z = jnp.transpose(jnp.asarray(z_nchw, jnp.float32), (0, 2, 3, 1))
    return Decoder(params).apply(variables, z, method=Decoder.decode)


# ---- conversion -------------------------------------------------------------------------------


def _diffusers_to_bfl_name(name: str, num_levels: int) -> str:
    """Rename one diffusers AutoencoderKL decoder key to BFL's naming."""
    name = name.replace("decoder.mid_block.resnets.0.", "decoder.mid.block_1.")
    name = name.replace("decoder.mid_block.resnets.1.", "decoder.mid.block_2.")
    name = name.replace("decoder.mid_block.attentions.0.", "decoder.mid.attn_1.")
    name = name.replace("decoder.conv_norm_out.", "decoder.norm_out.")
    m = re.match(r"decoder\.up_blocks\.(\d+)\.(resnets|upsamplers)\.(\d+)\.(.*)", name)
    if m:
        level = num_levels - 1 - int(m.group(1))  # diffusers lists up blocks top-down
        if m.group(2) == "resnets":
            name = f"decoder.up.{level}.block.{m.group(3)}.{m.group(4)}"
        else:
            name = f"decoder.up.{level}.upsample.{m.group(4)}"
    attn = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    for old, new in attn.items():
        name = name.replace(f"attn_1.{old}.", f"attn_1.{new}.")
    return name.replace(".conv_shortcut.", ".nin_shortcut.")


def _flax_path(bfl_name: str) -> tuple[str, ...]:
    parts = bfl_name.split(".")
    if parts[0] == "post_quant_conv":
        return tuple(parts)
    parts = parts[1:]  # drop "decoder"
    if parts[0] == "mid":
        return (f"mid_{parts[1]}", *parts[2:])
    if parts[0] == "up":
        if parts[2] == "block":
            return (f"up_{parts[1]}_block_{parts[3]}", *parts[4:])
        return (f"up_{parts[1]}_upsample", *parts[3:])
    return tuple(parts)


def _convert_leaf(path: tuple[str, ...], value: np.ndarray) -> tuple[tuple[str, ...], np.ndarray]:
    value = np.asarray(value, np.float32)
    kind = path[-1]
    is_norm = path[-2].startswith("norm")
    if kind == "weight" and is_norm:
        return (*path[:-1], "scale"), value
    if kind == "bias":
        return path, value
    if value.ndim == 4:
        if path[-2] in ("q", "k", "v", "proj_out"):  # BFL stores attention projections as 1x1 convs
            return (*path[:-1], "kernel"), value[:, :, 0, 0].T
        return (*path[:-1], "kernel"), np.transpose(value, (2, 3, 1, 0))  # OIHW -> HWIO
    return (*path[:-1], "kernel"), value.T  # torch Linear (out, in) -> (in, out)


def load_decoder_state_dict(state_dict: Mapping[str, Any], params: DecoderParams) -> dict:
    """Decoder weights from a BFL `ae.safetensors` or diffusers AutoencoderKL state dict -> variables.

    Layout is detected from the keys; encoder weights are ignored.
    """
    num_levels = len(params.block_out_channels)
    is_diffusers = any(k.startswith("decoder.up_blocks.") for k in state_dict)
    tree: dict = {}
    for name, value in state_dict.items():
        if not (name.startswith("decoder.") or name.startswith("post_quant_conv.")):
            continue
        if name.startswith("post_quant_conv.") and not params.post_quant_conv:
            continue
        bfl = _diffusers_to_bfl_name(name, num_levels) if is_diffusers else name
        path, leaf = _convert_leaf(_flax_path(bfl), np.asarray(value))
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jnp.asarray(leaf)
    expected = jax.eval_shape(
        Decoder(params).init, jax.random.key(0), jnp.zeros((1, 4, 4, params.z_channels))
    )["params"]
    want = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    got = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(tree)}
    if want != got:
        missing = sorted(set(want) - set(got))[:5]
        bad = sorted(k for k in set(want) & set(got) if want[k] != got[k])[:5]
        raise UserError(
            f"autoencoder state dict does not match DecoderParams {params}: missing {missing}, "
            f"shape mismatch {bad}, unexpected {sorted(set(got) - set(want))[:5]}; pass the DecoderParams "
            "the checkpoint was trained with (FLUX_AE for FLUX's ae.safetensors)"
        )
    return {"params": tree}


def load_autoencoder(path: str) -> tuple[DecoderParams, dict]:
    """Load a decoder from BFL `ae.safetensors` or a diffusers AutoencoderKL folder (config.json)."""
    from safetensors.numpy import load_file

    if os.path.isdir(path):
        cfg_path = os.path.join(path, "config.json")
        weights = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
        if not os.path.exists(cfg_path) or not weights:
            raise UserError(f"--ae {path}: a diffusers VAE folder needs config.json and a .safetensors file")
        with open(cfg_path) as f:
            cfg = json.load(f)
        params = DecoderParams(
            block_out_channels=tuple(cfg["block_out_channels"]),
            layers_per_block=cfg.get("layers_per_block", 2),
            z_channels=cfg.get("latent_channels", 16),
            out_channels=cfg.get("out_channels", 3),
            norm_groups=cfg.get("norm_num_groups", 32),
            scale_factor=cfg.get("scaling_factor", FLUX_AE.scale_factor),
            shift_factor=cfg.get("shift_factor") or 0.0,
            post_quant_conv=cfg.get("use_post_quant_conv", True),
        )
        state: dict = {}
        for w in weights:
            state.update(load_file(os.path.join(path, w)))
        return params, load_decoder_state_dict(state, params)
    if not os.path.isfile(path):
        raise UserError(f"--ae {path}: no such file; pass BFL ae.safetensors or a diffusers vae folder")
    return FLUX_AE, load_decoder_state_dict(load_file(path), FLUX_AE)
