"""One way to build a run from a config: FluxParams, mesh, data pipelines, model, optimizer, and the
train state, shapes first.

``build(config)`` follows DESIGN's chain config -> mesh -> data shapes -> model (+ fp8 state) ->
optimizer and returns a ``Run``; ``abstract_state(run)`` is the train state as ``jax.ShapeDtypeStruct``s
with their shardings (``jax.eval_shape``, nothing allocated), and ``init_state`` fills that layout with
a sharded initialisation, so the full model never exists on one device. Training, sampling, the
converter and the benchmarks all build here: a new model field or preset is resolved in
``flux_params`` alone, a new data source dispatched in ``make_pipeline`` alone.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flux_jax import fp8, model, optim, sharding, steps
from flux_jax.errors import UserError


def flux_params(config) -> model.FluxParams:
    """The preset with every model field that names a FluxParams field and is not None applied.

    ``config`` is a run ConfigDict or the plain dict of a saved ``config.json`` / checkpoint config.
    """
    m = config["model"]
    if m["preset"] not in model.PRESETS:
        raise UserError(f"model.preset={m['preset']!r} must be one of {sorted(model.PRESETS)}")
    base = model.PRESETS[m["preset"]]
    overrides = {f.name: m.get(f.name) for f in dataclasses.fields(base) if m.get(f.name) is not None}
    if "axes_dim" in overrides:
        overrides["axes_dim"] = tuple(overrides["axes_dim"])
    return dataclasses.replace(base, **overrides)


def make_pipeline(
    config,
    split: str = "train",
    process_index: int | None = None,
    process_count: int | None = None,
    *,
    fp: model.FluxParams | None = None,
    per_host_batch: int | None = None,
    mock_records: int = 4096,
):
    """This host's batches of ``config.data.source``: the toy set, or grain over shards / mock data.

    per_host_batch defaults to global_batch_size / process_count; the text and pooled widths come
    from ``fp`` (default: ``flux_params(config)``).
    """
    fp = fp or flux_params(config)
    if process_index is None or process_count is None:
        process_index, process_count = jax.process_index(), jax.process_count()
    dims = dict(context_in_dim=fp.context_in_dim, vec_in_dim=fp.vec_in_dim, per_host_batch=per_host_batch)
    if config.data.source == "toy":
        from flux_jax import toy

        return toy.make_pipeline(config, split, process_index, process_count, **dims)
    from flux_jax import data

    return data.make_pipeline(config, split, process_index, process_count, mock_records=mock_records, **dims)


def input_shapes(fp: model.FluxParams, batch: int, img_len: int, txt_len: int) -> dict:
    """The model inputs of one batch as float32 ShapeDtypeStructs (the batch contract's arrays)."""
    shapes = {
        "img": (batch, img_len, fp.in_channels),
        "img_ids": (batch, img_len, 3),
        "txt": (batch, txt_len, fp.context_in_dim),
        "txt_ids": (batch, txt_len, 3),
        "y": (batch, fp.vec_in_dim),
    }
    return {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}


def config_input_shapes(config, fp: model.FluxParams, batch: int) -> dict:
    """input_shapes at the config's image size and text length."""
    img_len = (int(config.data.image_size) // (8 * 2)) ** 2  # 8x VAE, 2x2 patches
    return input_shapes(fp, batch, img_len, int(config.data.txt_len))


def init_args(fp: model.FluxParams, shapes: dict) -> tuple:
    """Zero positional arguments for ``Flux.init`` at ``shapes`` (init depends on shapes alone)."""
    z = {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}
    t = jnp.zeros(shapes["img"].shape[:1], jnp.float32)
    return (z["img"], z["img_ids"], z["txt"], z["txt_ids"], t, z["y"], t if fp.guidance_embed else None)


def abstract_variables(net: model.Flux, shapes: dict | None = None):
    """``net.init``'s variables (boxed) as ShapeDtypeStructs; default: one token of each kind."""
    shapes = shapes or input_shapes(net.params, 1, 1, 1)
    return jax.eval_shape(lambda r: net.init(r, *init_args(net.params, shapes)), jax.random.key(0))


@dataclasses.dataclass(frozen=True)
class Run:
    """What a config builds: model description, mesh, model, optimizer and step geometry."""

    config: Any
    fp: model.FluxParams
    mesh: Mesh
    rules: sharding.Rules
    use_fp8: bool
    net: model.Flux
    tx: optax.GradientTransformation
    num_micro: int  # micro batches per optimizer step (gradient accumulation)
    shapes: dict  # one example's model inputs (batch 1), from the config's image size and text length

    def model_for(self, use_fp8: bool) -> model.Flux:
        """The same model with FP8 on or off (the non-finite fallback switches to BF16)."""
        return steps.make_model(self.config, self.fp, use_fp8)


def build(config, devices=None) -> Run:
    """config -> mesh -> shapes -> model (+ fp8 policy) -> optimizer; ``devices`` defaults to all."""
    fp = flux_params(config)
    mesh = sharding.make_mesh(config, devices)
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    use_fp8 = config.fp8 is not None
    return Run(
        config=config,
        fp=fp,
        mesh=mesh,
        rules=sharding.rules_from_config(config),
        use_fp8=use_fp8,
        net=steps.make_model(config, fp, use_fp8),
        tx=optim.make_optimizer(config),
        num_micro=config.global_batch_size // (config.micro_batch_size * dp),
        shapes=config_input_shapes(config, fp, 1),
    )


def train_state(params, opt_state, fp8_meta, rng, step=None) -> dict:
    """The state dict steps.make_train_step takes and returns."""
    step = jnp.zeros((), jnp.int32) if step is None else step
    return {"step": step, "params": params, "opt_state": opt_state, "fp8_meta": fp8_meta, "rng": rng}


def _variables(run: Run, rng):
    """run.net's variables at run.shapes, logical-partitioning boxes stripped."""
    with nn.logical_axis_rules(run.rules):
        return sharding.unbox(run.net.init(rng, *init_args(run.fp, run.shapes)))


def _state(run: Run, init_rng, step_rng) -> dict:
    variables = _variables(run, init_rng)
    params = variables["params"]
    return train_state(params, run.tx.init(params), dict(variables.get(fp8.FP8_COLLECTION, {})), step_rng)


def abstract_state(run: Run) -> tuple[dict, dict]:
    """(the train state as ShapeDtypeStructs carrying their shardings, those shardings); nothing is
    allocated. Params are sharded by the logical-axis rules, AdamW moments like their params,
    fp8_meta and scalars replicated."""
    replicated = NamedSharding(run.mesh, PartitionSpec())
    params = sharding.param_shardings(abstract_variables(run.net, run.shapes), run.mesh, run.rules)["params"]
    shapes = jax.eval_shape(lambda r: _state(run, r, r), jax.random.key(0))
    opt = optax.tree_map_params(
        run.tx, lambda _, s: s, shapes["opt_state"], params, transform_non_params=lambda _: replicated
    )
    fp8_meta = jax.tree.map(lambda _: replicated, shapes["fp8_meta"])
    shardings = train_state(params, opt, fp8_meta, replicated, step=replicated)
    place = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    abstract = jax.tree.map(place, shapes, shardings)
    return abstract, shardings


def init_state(run: Run, init_rng, step_rng, shardings: dict) -> dict:
    """The fresh train state, each leaf initialised straight into its shards (``shardings`` from
    abstract_state), so the full model never exists on one device.

    Params come from ``init_rng``, then from ``config.init_from`` when set (AdamW moments start at zero
    either way); ``step_rng`` seeds the steps' timesteps and noise.
    """
    with jax.set_mesh(run.mesh):
        state = jax.jit(lambda a, b: _state(run, a, b), out_shardings=shardings)(init_rng, step_rng)
    if run.config.init_from:
        from flux_jax import checkpoint

        state["params"] = checkpoint.load_init_from(
            run.config.init_from, run.fp, state["params"], scan_blocks=run.config.model.scan_blocks
        )
    return state


def fresh_fp8_meta(run: Run, shardings: dict) -> dict:
    """The initial FP8 scaling state alone ({} without FP8), which does not depend on the rng: what an
    FP8 run resuming a BF16 checkpoint starts from. XLA drops the unused parameter init."""
    if not run.use_fp8:
        return {}
    with jax.set_mesh(run.mesh):
        init = jax.jit(lambda r: _state(run, r, r)["fp8_meta"], out_shardings=shardings["fp8_meta"])
        return init(jax.random.key(0))


def parameter_count(state: dict) -> int:
    """Parameters in a train state (abstract or concrete)."""
    return sum(x.size for x in jax.tree.leaves(state["params"]))
