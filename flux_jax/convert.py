"""BFL / diffusers FLUX.1 state dicts <-> flux_jax params.

The flux_jax tree is the BFL state dict with "." -> "/", list indices joined with "_" and
Linear `weight [out, in]` stored as `kernel [in, out]`, reshaped where the layer keeps a fused
projection's parts on an axis of their own (qkv `[dim, 3, dim]`, linear2 `[1 + mlp_ratio, dim, dim]`,
biases alike: a row-major reshape, so the values are BFL's exactly). diffusers checkpoints are first renamed
to BFL keys (q/k/v fused, the final adaLN's (scale, shift) swapped to BFL's (shift, scale)).

CLI:
  python -m flux_jax.convert --input flux1-dev.safetensors --preset flux-dev --output params.safetensors
  python -m flux_jax.convert --input params.safetensors --preset flux-dev --to bfl --output bfl.safetensors
The input may also be a diffusers `transformer/` directory. `--to flax` writes flux_jax params as
safetensors keyed by "/"-joined param paths.
"""

import argparse
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flux_jax import cli, setup
from flux_jax.errors import UserError
from flux_jax.fp8_dot import contracted_axes, input_axes
from flux_jax.model import PRESETS, Flux, FluxParams

_PREFIX = "model.diffusion_model."
_SCANNED = re.compile(r"^(double_blocks|single_blocks)_scan_(\d+)_(\d+)$")
_INDEXED = re.compile(r"^(.*)_(\d+)$")


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # torch tensor; bf16 has no numpy dtype, so go through float32
        import torch

        return value.detach().to(torch.float32).cpu().numpy()
    return np.asarray(value).astype(np.float32)


