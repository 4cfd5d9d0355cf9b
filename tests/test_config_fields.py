"""Every field of every shipped config changes something, or is listed as informational with a reason.

FIELDS is the table: per dotted field, the probe that observes it (the resolved FluxParams, the
model's forward jaxpr, the train step's jaxpr, the learning-rate schedule, an optimizer update, the
first data batch, the mesh, the parameter shardings, the checkpoints written, the FP8 spec, the
initial params), the value that must change the probe's output, and the other fields that value
needs in order to matter. Loop-control fields point at the end-to-end test that proves them. The
probes run on the tiny toy config (the shipped configs share one base, so one set of fields); a
field added to configs/base.py fails this test until it gets a row.
"""

import hashlib
import importlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_tiny_config
from ml_collections import config_dict

from flux_jax import checkpoint, fp8, optim, setup, steps

SHIPPED = [(name, arg) for name in ("toy", "flux_535m", "flux_12b") for arg in (None, "fp8")]
FP8 = {"fp8": "e4m3"}


def flat_fields(c, prefix: str = "") -> list[str]:
    out = []
    for key in c.keys():
        value = c._fields[key]
        if isinstance(value, config_dict.ConfigDict):
            out += flat_fields(value, f"{prefix}{key}.")
        else:
            out.append(prefix + key)
    return out


def _one_device(c):
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
    return setup.build(c, jax.devices()[:1])


def _digest(tree) -> str:
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        leaf = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}{leaf.shape}{leaf.dtype}".encode())
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


# ---- Probes: config -> something comparable ------------------------------------------------------
def flux_params(c):
    return setup.flux_params(c)


def model_fields(c):
    net = _one_device(c).net
    return (net.dtype, net.scan_blocks, net.remat, net.attention_impl)


def forward(c):
    run = _one_device(c)
    variables = setup.sharding.unbox(setup.abstract_variables(run.net, run.shapes))
    args = setup.init_args(run.fp, run.shapes)
    return str(jax.make_jaxpr(lambda v: run.net.apply(v, *args))(variables))


def train_step(c):
    run = _one_device(c)
    state, _ = setup.abstract_state(run)
    shapes = setup.config_input_shapes(c, run.fp, c.global_batch_size)
    step = steps.make_train_step(c, run.net, run.tx, run.num_micro, run.use_fp8)
    return str(jax.make_jaxpr(step)(state, shapes))


def lr_schedule(c):
    schedule = optim.lr_schedule(c)
    return tuple(float(schedule(s)) for s in (0, 1, 5, 20, 150, 299, 700, 1000, 3000))


def optimizer_update(c):
    tx = optim.make_optimizer(c)
    params = {"w": jnp.ones((4, 4)), "bias": jnp.ones((4,))}
    state = tx.init(params)
    for k in range(4):
        # A new direction each step (clipping would make equal directions equal gradients).
        grads = jax.tree.map(
            lambda p, k=k: 3.0 * jnp.sin((k + 1.0) * jnp.arange(p.size)).reshape(p.shape), params
        )
        updates, state = tx.update(grads, state, params)
        params = jax.tree.map(jnp.add, params, updates)
    return _digest(params)


def data_batch(c):
    return _digest(next(setup.make_pipeline(c, "train", 0, 1)))


def val_batch(c):
    return _digest(next(setup.make_pipeline(c, "val", 0, 1)))


def mesh(c):
    return dict(setup.build(c).mesh.shape)


def param_shardings(c):
    _, shardings = setup.abstract_state(setup.build(c))
    return str(jax.tree.map(lambda s: s.spec, shardings["params"]))


def config_problems(c):
    return tuple(fp8.config_problems(c, fp8.DeviceDescription("cpu")))


def fp8_spec(c):
    return fp8.spec_from_config(c, fp8.DeviceDescription("cpu"))


def checkpoints_kept(c, tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path / str(len(list(tmp_path.iterdir()))), c)
    state = {"step": jnp.zeros((), jnp.int32), "w": jnp.ones((2,))}
    for step in range(1, 7):
        ckpt.save(step, state)
    ckpt.close()
    return ckpt.all_steps()


def initial_params(c, tmp_path):
    run = _one_device(c)
    _, shardings = setup.abstract_state(run)
    state = setup.init_state(run, jax.random.key(0), jax.random.key(1), shardings)
    return _digest(state["params"])


def weights_file(tmp_path) -> str:
    """Tiny-preset weights in BFL layout, all 0.5: what init_from loads."""
    from safetensors.numpy import save_file

    from flux_jax import convert

    run = _one_device(make_tiny_config())
    abstract = setup.sharding.unbox(setup.abstract_variables(run.net, run.shapes))
    half = jax.tree.map(lambda x: np.full(x.shape, 0.5, np.float32), abstract)
    path = str(tmp_path / "tiny.safetensors")
    save_file(convert.export_bfl_state_dict(half, run.fp), path)
    return path


