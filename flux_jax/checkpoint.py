"""Checkpoints: train state, data iterator and resolved config under WORKDIR/checkpoints.

Each step directory holds three orbax items: "state" (the train-state pytree: step, params,
opt_state, fp8_meta, rng), "data" (the data iterator state, JSON) and "config" (the resolved run
config, JSON, so a checkpoint explains itself). Orbax writes a step into a temporary directory
and renames it when complete, so a run killed mid-save leaves the previous checkpoint as latest.

Also here: `load_init_from` (config.init_from: BFL/diffusers weights or another run's params) and
the `export` command
(`python -m flux_jax.checkpoint export --workdir W --output out.safetensors`).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from flux_jax import cli
from flux_jax.errors import UserError

log = logging.getLogger(__name__)

_STATE, _DATA, _CONFIG = "state", "data", "config"
_FP8 = "fp8_meta"


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _flat(tree) -> dict[str, Any]:
    return {_path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_to_data(tree):
    """Typed PRNG keys are stored as their uint32 data; orbax has no type for them."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _abstract_key_data(tree):
    def convert(x):
        if not _is_key(x):
            return x
        data = jax.eval_shape(jax.random.key_data, x)
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=x.sharding)

    return jax.tree.map(convert, tree)


def _data_to_keys(restored, abstract):
    return jax.tree.map(lambda x, a: jax.random.wrap_key_data(x) if _is_key(a) else x, restored, abstract)


def shape_mismatches(expected, found) -> list[str]:
    """Lines 'path: expected (shape) found (shape)' for every leaf that differs or is missing."""
    want, have = _flat(expected), _flat(found)
    lines = []
    for path, leaf in want.items():
        if path not in have:
            lines.append(f"{path}: expected {tuple(leaf.shape)}, missing in checkpoint")
        elif tuple(have[path].shape) != tuple(leaf.shape):
            lines.append(f"{path}: expected {tuple(leaf.shape)}, found {tuple(have[path].shape)}")
    lines += [f"{p}: not expected, found {tuple(have[p].shape)}" for p in have if p not in want]
    return lines


# A scanned stack split by FP8 policy segment (double_blocks_scan_1_19): the layout flux_jax wrote
# before the param tree became independent of the policy.
_SEGMENT = re.compile(r"^(double|single)_blocks_scan_([1-9]\d*)_\d+$")


def segmented_layout_fix(params, workdir) -> str:
    """The fix for params whose scanned stacks are split by policy segment; "" for any other tree."""
    names = sorted(k for k in (params or {}) if _SEGMENT.match(str(k)))
    if not names:
        return ""
    return (
        f"\nThese params split scanned blocks by FP8 policy segment ({', '.join(names)}), a layout of "
        "earlier flux_jax versions; every policy now shares one stack per block kind. Fix: export them "
        f"(python -m flux_jax.checkpoint export --workdir {workdir} --output params.safetensors) and "
        "start a new --workdir with --config.init_from=params.safetensors (optimizer state starts fresh)."
    )


def flat_fused_layout_fix(expected, found, workdir) -> str:
    """The fix for params whose fused projections are BFL's flat matrices; "" for any other tree.

    flux_jax once stored qkv, the modulation lin, linear1 and linear2 as BFL's flat (in, out) kernels
    and biases; they now keep each part on an axis of its own (layers.fused_dense), the same values
    reshaped. A leaf with the expected number of values in fewer axes is that layout.
    """
    want, have = _flat(expected or {}), _flat(found or {})
    flat = sorted(
        p
        for p, leaf in want.items()
        if p in have
        and len(have[p].shape) < len(leaf.shape)
        and int(np.prod(have[p].shape)) == int(np.prod(leaf.shape))
    )
    if not flat:
        return ""
    return (
        f"\nThese params hold the fused projections as flat matrices ({', '.join(flat[:4])}"
        f"{', ...' if len(flat) > 4 else ''}), the layout of earlier flux_jax versions; they are now "
        "laid out head-aligned for tensor parallelism (the same values, reshaped). Fix: export them "
        f"(python -m flux_jax.checkpoint export --workdir {workdir} --output params.safetensors) and start "
        "a new --workdir with --config.init_from=params.safetensors (optimizer state starts fresh)."
    )


