"""FLUX.1 transformer (BFL `Flux`) in Flax linen, with presets, block scanning and remat.

Param tree (unscanned) mirrors BFL's state dict with "." -> "/" and list indices joined by "_":
`double_blocks_0/img_attn/qkv/kernel`, `double_blocks_0/img_mlp_0/kernel`,
`single_blocks_3/linear1/kernel`, `final_layer/adaLN_modulation_1/kernel`, `time_in/in_layer/bias`.
BFL's fused Linears (qkv, the modulations' lin, linear1, linear2) keep their parts on an axis of
their own, head-aligned for tensor parallelism (`layers.fused_dense`): qkv/kernel is (dim, 3, dim).
With `scan_blocks`, each block kind is one module `double_blocks_scan_0_{depth}` /
`single_blocks_scan_0_{depth_single_blocks}` whose variables carry a leading "layers" axis.

The param tree is a function of the architecture alone: the dot_general policy (which layers run
FP8), remat and the compute dtype never rename a parameter, so FP8 and BF16 runs, the BF16 fallback,
checkpoints, `init_from`, export and sampling share one tree (scanned and unscanned trees differ only
by stacking, which the converter maps). The fp8_meta tree of an FP8 run likewise covers every block
(see `fp8.make_policy`). Where the policy differs between layers of a scanned stack, the layers run
as consecutive scans, one per run of layers with equal dot_general factories (`block_segments`),
each reading its slice of the stack; `init` always builds the stack as one scan, so one seed gives
the same params under every policy.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from flux_jax.errors import UserError
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
            raise UserError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                "change model.hidden_size or model.num_heads."
            )
        mlp_dim = int(self.hidden_size * self.mlp_ratio)
        if mlp_dim % self.hidden_size:
            raise UserError(
                f"mlp_ratio {self.mlp_ratio} gives an MLP width {mlp_dim} that is not a multiple of "
                f"hidden_size {self.hidden_size}; the single blocks' fused linear1/linear2 hold the MLP as "
                "whole parts of hidden_size (layers.fused_dense): use a whole-number mlp_ratio."
            )
        head_dim = self.hidden_size // self.num_heads
        if sum(self.axes_dim) != head_dim:
            raise UserError(
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


# Collections whose leaves carry the leading "layers" axis of a scanned stack.
SCANNED_COLLECTIONS = ("params", "fp8_meta", "fp8_weights")


def _scan(body, length: int):
    return nn.scan(
        body,
        variable_axes={c: 0 for c in SCANNED_COLLECTIONS},
        split_rngs={"params": True},
        in_axes=(nn.broadcast, nn.broadcast),
        length=length,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )


def _segment_name(start: int, stop: int) -> str:
    return f"layers_{start}_{stop}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def split_stack(x, spans: tuple[tuple[int, int], ...]) -> tuple:
    """The slices ``x[start:stop]`` of consecutive spans covering x's leading axis.

    The gradient concatenates the slices' gradients: one buffer, where slicing's own transpose pads
    each to the full stack and adds them (and cannot pad fp8_meta's max-combining dtype).
    """
    return tuple(lax.slice_in_dim(x, a, b) for a, b in spans)


def _split_stack_fwd(x, spans):
    return split_stack(x, spans), None


def _split_stack_bwd(spans, _, cts):
    return (lax.concatenate(list(cts), 0),)


split_stack.defvjp(_split_stack_fwd, _split_stack_bwd)


def split_layers(spans: tuple[tuple[int, int], ...], variables: dict) -> dict:
    """{collection: stacked tree} -> {collection: {"layers_{start}_{stop}": the layers [start, stop)}}."""
    out = {}
    for col, tree in variables.items():
        leaves, treedef = jax.tree.flatten(tree)
        parts = [split_stack(x, spans) for x in leaves]
        out[col] = {
            _segment_name(a, b): treedef.unflatten([p[k] for p in parts]) for k, (a, b) in enumerate(spans)
        }
    return out


def join_layers(spans: tuple[tuple[int, int], ...], variables: dict) -> dict:
    """Inverse of ``split_layers``: the segments' layers concatenated back into one stack."""
    return {
        col: jax.tree.map(lambda *xs: jnp.concatenate(xs), *(tree[_segment_name(a, b)] for a, b in spans))
        for col, tree in variables.items()
    }


class _Segments(nn.Module):
    """A scanned stack run as consecutive scans, one per segment of ``block_segments``; wrapped in
    ``nn.map_variables`` so that it holds the stack whole and each scan sees its slice."""

    make_block: Callable[..., nn.Module]
    body: Callable
    segments: tuple

    @nn.compact
    def __call__(self, carry, vec, pe):
        for start, stop, (factory, mod_factory) in self.segments:
            block = self.make_block(
                dot_general_cls=factory,
                modulation_dot_general_cls=mod_factory,
                name=_segment_name(start, stop),
            )
            carry, _ = _scan(self.body, stop - start)(block, carry, vec, pe)
        return carry


def _check_uniform_state(kind: str, segments) -> None:
    """Layers of one stack must hold the same variables: a dot with FP8 state and one without can't
    share a stacked tree (a BF16 layer of an FP8 run holds its state: ``Fp8DotGeneral(enabled=False)``)."""

    def what(factory) -> str:
        return "None (no FP8 state)" if factory is None else "a dot_general module"

    first = segments[0][2]
    for start, _, factories in segments[1:]:
        for which, a, b in zip(("", ".modulation"), first, factories, strict=True):
            if (a is None) != (b is None):
                raise ValueError(
                    f"scan_blocks: the dot_general policy gives {kind}.0{which} {what(a)} but "
                    f"{kind}.{start}{which} {what(b)}; the layers of a scanned stack must hold the same "
                    "state. Give BF16 layers a dot that holds the FP8 state (as fp8.make_policy does) or "
                    "set model.scan_blocks=False."
                )


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
            raise UserError(f"recompute_granularity must be None, 'selective' or 'full', got {self.remat!r}.")
        # Under scan the loop body already blocks CSE across iterations.
        return nn.remat(cls, policy=_REMAT_POLICIES[self.remat](), prevent_cse=not self.scan_blocks)

    def _run_blocks(self, kind: str, cls, n: int, carry, vec, pe, **kwargs):
        make_block = functools.partial(self._block_cls(cls), **kwargs)
        body = _scan_double if kind == "double_blocks" else _scan_single
        segments = block_segments(n, kind, self.dot_general_policy)
        if not self.scan_blocks:
            for start, stop, (factory, mod_factory) in segments:
                for i in range(start, stop):
                    block = make_block(
                        dot_general_cls=factory, modulation_dot_general_cls=mod_factory, name=f"{kind}_{i}"
                    )
                    carry, _ = body(block, carry, vec, pe)
            return carry
        if not segments:
            return carry
        _check_uniform_state(kind, segments)
        name = f"{kind}_scan_0_{n}"
        if len(segments) == 1 or self.is_initializing():
            # One scan over the stack; at init also for a mixed policy, so the params (drawn per
            # layer from the stack's rng) are those of every other policy.
            factory, mod_factory = segments[0][2]
            block = make_block(dot_general_cls=factory, modulation_dot_general_cls=mod_factory, name=name)
            return _scan(body, n)(block, carry, vec, pe)[0]
        spans = tuple((start, stop) for start, stop, _ in segments)
        stack = nn.map_variables(
            _Segments,
            SCANNED_COLLECTIONS,
            trans_in_fn=functools.partial(split_layers, spans),
            trans_out_fn=functools.partial(join_layers, spans),
            mutable=True,
        )
        return stack(make_block, body, tuple(segments), name=name)(carry, vec, pe)

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