def shards(records: int, first: int = 0):
    """A shard folder of tiny records (16x4x4 latents, 4 x 32 T5, 32 CLIP), each filled with its
    number, ``first`` .. ``first + records - 1``."""

    def write(tmp_path) -> str:
        from flux_jax import shards as shard_io

        path = tmp_path / f"shards_{first}_{records}"
        if not path.exists():
            samples = [
                {
                    "id": str(i),
                    "latent": np.full((16, 4, 4), float(i), np.float32),
                    "t5_encodings": np.full((4, 32), float(i), np.float32),
                    "clip_encodings": np.full((32,), float(i), np.float32),
                }
                for i in range(first, first + records)
            ]
            path.mkdir()
            shard_io.write_shard(path / shard_io.shard_name(0), samples)
        return str(path)

    return write


SHARDS = {
    "data.source": "shards",
    "data.cfg_dropout_prob": 0.0,
    "data.path": shards(12),
    "data.val_path": shards(12),
}


def proved_by(test: str):
    """A loop-control field: ``test`` ("file.py::name") runs the train loop with it changed."""
    return ("proved_by", test)


def informational(reason: str):
    return ("informational", reason)


# ---- The table -----------------------------------------------------------------------------------
# field: (probe, changed value, context applied to both sides) | proved_by(...) | informational(...)
FIELDS = {
    "seed": (data_batch, 1, {}),
    "model.preset": (flux_params, "tiny-dev", {}),
    "model.depth": (flux_params, 2, {}),
    "model.depth_single_blocks": (flux_params, 2, {}),
    # Width and heads move together: head_dim must stay sum(axes_dim) (16 in the tiny preset).
    "model.hidden_size": (flux_params, 48, {}, {"model.num_heads": 3}),
    "model.num_heads": (flux_params, 1, {}, {"model.hidden_size": 16}),
    "model.context_in_dim": (flux_params, 48, {}),
    "model.vec_in_dim": (flux_params, 48, {}),
    "model.guidance_embed": (flux_params, True, {}),
    "model.dtype": (forward, "bfloat16", {}),
    "model.scan_blocks": (forward, True, {}),
    # cuDNN attention traces only on an NVIDIA GPU; the model built from the config carries it.
    "model.attention": (model_fields, "cudnn", {}),
    "recompute_granularity": (forward, "full", {}),
    "fp8": (forward, "e4m3", {}),
    "fp8_recipe": (forward, "tensorwise", FP8),
    "fp8_margin": (forward, 1, FP8),
    "fp8_amax_history_len": (forward, 4, FP8),
    "fp8_amax_compute_algo": (forward, "most_recent", FP8),
    "fp8_wgrad": (train_step, False, FP8),
    "fp8_format_family": (forward, "fnuz", FP8),
    "fp8_modulation": (forward, True, FP8),
    # "triton" only runs on one NVIDIA GPU; the FP8 spec every dot is built from carries it.
    "fp8_cast_kernel": (fp8_spec, "triton", FP8 | {"fp8_cast_kernel": "xla"}),
    "fp8_cache_weights": (train_step, False, FP8),
    # Refused everywhere for now (wrong gradients measured on an H100): setting it is a config error.
    "fp8_dot_product_attention": (config_problems, True, FP8),  # tiny config: 8 micro batches per step
    "first_last_layers_bf16": (forward, True, FP8),
    "num_layers_at_start_in_bf16": (forward, 0, FP8 | {"first_last_layers_bf16": True}),
    "num_layers_at_end_in_bf16": (forward, 0, FP8 | {"first_last_layers_bf16": True}),
    "micro_batch_size": (train_step, 2, {}),
    "global_batch_size": (data_batch, 4, {}),
    "train_iters": (lr_schedule, 1000, {}),
    "lr": (lr_schedule, 2e-3, {}),
    "min_lr": (lr_schedule, 1e-5, {}),
    "lr_warmup_iters": (lr_schedule, 10, {}),
    "lr_decay_style": (lr_schedule, "constant", {}),
    "weight_decay": (optimizer_update, 0.5, {}),
    "adam_beta1": (optimizer_update, 0.5, {}),
    "adam_beta2": (optimizer_update, 0.9, {}),
    "adam_eps": (optimizer_update, 0.5, {}),
    "adam_moments_dtype": (optimizer_update, "bfloat16", {}),
    "clip_grad": (optimizer_update, 0.0, {}),
    "save_interval": (checkpoints_kept, 2, {"save_interval": 1, "checkpoint.max_to_keep": 10}),
    "log_interval": proved_by("test_train.py::test_metrics_read_one_step_late_match_every_step_reads"),
    "eval_interval": proved_by("test_train.py::test_validation_fields_steer_the_loop"),
    "eval_iters": proved_by("test_train.py::test_validation_fields_steer_the_loop"),
    "timestep_sampling": (train_step, "uniform", {}),
    "logit_mean": (train_step, 0.5, {}),
    "logit_std": (train_step, 2.0, {}),
    "mode_scale": (train_step, 0.5, {"timestep_sampling": "mode"}),
    "timestep_shift": (train_step, 3.0, {}),
    "guidance_scale": (train_step, 4.0, {"model.guidance_embed": True}),
    "max_nonfinite_steps": proved_by("test_train.py::test_nonfinite_steps_switch_fp8_to_bf16_then_stop"),
    "on_nonfinite": proved_by("test_train.py::test_nonfinite_steps_switch_fp8_to_bf16_then_stop"),
    "target_val_loss": proved_by("test_train.py::test_validation_fields_steer_the_loop"),
    "data.source": (data_batch, "mock", {}),
    "data.path": (data_batch, shards(10, first=100), SHARDS),
    "data.val_path": (val_batch, shards(10, first=100), SHARDS),
    "data.image_size": (data_batch, 64, {}),
    "data.txt_len": (data_batch, 6, {}),
    "data.cfg_dropout_prob": (data_batch, 1.0, {}),
    "data.num_workers": informational(
        "loader processes only: the batches are the same by design "
        "(test_data.py::test_worker_processes_match_in_process)"
    ),
    "data.shuffle": (data_batch, False, {"data.source": "mock"}),
    "data.log_ids": proved_by(
        "test_multihost.py::test_data_parallel_matches_one_process_and_writes_outputs_once"
    ),
    "mesh.data": (mesh, 2, {"mesh.data": 1, "mesh.fsdp": -1}),
    "mesh.fsdp": (mesh, 2, {}),
    "mesh.tensor": (mesh, 2, {}),
    "logical_axis_rules": (param_shardings, "embed=none", {"mesh.data": 1, "mesh.fsdp": -1}),
    "checkpoint.max_to_keep": (checkpoints_kept, 3, {"save_interval": 1}),
    "checkpoint.keep_period": (checkpoints_kept, 2, {"save_interval": 1}),
    "checkpoint.async_save": informational("when the files are written, not what: the same checkpoints"),
    "init_from": (initial_params, weights_file, {}),
}


