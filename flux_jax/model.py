"""FLUX.1 transformer (BFL `Flux`) in Flax linen, with presets, block scanning and remat.

Param tree (unscanned) mirrors BFL's state dict with "." -> "/" and list indices joined by "_":
`double_blocks_0/img_attn/qkv/kernel`, `double_blocks_0/img_mlp_0/kernel`,
`single_blocks_3/linear1/kernel`, `final_layer/adaLN_modulation_1/kernel`, `time_in/in_layer/bias`.
With `scan_blocks`, each run of consecutive blocks sharing one dot_general factory becomes one
module named `double_blocks_scan_{start}_{stop}` (stop exclusive) whose params carry a leading
"layers" axis; `block_segments` gives those runs.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flux_jax.fp8_dot import Fp8Spec
from flux_jax.layers import DoubleStreamBlock, LastLayer, MLPEmbedder, SingleStreamBlock, dense
from flux_jax.math import embed_nd, timestep_embedding

DotGeneralPolicy = Callable[[str], Callable[[], nn.Module] | None]


@dataclasses.dataclass(frozen=True)
class FluxParams:
    in_channels: int
    out_channels: int
    vec_in_dim: int
    context_in_dim: int
    hidden_size: int
    mlp_ratio: float
    num_heads: int
    depth: int
    depth_single_blocks: int
    axes_dim: tuple[int, ...]
    theta: int
    qkv_bias: bool
    guidance_embed: bool

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                "change model.hidden_size or model.num_heads."
            )
        head_dim = self.hidden_size // self.num_heads
        if sum(self.axes_dim) != head_dim:
            raise ValueError(
                f"sum(axes_dim)={sum(self.axes_dim)} must equal head_dim "
                f"(hidden_size/num_heads={head_dim}); fix axes_dim or model.num_heads."
            )


_FLUX_12B = dict(
    in_channels=64,
    out_channels=64,
    vec_in_dim=768,
    context_in_dim=4096,
    hidden_size=3072,
    mlp_ratio=4.0,
    num_heads=24,
    depth=19,
    depth_single_blocks=38,
    axes_dim=(16, 56, 56),
    theta=10_000,
    qkv_bias=True,
)
_TINY = dict(
    in_channels=64,
    out_channels=64,
    vec_in_dim=32,
    context_in_dim=32,
    hidden_size=32,
    mlp_ratio=4.0,
    num_heads=2,
    depth=1,
    depth_single_blocks=1,
    axes_dim=(4, 6, 6),
    theta=10_000,
    qkv_bias=True,
)

PRESETS: dict[str, FluxParams] = {
    "flux-dev": FluxParams(**_FLUX_12B, guidance_embed=True),
    "flux-schnell": FluxParams(**_FLUX_12B, guidance_embed=False),
    # NeMo's 535M unit-test model: one block of each kind at full width.
    "flux-535m": FluxParams(**{**_FLUX_12B, "depth": 1, "depth_single_blocks": 1}, guidance_embed=False),
    "toy": FluxParams(
        **{
            **_FLUX_12B,
            "vec_in_dim": 64,
            "context_in_dim": 64,
            "hidden_size": 256,
            "num_heads": 4,
            "depth": 2,
            "depth_single_blocks": 4,
            "axes_dim": (8, 28, 28),
        },
        guidance_embed=False,
    ),
    "tiny": FluxParams(**_TINY, guidance_embed=False),
    "tiny-dev": FluxParams(**_TINY, guidance_embed=True),
}

_REMAT_POLICIES = {
    # Keep weight GEMM outputs and attention; recompute norms, activations and modulation.
    "selective": lambda: jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("attention_out"),
    ),
    "full": lambda: jax.checkpoint_policies.nothing_saveable,
}


def block_segments(
    n: int, kind: str, policy: DotGeneralPolicy | None
) -> list[tuple[int, int, tuple[Callable[[], nn.Module] | None, Callable[[], nn.Module] | None]]]:
    """Runs [start, stop) of consecutive blocks whose dot_general factories compare equal.

    Each run carries (block factory, modulation factory): the policy's answers for the sites
    ``"{kind}.{i}"`` and ``"{kind}.{i}.modulation"``.
    """
    segments: list[tuple[int, int, Any]] = []
    for i in range(n):
        site = f"{kind}.{i}"
        factories = (policy(site), policy(f"{site}.modulation")) if policy is not None else (None, None)
        if segments and segments[-1][2] == factories:
            segments[-1] = (segments[-1][0], i + 1, factories)
        else:
            segments.append((i, i + 1, factories))
    return segments


def _scan_double(block: nn.Module, carry, vec, pe):
    return block(*carry, vec, pe), None


def _scan_single(block: nn.Module, x, vec, pe):
    return block(x, vec, pe), None


class Flux(nn.Module):
    """BFL's Flux: (img, img_ids, txt, txt_ids, timesteps, y, guidance) -> (B, L, out_channels) f32."""

    params: FluxParams
    dtype: Any = jnp.bfloat16
    dot_general_policy: DotGeneralPolicy | None = None
    scan_blocks: bool = False
    remat: str | None = None
    attention_impl: str = "xla"
    attention_fp8: Fp8Spec | None = None  # FP8 attention in the FP8 blocks (fp8_dot_product_attention)

    def _site(self, name: str):
        return self.dot_general_policy(name) if self.dot_general_policy is not None else None

    def _block_cls(self, cls):
        if self.remat is None:
            return cls
        if self.remat not in _REMAT_POLICIES:
            raise ValueError(
                f"recompute_granularity must be None, 'selective' or 'full', got {self.remat!r}."
            )
        # Under scan the loop body already blocks CSE across iterations.
        return nn.remat(cls, policy=_REMAT_POLICIES[self.remat](), prevent_cse=not self.scan_blocks)

    def _run_blocks(self, kind: str, cls, n: int, carry, vec, pe, **kwargs):
        block_cls = self._block_cls(cls)
        body = _scan_double if kind == "double_blocks" else _scan_single
        for start, stop, (factory, mod_factory) in block_segments(n, kind, self.dot_general_policy):
            kwargs = dict(kwargs, dot_general_cls=factory, modulation_dot_general_cls=mod_factory)
            if not self.scan_blocks:
                for i in range(start, stop):
                    block = block_cls(**kwargs, name=f"{kind}_{i}")
                    carry, _ = body(block, carry, vec, pe)
                continue
            scanned = nn.scan(
                body,
                variable_axes={"params": 0, "fp8_meta": 0, "fp8_weights": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast),
                length=stop - start,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            block = block_cls(**kwargs, name=f"{kind}_scan_{start}_{stop}")
            carry, _ = scanned(block, carry, vec, pe)
        return carry

    @nn.compact
    def __call__(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None) -> jax.Array:
        p = self.params
        if img.ndim != 3 or txt.ndim != 3:
            raise ValueError(f"img and txt must be (B, L, C); got shapes {img.shape} and {txt.shape}.")
        if p.guidance_embed and guidance is None:
            raise ValueError(
                "This model has guidance_embed=True, so guidance (B,) is required; pass guidance "
                "(e.g. config.guidance_scale) or use a preset with guidance_embed=False."
            )
        dim, dt = p.hidden_size, self.dtype
        img = dense(dim, ("in", "embed"), "img_in", dt, self._site("img_in"))(img.astype(dt))
        vec = MLPEmbedder(dim, dt, self._site("time_in"), name="time_in")(
            timestep_embedding(timesteps, 256).astype(dt)
        )
        if p.guidance_embed:
            vec = vec + MLPEmbedder(dim, dt, self._site("guidance_in"), name="guidance_in")(
                timestep_embedding(guidance, 256).astype(dt)
            )
        vec = vec + MLPEmbedder(dim, dt, self._site("vector_in"), name="vector_in")(y.astype(dt))
        txt = dense(dim, ("in", "embed"), "txt_in", dt, self._site("txt_in"))(txt.astype(dt))
        pe = embed_nd(jnp.concatenate([txt_ids, img_ids], axis=1), tuple(p.axes_dim), p.theta)

        common = dict(
            hidden_size=dim,
            num_heads=p.num_heads,
            mlp_ratio=p.mlp_ratio,
            dtype=dt,
            attention_impl=self.attention_impl,
            attention_fp8=self.attention_fp8,
        )
        img, txt = self._run_blocks(
            "double_blocks", DoubleStreamBlock, p.depth, (img, txt), vec, pe, qkv_bias=p.qkv_bias, **common
        )
        x = jnp.concatenate([txt, img], axis=1)
        x = self._run_blocks("single_blocks", SingleStreamBlock, p.depth_single_blocks, x, vec, pe, **common)
        x = x[:, txt.shape[1] :]
        out = LastLayer(dim, p.out_channels, dt, self._site("final_layer"), name="final_layer")(x, vec)
        return out.astype(jnp.float32)