def _config_json(config) -> dict:
    if hasattr(config, "to_json_best_effort"):
        return json.loads(config.to_json_best_effort())
    return json.loads(json.dumps(dict(config), default=str))


def _replicated_like(metadata_tree):
    """Abstract tree for checkpoint leaves the caller has no template for (read, then dropped)."""
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding), metadata_tree
    )


def _is_empty(tree) -> bool:
    return tree is None or not jax.tree_util.tree_leaves(tree)


class Checkpointer:
    """Saves and restores train state, data state and config with one orbax CheckpointManager."""

    def __init__(self, workdir, config):
        self.directory = epath.Path(workdir) / "checkpoints"
        self._interval = int(config.save_interval or 0)
        self._config = _config_json(config)
        ck = config.checkpoint
        options = ocp.CheckpointManagerOptions(
            max_to_keep=ck.max_to_keep,
            keep_period=ck.keep_period,
            enable_async_checkpointing=bool(ck.async_save),
            create=True,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                _STATE: ocp.StandardCheckpointHandler(),
                _DATA: ocp.JsonCheckpointHandler(),
                _CONFIG: ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        """Newest complete checkpoint; orbax never lists a step whose write did not finish."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def due(self, step: int) -> bool:
        """Whether ``step`` is a multiple of config.save_interval (0 saves only when forced)."""
        return self._interval > 0 and int(step) % self._interval == 0

    def save(self, step: int, state, data_state=None, force: bool = False) -> bool:
        """Saves at multiples of config.save_interval (always with force). True when a save started."""
        step = int(step)
        if not (force or self.due(step)) or step in self._manager.all_steps():
            return False
        items = {
            _STATE: ocp.args.StandardSave(_keys_to_data(state)),
            _CONFIG: ocp.args.JsonSave(self._config),
        }
        if data_state is not None:
            items[_DATA] = ocp.args.JsonSave(data_state)
        return self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, step: int, abstract_state, data_state=None, fresh_fp8_meta=None):
        """Restores `step` onto the shardings in `abstract_state` (so any mesh works).

        Precision switches: a checkpoint's fp8_meta is skipped when abstract_state["fp8_meta"] is
        empty (a BF16 run), and `fresh_fp8_meta` is used when the checkpoint has none (an FP8 run
        resuming a BF16 checkpoint). Returns (state, data_state); data_state is the saved one
        when the checkpoint has it, else the argument.
        """
        step_dir = self.directory / str(step)
        if step not in self._manager.all_steps():
            raise UserError(
                f"No complete checkpoint for step {step} in {self.directory} (found {self.all_steps()}). "
                "Fix: pass one of the listed steps, or a workdir that holds the run."
            )
        try:
            found = self._manager.item_metadata(step)[_STATE]
            found = getattr(found, "tree", found)
        except Exception as e:
            raise _unreadable(step_dir, self.all_steps(), e) from e
        if found is None:
            raise _unreadable(step_dir, self.all_steps(), "no metadata for item 'state'")
        target = dict(_abstract_key_data(abstract_state))
        want_fp8 = not _is_empty(target.get(_FP8))
        have_fp8 = not _is_empty(found.get(_FP8))
        if have_fp8 and not want_fp8:
            log.info(
                "Checkpoint %s has fp8_meta; this run does not use FP8, so it is not restored.", step_dir
            )
            target[_FP8] = _replicated_like(found[_FP8])
        elif want_fp8 and not have_fp8:
            if fresh_fp8_meta is None:
                raise ValueError(
                    f"Checkpoint {step_dir} has no fp8_meta (saved by a BF16 run) but this run uses FP8. "
                    "Fix: pass fresh_fp8_meta= (the initial FP8 state) to Checkpointer.restore."
                )
            log.info("Checkpoint %s has no fp8_meta; starting FP8 from fresh scaling state.", step_dir)
            target[_FP8] = found.get(_FP8, {})
        bad = shape_mismatches(target, found)
        if bad:
            raise UserError(
                f"Checkpoint {step_dir} does not fit this model: {len(bad)} mismatching entries:\n  "
                + "\n  ".join(bad[:50])
                + "\nFix: use the model config the checkpoint was saved with (see its 'config' item), "
                "or start a new --workdir (config.init_from can load its params only)."
                + segmented_layout_fix(found.get("params"), self.directory.parent)
                + flat_fused_layout_fix(target.get("params"), found.get("params"), self.directory.parent)
            )
        items = {_STATE: ocp.args.StandardRestore(target)}
        has_data = (step_dir / _DATA).exists()
        if has_data:
            items[_DATA] = ocp.args.JsonRestore()
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:
            raise _unreadable(step_dir, self.all_steps(), e) from e
        state = dict(restored[_STATE])
        if have_fp8 and not want_fp8:
            state[_FP8] = abstract_state[_FP8]
        elif want_fp8 and not have_fp8:
            state[_FP8] = fresh_fp8_meta
        state = _data_to_keys(state, {**abstract_state, _FP8: state[_FP8]})
        return state, (restored[_DATA] if has_data else data_state)

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def _unreadable(step_dir, steps, err) -> UserError:
    older = [s for s in steps if s < int(step_dir.name)]
    fix = f"delete {step_dir} to resume from step {older[-1]}" if older else f"delete {step_dir}"
    return UserError(f"Checkpoint {step_dir} is unreadable (truncated or corrupt: {err}). Fix: {fix}.")


def _find_step_dir(path: epath.Path) -> epath.Path | None:
    """A flux_jax workdir, its checkpoints/ directory, or one step directory -> that step directory."""
    if (path / _STATE).is_dir():
        return path
    for root in (path / "checkpoints", path):
        if root.is_dir():
            steps = ocp.utils.checkpoint_steps(root)
            if steps:
                return root / str(max(steps))
    return None


def read_params(step_dir, abstract_params=None):
    """Params only from a checkpoint step directory (numpy arrays when abstract_params is None)."""
    step_dir = epath.Path(step_dir)
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        # The handler reads the item's own metadata; Checkpointer.metadata would also look for a
        # step-level metadata file inside the item directory and warn that it is missing.
        found = ocp.PyTreeCheckpointHandler().metadata(step_dir / _STATE).tree["params"]
    except Exception as e:
        raise _unreadable(step_dir, [], e) from e
    if abstract_params is None:
        target = jax.tree.map(lambda m: np.zeros((), m.dtype), found)
        restore_args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), found)
    else:
        bad = shape_mismatches(abstract_params, found)
        if bad:
            raise UserError(
                f"Params in {step_dir} do not fit this model:\n  " + "\n  ".join(bad[:50]) + "\n"
                "Fix: set the model config to the one that checkpoint was trained with."
                + segmented_layout_fix(found, step_dir.parent.parent)
                + flat_fused_layout_fix(abstract_params, found, step_dir.parent.parent)
            )
        target = abstract_params
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_params)
    try:
        restored = checkpointer.restore(
            step_dir / _STATE,
            args=ocp.args.PyTreeRestore(
                item={"params": target}, restore_args={"params": restore_args}, partial_restore=True
            ),
        )
    except Exception as e:
        raise _unreadable(step_dir, [], e) from e
    return restored["params"]


def _read_safetensors(files) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError, safe_open

    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as fh:
                for name in fh.keys():
                    out[name] = fh.get_tensor(name).astype(np.float32)
        except (SafetensorError, OSError) as err:
            raise UserError(
                f"config.init_from: {f} is not a readable safetensors file ({err}). Fix: download or "
                "export it again, or point config.init_from at another file."
            ) from None
    return out


def _place(tree, abstract):
    def put(x, a):
        x = np.asarray(x, dtype=a.dtype)
        if getattr(a, "sharding", None) is None:
            return jax.numpy.asarray(x)
        return jax.make_array_from_callback(x.shape, a.sharding, lambda idx: x[idx])

    return jax.tree.map(put, tree, abstract)


def load_init_from(path, flux_params, abstract_params, scan_blocks: bool = False):
    """Initial params for config.init_from, placed on abstract_params' shardings.

    `path`: a BFL or diffusers .safetensors file, a diffusers transformer/ folder (or its parent),
    or a flux_jax workdir / checkpoint directory (params only; optimizer state starts fresh).
    The params of a model do not depend on its FP8 policy, so FP8 and BF16 runs load the same ones.
    """
    p = epath.Path(path)
    field = f"config.init_from={path!s}"
    if not p.exists():
        raise UserError(f"{field} does not exist. Fix: point it at a .safetensors file or a checkpoint dir.")
    step_dir = _find_step_dir(p) if p.is_dir() else None
    if step_dir is not None:
        return read_params(step_dir, abstract_params)
    if p.is_dir() and (p / "transformer").is_dir():
        p = p / "transformer"
    files = (
        [p]
        if p.is_file() and p.suffix == ".safetensors"
        else sorted(p.glob("*.safetensors"))
        if p.is_dir()
        else []
    )
    if not files:
        raise UserError(
            f"{field} is neither a .safetensors file, a diffusers transformer/ folder, nor a flux_jax "
            "checkpoint. Fix: point it at one of those."
        )
    from flux_jax import convert

    state_dict = _read_safetensors(files)
    variables = convert.load_torch_state_dict(state_dict, flux_params, scan_blocks)
    params = variables["params"]
    bad = shape_mismatches(abstract_params, params)
    if bad:
        raise UserError(
            f"Weights in {path} do not fit this model:\n  " + "\n  ".join(bad[:50]) + "\n"
            "Fix: set config.model.preset (and overrides) to the model those weights belong to."
        )
    return _place(params, abstract_params)


def latest_step_in(workdir) -> int | None:
    """The newest complete checkpoint step under WORKDIR/checkpoints, without opening a manager."""
    root = epath.Path(workdir) / "checkpoints"
    steps = ocp.utils.checkpoint_steps(root) if root.is_dir() else []
    return max(steps) if steps else None


def export(workdir, output, step: int | None = None, dtype: str = "bfloat16") -> epath.Path:
    """Writes a checkpoint's params as a BFL-layout .safetensors file; returns the file."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from flux_jax import convert, setup

    root = epath.Path(workdir) / "checkpoints"
    steps = ocp.utils.checkpoint_steps(root) if root.is_dir() else []
    if not steps or (step is not None and step not in steps):
        raise UserError(
            f"No checkpoint{'' if step is None else f' {step}'} in {root} (found {sorted(steps)}). Fix: pass "
            "the --workdir of a training run and, with --step, one of the steps found."
        )
    step_dir = root / str(step if step is not None else max(steps))
    try:
        cfg = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(step_dir / _CONFIG)
    except Exception as e:  # orbax raises many types for a missing or corrupt item
        raise _unreadable(step_dir, steps, e) from e
    params = read_params(step_dir)
    tensors = convert.export_bfl_state_dict({"params": params}, setup.flux_params(cfg))
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype]
    save_file(
        {k: np.ascontiguousarray(np.asarray(v, np.float32).astype(np_dtype)) for k, v in tensors.items()},
        str(output),
    )
    return epath.Path(output)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flux_jax.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a checkpoint's params as BFL-layout safetensors")
    ex.add_argument("--workdir", required=True)
    ex.add_argument("--step", type=int, default=None, help="default: latest")
    ex.add_argument("--output", required=True)
    ex.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    path = export(args.workdir, args.output, args.step, args.dtype)
    print(f"wrote {path}")


if __name__ == "__main__":
    cli.run(main)