def _set(c, dotted: str, value) -> None:
    *path, leaf = dotted.split(".")
    for p in path:
        c = c[p]
    c[leaf] = value


def _variant(changes: dict, context: dict, tmp_path):
    """The tiny config with ``context`` then ``changes`` set; callable values are made in tmp_path."""
    c = make_tiny_config()
    for k, v in (context | changes).items():
        _set(c, k, v(tmp_path) if callable(v) else v)
    return c


@pytest.mark.parametrize("name,arg", SHIPPED)
def test_every_field_of_every_shipped_config_has_a_row(name, arg):
    config = importlib.import_module(f"configs.{name}").get_config(arg)
    fields = flat_fields(config)
    assert fields == flat_fields(make_tiny_config())  # one base: the probes' config has the same fields
    assert sorted(set(fields) - set(FIELDS)) == [], "add a row to FIELDS for each new config field"
    assert sorted(set(FIELDS) - set(fields)) == [], "remove the rows of fields that no longer exist"


_BASELINES = {}


@pytest.mark.parametrize("field", sorted(k for k, v in FIELDS.items() if callable(v[0])))
def test_field_changes_what_its_probe_observes(field, tmp_path):
    probe, value, context, *also = FIELDS[field]
    base = _variant({}, context, tmp_path)
    changed = _variant({field: value, **(also[0] if also else {})}, context, tmp_path)
    assert _get(base, field) != _get(changed, field), "the row's value must differ from the context's"
    kwargs = {"tmp_path": tmp_path} if "tmp_path" in inspect.signature(probe).parameters else {}
    key = (probe.__name__, repr(sorted(context.items())))
    if key not in _BASELINES:  # rows sharing a probe and a context share the unchanged side
        _BASELINES[key] = probe(base, **kwargs)
    assert _BASELINES[key] != probe(changed, **kwargs), f"{field} changed nothing {probe.__name__} sees"


@pytest.mark.parametrize("field", sorted(k for k, v in FIELDS.items() if v[0] == "proved_by"))
def test_loop_fields_are_proved_by_a_test_that_sets_them(field):
    file, name = FIELDS[field][1].split("::")
    module = importlib.import_module(file.removesuffix(".py"))
    source = inspect.getsource(getattr(module, name))
    assert field.split(".")[-1] in source, f"{file}::{name} does not set {field}"


def test_informational_fields_say_why():
    for field, row in FIELDS.items():
        if row[0] == "informational":
            assert len(row[1]) > 20, field


def _get(c, dotted: str):
    for part in dotted.split("."):
        c = c[part]
    return c
