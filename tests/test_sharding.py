"""Mesh construction, logical-axis rules, and sharded training maths equal to one device."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from configs import toy as toy_config
from flux_jax import fp8, setup, sharding
from flux_jax.layers import dense
from flux_jax.model import PRESETS, Flux


def _config(data, fsdp, tensor, **extra):
    return ml_collections.ConfigDict({"mesh": {"data": data, "fsdp": fsdp, "tensor": tensor}, **extra})


@pytest.mark.parametrize(
    "sizes, shape",
    [((-1, 1, 1), (8, 1, 1)), ((2, -1, 2), (2, 2, 2)), ((1, 4, -1), (1, 4, 2)), ((1, 1, 8), (1, 1, 8))],
)
def test_make_mesh_shapes(sizes, shape):
    mesh = sharding.make_mesh(_config(*sizes))
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert tuple(mesh.shape.values()) == shape
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


def test_make_mesh_on_subset_of_devices():
    mesh = sharding.make_mesh(_config(1, -1, 2), devices=jax.devices()[:4])
    assert tuple(mesh.shape.values()) == (1, 2, 2)


@pytest.mark.parametrize(
    "sizes, message",
    [
        ((2, 2, 1), "config.mesh.data \\* config.mesh.fsdp \\* config.mesh.tensor = 4"),
        ((-1, -1, 1), "at most one"),
        ((3, -1, 1), "does not divide"),
        ((0, 8, 1), "config.mesh.data must be"),
    ],
)
def test_make_mesh_errors(sizes, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(_config(*sizes))


def test_multi_host_split_keeps_tensor_in_host():
    assert sharding._split_over_hosts((4, 4, 2), 2) == ((2, 4, 2), (2, 1, 1))
    assert sharding._split_over_hosts((1, 8, 4), 4) == ((1, 2, 4), (1, 4, 1))
    with pytest.raises(ValueError, match="config.mesh"):
        sharding._split_over_hosts((1, 3, 8), 2)


def test_logical_to_spec_fallbacks():
    mesh = sharding.make_mesh(_config(2, 2, 2))
    assert sharding.logical_to_spec(("embed", "mlp"), (8, 16), mesh) == PartitionSpec("fsdp", "tensor")
    # 3 is not divisible by the fsdp size: that dimension is replicated, the other still sharded.
    assert sharding.logical_to_spec(("embed", "mlp"), (3, 16), mesh) == PartitionSpec(None, "tensor")
    assert sharding.logical_to_spec(("in", None), (64, 4), mesh) == PartitionSpec(None, None)
    # A mesh axis used once per array: the second "tensor" claim falls back to replication.
    assert sharding.logical_to_spec(("mlp", "heads"), (4, 4), mesh) == PartitionSpec("tensor", None)
    assert sharding.logical_to_spec(("act_batch", None), (8, 3), mesh) == PartitionSpec(
        ("data", "fsdp"), None
    )


def test_rules_from_config_override():
    assert sharding.rules_from_config(_config(1, 1, 1)) == sharding.DEFAULT_RULES
    assert sharding.rules_from_config(_config(1, 1, 1, logical_axis_rules="")) == sharding.DEFAULT_RULES
    rules = sharding.rules_from_config(_config(1, 1, 1, logical_axis_rules="embed=none, mlp=fsdp"))
    assert rules[:2] == (("embed", None), ("mlp", "fsdp"))
    assert ("embed", "fsdp") not in rules and ("qkv", "tensor") in rules  # unbound names keep the defaults
    mesh = sharding.make_mesh(_config(1, 4, 2))
    assert sharding.logical_to_spec(("embed", "mlp"), (8, 8), mesh, rules) == PartitionSpec(None, "fsdp")
    joined = sharding.rules_from_config(_config(1, 1, 1, logical_axis_rules="act_batch=data+fsdp+tensor"))
    assert joined[0] == ("act_batch", ("data", "fsdp", "tensor"))


@pytest.mark.parametrize("text", ["embd=fsdp", "embed=fdsp", "embed"])
def test_bad_logical_axis_rules_name_the_field_and_the_form(text):
    with pytest.raises(ValueError, match=r"logical_axis_rules=.*bad entries .*e\.g\. --config"):
        sharding.parse_rules(text)


def _inputs(params, batch=8, img_len=16, txt_len=8):
    rng = np.random.default_rng(0)
    side = int(np.sqrt(img_len))
    rows, cols = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    img_ids = np.stack([np.zeros(img_len), rows.ravel(), cols.ravel()], -1).astype(np.float32)
    return {
        "img": rng.standard_normal((batch, img_len, params.in_channels)).astype(np.float32),
        "img_ids": np.broadcast_to(img_ids, (batch, img_len, 3)).copy(),
        "txt": rng.standard_normal((batch, txt_len, params.context_in_dim)).astype(np.float32),
        "txt_ids": np.zeros((batch, txt_len, 3), np.float32),
        "timesteps": rng.uniform(size=(batch,)).astype(np.float32),
        "y": rng.standard_normal((batch, params.vec_in_dim)).astype(np.float32),
        "target": rng.standard_normal((batch, img_len, params.out_channels)).astype(np.float32),
    }


def _loss_fn(model):
    def loss(params, batch):
        inputs = {k: v for k, v in batch.items() if k != "target"}
        out = model.apply({"params": params}, **inputs)
        return jnp.mean((out - batch["target"]) ** 2)

    return jax.value_and_grad(loss)


def _perturb(variables):
    # Modulation and the final layer start at zero (as in BFL), which would make most gradients
    # zero and the comparison vacuous; every leaf gets its own noise.
    leaves, treedef = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noisy = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noisy)


@pytest.fixture(scope="module")
def tiny_reference():
    model = Flux(PRESETS["tiny"], dtype=jnp.float32)
    batch = _inputs(model.params)
    inputs = {k: v for k, v in batch.items() if k != "target"}
    init_fn = lambda r: model.init(r, **inputs)  # noqa: E731
    variables = sharding.unbox(jax.jit(init_fn)(jax.random.key(0)))
    params = jax.jit(_perturb)(variables["params"])
    loss, grads = jax.jit(_loss_fn(model))(params, batch)
    return model, batch, init_fn, variables, params, float(loss), grads


# (2, 2, 2) is the split where a dot's batch shards over (data, fsdp) while its kernel shards over
# fsdp and tensor: see test_dense_pins_layout_xla_miscompiles.
MESH_CASES = [(2, 2, 2), (8, 1, 1), (1, 4, 2)]


@pytest.mark.parametrize("sizes", MESH_CASES)
def test_tiny_flux_loss_and_grads_match_single_device(tiny_reference, sizes):
    model, batch, init_fn, ref_vars, ref_params, ref_loss, ref_grads = tiny_reference
    mesh = sharding.make_mesh(_config(*sizes))
    rules = sharding.DEFAULT_RULES
    variables, shardings = sharding.sharded_init(init_fn, jax.random.key(0), mesh, rules)

    # Sharded init draws the same numbers as the unsharded one.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), variables, ref_vars)
    qkv = variables["params"]["double_blocks_0"]["img_attn"]["qkv"]["kernel"]
    proj = variables["params"]["double_blocks_0"]["img_attn"]["proj"]["kernel"]
    tp, fs = sizes[2] > 1, sizes[1] > 1
    # Size-1 mesh axes may or may not be named in a spec; what matters is the placement.
    # The fused qkv kernel (dim, 3, dim) splits each of q, k and v over tensor (head-aligned).
    want_qkv = NamedSharding(mesh, PartitionSpec("fsdp" if fs else None, None, "tensor" if tp else None))
    want_proj = NamedSharding(mesh, PartitionSpec("tensor" if tp else None, "fsdp" if fs else None))
    assert qkv.sharding.is_equivalent_to(want_qkv, qkv.ndim), qkv.sharding
    assert proj.sharding.is_equivalent_to(want_proj, proj.ndim), proj.sharding
    assert shardings["params"]["double_blocks_0"]["img_attn"]["qkv"]["kernel"].spec == qkv.sharding.spec
    if tp or fs:
        assert qkv.addressable_shards[0].data.size < qkv.size

    params = jax.device_put(ref_params, shardings["params"])
    global_batch = sharding.host_local_batch_to_global(batch, mesh)
    assert global_batch["img"].sharding.spec == PartitionSpec(("data", "fsdp"))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        step = jax.jit(
            _loss_fn(model), out_shardings=(NamedSharding(mesh, PartitionSpec()), shardings["params"])
        )
        loss, grads = step(params, global_batch)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=2e-4)
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6), grads, ref_grads)
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def _fp8_config():
    # The toy config's FP8 fields, with a short history and the modulation GEMMs in FP8 too.
    c = toy_config.get_config("fp8")
    c.fp8 = "hybrid"
    c.fp8_amax_history_len = 4
    c.fp8_amax_compute_algo = "max"
    c.fp8_modulation = True
    return c


def _fp8_step(model):
    """(params, fp8_meta, batch) -> (loss, grads, new fp8_meta), threaded as in steps.make_train_step."""

    def loss(params, meta, batch):
        inputs = {k: v for k, v in batch.items() if k != "target"}
        out = model.apply({"params": params, fp8.FP8_COLLECTION: fp8.as_max_grad(meta)}, **inputs)
        return jnp.mean((out - batch["target"]) ** 2)

    def step(params, meta, batch):
        value, (grads, new_meta) = jax.value_and_grad(loss, argnums=(0, 1))(params, meta, batch)
        return value, grads, fp8.from_max_grad(new_meta)

    return step


def test_tiny_flux_fp8_matches_single_device():
    """FP8 dots on data=2 x fsdp=2 x tensor=2: the amax of a sharded tensor is global.

    Two delayed-scaling steps: the first quantizes with the initial unit scales and records the
    amaxes, the second quantizes with the scales computed from them. Compute stays float32 so the
    only differences left are reduction order, which FP8 rounding does not amplify here.
    """
    policy = fp8.make_policy(_fp8_config(), PRESETS["tiny"], fp8.DeviceDescription("cpu", "cpu", ""))
    model = Flux(PRESETS["tiny"], dtype=jnp.float32, dot_general_policy=policy)
    batch = _inputs(model.params)
    inputs = {k: v for k, v in batch.items() if k != "target"}
    init_fn = lambda r: model.init(r, **inputs)  # noqa: E731
    variables = sharding.unbox(jax.jit(init_fn)(jax.random.key(0)))
    params, meta = jax.jit(_perturb)(variables["params"]), variables[fp8.FP8_COLLECTION]
    ref_step = jax.jit(_fp8_step(model))
    ref = [ref_step(params, meta, batch)]
    ref.append(ref_step(params, ref[0][2], batch))

    mesh = sharding.make_mesh(_config(2, 2, 2))
    rules = sharding.DEFAULT_RULES
    _, shardings = sharding.sharded_init(init_fn, jax.random.key(0), mesh, rules)
    meta_sh = shardings[fp8.FP8_COLLECTION]
    assert all(s.spec == PartitionSpec() for s in jax.tree.leaves(meta_sh))
    params = jax.device_put(params, shardings["params"])
    global_batch = sharding.host_local_batch_to_global(batch, mesh)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        step = jax.jit(
            _fp8_step(model),
            out_shardings=(NamedSharding(mesh, PartitionSpec()), shardings["params"], meta_sh),
        )
        got = [step(params, jax.device_put(meta, meta_sh), global_batch)]
        got.append(step(params, got[0][2], global_batch))

    for (loss, grads, new_meta), (ref_loss, ref_grads, ref_meta) in zip(got, ref, strict=True):
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-5)
        jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6), grads, ref_grads)
        flat = jax.tree_util.tree_flatten_with_path(new_meta)[0]
        assert len(flat) == len(jax.tree.leaves(ref_meta)) > 0
        for (path, value), want in zip(flat, jax.tree.leaves(ref_meta), strict=True):
            copies = [np.asarray(shard.data) for shard in value.addressable_shards]
            assert len(copies) == 8
            # One scale and one history on every device, bit for bit.
            for copy in copies[1:]:
                np.testing.assert_array_equal(copy, copies[0], err_msg=jax.tree_util.keystr(path))
            if "kernel" in jax.tree_util.keystr(path):
                # Kernels are the same numbers on both runs, so their amax is exact.
                np.testing.assert_array_equal(copies[0], want, err_msg=jax.tree_util.keystr(path))
            else:
                # Activations and output gradients carry reduction-order rounding; a per-shard
                # amax would be off by far more (it would miss the other shards' maxima).
                np.testing.assert_allclose(copies[0], want, rtol=1e-5, err_msg=jax.tree_util.keystr(path))
        hist = ref_meta["double_blocks_0"]["txt_mod"]["lin"]["Fp8DotGeneral_0"]["input_amax_history"]
        assert float(hist[0]) > 0


def test_dense_pins_layout_xla_miscompiles():
    """The two dots XLA's SPMD partitioner gets wrong on a data x fsdp x tensor mesh, through Dense.

    A plain ``x @ w`` with x sharded P(("data", "fsdp"), "tensor"), w P("tensor", "fsdp") and the
    result requested as P(("data", "fsdp"), "tensor") comes back with the batch shards of devices
    (data=0, fsdp=1) and (data=1, fsdp=0) swapped (XLA emits a collective-permute between them and
    never undoes it; Shardy and GSPMD alike, since both hand the dot to the same partitioner). That
    is a row-parallel layer's forward and, transposed, a column-parallel layer's input gradient.
    Dense pins its input and output to the tensor-replicated layout, so the surrounding ops may ask
    for that sharding and still get the right rows.
    """
    mesh = sharding.make_mesh(_config(2, 2, 2))
    batch_tp = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, "tensor"))
    rng = np.random.default_rng(0)
    h = rng.standard_normal((8, 4, 64)).astype(np.float32)
    row = dense(16, ("mlp", "embed"), "row", jnp.float32, None)
    col = dense(64, ("embed", "mlp"), "col", jnp.float32, None)
    x = rng.standard_normal((8, 4, 16)).astype(np.float32)
    row_params = _perturb(row.init(jax.random.key(0), h)["params"])
    col_params = _perturb(col.init(jax.random.key(1), x)["params"])
    col_input_grad = jax.grad(lambda x, p: jnp.sum(jnp.sin(col.apply({"params": p}, x))))
    want_row = row.apply({"params": row_params}, h)
    want_grad = col_input_grad(x, col_params)

    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        kernel = {
            "row": NamedSharding(mesh, PartitionSpec("tensor", "fsdp")),
            "col": NamedSharding(mesh, PartitionSpec("fsdp", "tensor")),
        }
        got_row = jax.jit(lambda h, p: row.apply({"params": p}, h), out_shardings=batch_tp)(
            jax.device_put(h, batch_tp),
            dict(row_params, kernel=jax.device_put(row_params["kernel"], kernel["row"])),
        )
        got_grad = jax.jit(col_input_grad, out_shardings=batch_tp)(
            jax.device_put(x, batch_tp),
            dict(col_params, kernel=jax.device_put(col_params["kernel"], kernel["col"])),
        )
    np.testing.assert_allclose(got_row, want_row, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-6)


def test_unannotated_leaves_replicated():
    mesh = sharding.make_mesh(_config(1, 4, 2))
    abstract = {
        "params": {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 8), jnp.float32), ("embed", "mlp"))},
        "fp8_meta": {"scale": jax.ShapeDtypeStruct((), jnp.float32)},
    }
    shardings = sharding.param_shardings(abstract, mesh)
    assert shardings["params"]["w"].spec == PartitionSpec("fsdp", "tensor")
    assert shardings["fp8_meta"]["scale"].spec == PartitionSpec()


def test_aot_flux_dev_width_memory_per_device():
    """flux-dev width (3072, 24 heads) at depth 1+1, compiled for fsdp=4 x tensor=2 with no arrays."""
    import dataclasses
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "aot_12b.py"
    spec = importlib.util.spec_from_file_location("aot_12b", path)
    aot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(aot)
    args = aot._parse(
        "--data 1 --fsdp 4 --tensor 2 --depth 1 --single 1 --image-size 128 --txt-len 16".split()
    )
    run = setup.build(aot.aot_config(args))
    assert run.fp == dataclasses.replace(PRESETS["flux-dev"], depth=1, depth_single_blocks=1)
    report = aot.aot_step_memory(run, batch=8)
    assert report["params"] > 500_000_000
    # Arguments are the sharded params plus the batch slice: about an eighth of the full model.
    assert report["argument_size_bytes"] < report["param_bytes_unsharded"] / 6
    assert report["output_size_bytes"] < report["param_bytes_unsharded"] / 6


def _collectives(hlo: str) -> dict[str, list[str]]:
    """The result shapes of each collective op in compiled HLO text."""
    out = {}
    for op in ("all-gather", "collective-permute", "all-reduce", "reduce-scatter", "all-to-all"):
        found = re.findall(rf"= (\([^)]*\)|\S+) {op}(?:-start)?\(", hlo)
        out[op] = found
    return out


def _block_collectives(kind: str, tokens: int = 16, txt: int = 8) -> dict[str, list[str]]:
    """Collectives of one double ("double") or single ("single") block forward + backward on a
    tensor=2 mesh (2 CPU devices); the single block sees the joint txt + img sequence."""
    from flux_jax import layers, math

    mesh = sharding.make_mesh(_config(1, 1, 2), jax.devices()[:2])
    dim, b = 128, 2
    img, txt_x, vec = jnp.ones((b, tokens, dim)), jnp.ones((b, txt, dim)), jnp.ones((b, dim))
    pe = math.embed_nd(jnp.zeros((b, tokens + txt, 3)), (8, 12, 12), 1e4)
    if kind == "double":
        blk = layers.DoubleStreamBlock(dim, 4, 4.0, dtype=jnp.float32)
        inputs = (img, txt_x)
    else:
        blk = layers.SingleStreamBlock(dim, 4, 4.0, dtype=jnp.float32)
        inputs = (jnp.concatenate([txt_x, img], axis=1),)
    variables, _ = sharding.sharded_init(lambda r: blk.init(r, *inputs, vec, pe), jax.random.key(0), mesh)

    def loss(p, *x):
        with nn.logical_axis_rules(sharding.DEFAULT_RULES):
            out = blk.apply({"params": p}, *x, vec, pe)
        return sum(jnp.sum(o) for o in (out if isinstance(out, tuple) else (out,)))

    with jax.set_mesh(mesh):
        step = jax.jit(jax.grad(loss, argnums=tuple(range(1 + len(inputs)))))
        return _collectives(step.lower(variables["params"], *inputs).compile().as_text())


@pytest.mark.parametrize("kind", ["double", "single"])
def test_tensor_parallel_blocks_gather_no_token_activations(kind):
    """Megatron's minimum for a tensor-parallel block without sequence parallelism: all-reduces of
    the row-parallel outputs (forward) and the column-parallel inputs' gradients (backward), and no
    all-gather or permute of a tensor with the token axis. The fused projections are head-aligned
    (layers.fused_dense), so q, k, v, the MLP parts and each modulation chunk split locally; the
    only gathers are of the per-sample modulation output (B, 6 or 3, dim). Before that layout (qkv
    kernel in BFL's flat (K H D) order) the double block compiled to 12 all-gathers (10 with the token
    axis, 4 of them the qkv activation) and 12 collective permutes of (B, 1, dim/2) modulation chunks."""
    found = _block_collectives(kind, tokens=16, txt=8)
    token = r"\[2,(16|8|24),"
    with_tokens = [s for op in ("all-gather", "collective-permute") for s in found[op] if re.search(token, s)]
    assert with_tokens == [], found
    assert found["collective-permute"] == [] and found["all-to-all"] == [], found
    parts = 6 if kind == "double" else 3
    assert found["all-gather"] and all(s.startswith(f"f32[2,{parts},128]") for s in found["all-gather"])
    # The row-parallel outputs and the column-parallel input gradients are reduced (XLA may combine
    # several into one tuple all-reduce): proj and mlp_2 / linear2 forward, qkv and mlp_0 / linear1
    # backward, for each stream.
    reduced = sum(len(re.findall(token, s)) for s in found["all-reduce"])
    assert reduced == (8 if kind == "double" else 2), found