def _diffusers_to_bfl(sd: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Rename a diffusers FluxTransformer2DModel state dict to BFL keys; returns (bfl, missing)."""
    out: dict[str, np.ndarray] = {}
    used: set[str] = set()
    missing: list[str] = []

    def take(src: str) -> np.ndarray | None:
        if src not in sd:
            missing.append(src)
            return None
        used.add(src)
        return sd[src]

    def linear(dst: str, srcs: list[str], swap: bool = False):
        for suffix in ("weight", "bias"):
            parts = [take(f"{s}.{suffix}") for s in srcs]
            if any(p is None for p in parts):
                continue
            value = np.concatenate(parts, axis=0)
            if swap:
                scale, shift = np.split(value, 2, axis=0)
                value = np.concatenate([shift, scale], axis=0)
            out[f"{dst}.{suffix}"] = value

    def scale(dst: str, src: str):
        value = take(src)
        if value is not None:
            out[dst] = value

    linear("img_in", ["x_embedder"])
    linear("txt_in", ["context_embedder"])
    embedders = {"time_in": "timestep", "vector_in": "text", "guidance_in": "guidance"}
    for bfl, hf in embedders.items():
        if bfl == "guidance_in" and not any(k.startswith("time_text_embed.guidance_embedder") for k in sd):
            continue
        linear(f"{bfl}.in_layer", [f"time_text_embed.{hf}_embedder.linear_1"])
        linear(f"{bfl}.out_layer", [f"time_text_embed.{hf}_embedder.linear_2"])
    for i in sorted({int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks.")}):
        s, d = f"transformer_blocks.{i}", f"double_blocks.{i}"
        linear(f"{d}.img_mod.lin", [f"{s}.norm1.linear"])
        linear(f"{d}.txt_mod.lin", [f"{s}.norm1_context.linear"])
        linear(f"{d}.img_attn.qkv", [f"{s}.attn.to_{x}" for x in "qkv"])
        linear(f"{d}.txt_attn.qkv", [f"{s}.attn.add_{x}_proj" for x in "qkv"])
        scale(f"{d}.img_attn.norm.query_norm.scale", f"{s}.attn.norm_q.weight")
        scale(f"{d}.img_attn.norm.key_norm.scale", f"{s}.attn.norm_k.weight")
        scale(f"{d}.txt_attn.norm.query_norm.scale", f"{s}.attn.norm_added_q.weight")
        scale(f"{d}.txt_attn.norm.key_norm.scale", f"{s}.attn.norm_added_k.weight")
        linear(f"{d}.img_attn.proj", [f"{s}.attn.to_out.0"])
        linear(f"{d}.txt_attn.proj", [f"{s}.attn.to_add_out"])
        linear(f"{d}.img_mlp.0", [f"{s}.ff.net.0.proj"])
        linear(f"{d}.img_mlp.2", [f"{s}.ff.net.2"])
        linear(f"{d}.txt_mlp.0", [f"{s}.ff_context.net.0.proj"])
        linear(f"{d}.txt_mlp.2", [f"{s}.ff_context.net.2"])
    for i in sorted({int(k.split(".")[1]) for k in sd if k.startswith("single_transformer_blocks.")}):
        s, d = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        linear(f"{d}.linear1", [f"{s}.attn.to_{x}" for x in "qkv"] + [f"{s}.proj_mlp"])
        linear(f"{d}.linear2", [f"{s}.proj_out"])
        linear(f"{d}.modulation.lin", [f"{s}.norm.linear"])
        scale(f"{d}.norm.query_norm.scale", f"{s}.attn.norm_q.weight")
        scale(f"{d}.norm.key_norm.scale", f"{s}.attn.norm_k.weight")
    linear("final_layer.linear", ["proj_out"])
    linear("final_layer.adaLN_modulation.1", ["norm_out.linear"], swap=True)
    # Unconsumed diffusers keys pass through under their own names so they show up as unexpected.
    out.update({k: v for k, v in sd.items() if k not in used})
    return out, missing


def _flax_name(part: str) -> str:
    m = _INDEXED.match(part)
    return f"{m.group(1)}.{m.group(2)}" if m else part


def _flax_shapes(params: FluxParams) -> dict[str, tuple[int, ...]]:
    """BFL key -> flux_jax shape (kernels under their BFL "weight" key) for an unscanned Flux(params)."""
    shapes = nn.unbox(setup.abstract_variables(Flux(params, dtype=jnp.float32)))["params"]
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        names = [_flax_name(k.key) for k in path]
        leaf_name = "weight" if names[-1] == "kernel" else names[-1]
        out[".".join(names[:-1] + [leaf_name])] = tuple(leaf.shape)
    return out


def _torch_shape(key: str, flax_shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The BFL (torch) shape of one flux_jax leaf: Linear weights (out, in), everything else flat."""
    shape = flax_shapes[key]
    if not key.endswith(".weight") or len(shape) < 2:
        return (int(np.prod(shape)),) if len(shape) else ()
    n_in = contracted_axes(shape, flax_shapes.get(key.removesuffix("weight") + "bias"))
    return (int(np.prod(shape[n_in:])), int(np.prod(shape[:n_in])))


def _expected_bfl_shapes(flax_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """BFL key -> torch shape, from ``_flax_shapes`` (an unscanned Flux's abstract init)."""
    return {key: _torch_shape(key, flax_shapes) for key in flax_shapes}


def _flat_dense(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A Dense's params with the kernel as the (in, out) matrix and the bias flat: BFL's Linear transposed."""
    out = dict(tree)
    if "kernel" in tree and np.ndim(tree["kernel"]) >= 2:
        kernel = np.asarray(tree["kernel"])
        n_in = input_axes(tree)
        out["kernel"] = kernel.reshape(int(np.prod(kernel.shape[:n_in])), -1)
        if "bias" in tree:
            out["bias"] = np.asarray(tree["bias"]).reshape(-1)
    return out


def _set(tree: dict, path: list[str], value):
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def load_torch_state_dict(
    state_dict: Mapping[str, Any], params: FluxParams, scan_blocks: bool = False
) -> dict[str, Any]:
    """BFL or diffusers state dict -> {"params": ...} (float32 numpy) for Flux(params).apply.

    With scan_blocks, each block kind is stacked into one ``{kind}_scan_0_{n}`` (whatever the FP8 policy).
    """
    sd = {k.removeprefix(_PREFIX): _to_numpy(v) for k, v in state_dict.items()}
    is_diffusers = any(k.startswith(("transformer_blocks.", "x_embedder.")) for k in sd)
    missing: list[str] = []
    if is_diffusers:
        sd, missing = _diffusers_to_bfl(sd)
    flax_shapes = _flax_shapes(params)
    expected = _expected_bfl_shapes(flax_shapes)
    missing += sorted(k for k in expected if k not in sd)
    unexpected = sorted(k for k in sd if k not in expected)
    wrong = sorted(
        f"{k}: got {tuple(sd[k].shape)}, expected {expected[k]}"
        for k in expected
        if k in sd and tuple(sd[k].shape) != expected[k]
    )
    if missing or unexpected or wrong:
        layout = "diffusers" if is_diffusers else "BFL"
        raise UserError(
            f"State dict ({layout} layout) does not match FluxParams {params}; check the preset/model "
            f"fields against the checkpoint.\n  missing: {missing}\n  unexpected: {unexpected}\n"
            f"  wrong shape: {wrong}"
        )
    tree: dict = {}
    for key, value in sd.items():
        parts = key.split(".")
        names: list[str] = []
        for part in parts:
            if part.isdigit():
                names[-1] = f"{names[-1]}_{part}"
            else:
                names.append(part)
        if names[-1] == "weight":
            names[-1], value = "kernel", value.T
        value = value.reshape(flax_shapes[key])  # a fused projection's parts on their own axis
        _set(tree, names, np.ascontiguousarray(value, dtype=np.float32))
    if scan_blocks:
        tree = _stack_blocks(tree, params)
    return {"params": tree}


def _stack_blocks(tree: dict, params: FluxParams) -> dict:
    for kind, n in (("double_blocks", params.depth), ("single_blocks", params.depth_single_blocks)):
        blocks = [tree.pop(f"{kind}_{i}") for i in range(n)]
        if blocks:
            tree[f"{kind}_scan_0_{n}"] = jax.tree_util.tree_map(lambda *x: np.stack(x), *blocks)
    return tree


def export_bfl_state_dict(variables: Mapping[str, Any], params: FluxParams) -> dict[str, np.ndarray]:
    """flux_jax variables (scanned or not, boxed or not) -> BFL state dict of float32 numpy arrays."""
    tree = nn.unbox(variables)
    tree = dict(tree.get("params", tree))
    for name in list(tree):
        m = _SCANNED.match(name)
        if m:
            stacked = tree.pop(name)
            for j, i in enumerate(range(int(m.group(2)), int(m.group(3)))):
                tree[f"{m.group(1)}_{i}"] = jax.tree_util.tree_map(lambda x, j=j: x[j], stacked)
    tree = _map_dense(tree)
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [_flax_name(k.key) for k in path]
        value = np.asarray(leaf, dtype=np.float32)
        if names[-1] == "kernel":
            names[-1], value = "weight", value.T
        out[".".join(names)] = np.ascontiguousarray(value)
    expected = _expected_bfl_shapes(_flax_shapes(params))
    if set(out) != set(expected):
        raise UserError(
            f"Variables do not match FluxParams {params}: missing {sorted(set(expected) - set(out))}, "
            f"unexpected {sorted(set(out) - set(expected))}; export with the preset the model was built from."
        )
    return out


def _map_dense(tree: Any) -> Any:
    """Every Dense's params in ``tree`` as ``_flat_dense`` gives them."""
    if not isinstance(tree, Mapping):
        return tree
    tree = {k: _map_dense(v) for k, v in tree.items()}
    return _flat_dense(tree) if "kernel" in tree else tree


def _read_safetensors(path: Path) -> dict[str, Any]:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.exists() for f in files):
        raise UserError(f"--input {path}: no .safetensors file found; pass a file or a diffusers directory.")
    from safetensors import SafetensorError

    out: dict[str, Any] = {}
    for f in files:
        try:
            out.update(_load_file(f))
        except (SafetensorError, OSError) as err:
            raise UserError(
                f"--input {f}: unreadable safetensors file ({err}); it is truncated or not "
                "safetensors: download or export it again."
            ) from None
    return out


def _load_file(f: Path) -> dict[str, Any]:
    try:
        from safetensors.numpy import load_file

        return load_file(f)
    except (TypeError, ValueError):  # bfloat16 needs the torch reader
        from safetensors.torch import load_file as load_torch

        return load_torch(f)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", required=True, type=Path)
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--to", choices=("flax", "bfl"), default="flax")
    parser.add_argument("--scan_blocks", action="store_true", help="stack blocks for a scanned model")
    args = parser.parse_args(argv)
    from safetensors.numpy import save_file

    params = PRESETS[args.preset]
    sd = _read_safetensors(args.input)
    if all("/" in k for k in sd):  # already flux_jax params
        variables: dict[str, Any] = {"params": {}}
        for k, v in sd.items():
            _set(variables["params"], k.split("/"), np.asarray(v, dtype=np.float32))
    else:
        variables = load_torch_state_dict(sd, params, scan_blocks=args.scan_blocks and args.to == "flax")
    if args.to == "bfl":
        out = export_bfl_state_dict(variables, params)
    else:
        flat = jax.tree_util.tree_flatten_with_path(variables["params"])[0]
        out = {"/".join(k.key for k in path): np.asarray(v) for path, v in flat}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(args.output))
    print(f"wrote {len(out)} tensors to {args.output}")


if __name__ == "__main__":
    cli.run(main)
