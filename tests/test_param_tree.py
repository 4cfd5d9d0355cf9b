"""The parameter and fp8_meta trees depend on the architecture alone, never on the FP8 policy.

For each scan setting, every policy of {BF16, FP8} x {first_last_layers_bf16 off, on} must share one
tree, so that init_from, the on_nonfinite="bf16" fallback, checkpoint precision switches, export and
sampling work between any two of them. The model has 2 double and 2 single blocks; first/last
BF16 keeps double block 0 and single block 1 in BF16, so each scanned stack runs mixed.
"""

import functools
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from flux_jax import checkpoint, model, optim, sample, setup, steps

POLICIES = [(fp8, first_last) for fp8 in (None, "e4m3") for first_last in (False, True)]
# The BF16 block sites under first_last_layers_bf16 (1 at the start, 1 at the end).
HELD = {"double_blocks": (0,), "single_blocks": (1,)}
ARCH = {"model.depth": 2, "model.depth_single_blocks": 2}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _overrides(scan, fp8, first_last, **arch):
    return {
        "fp8": fp8,
        "first_last_layers_bf16": first_last,
        "num_layers_at_start_in_bf16": 1,
        "num_layers_at_end_in_bf16": 1,
        "model.scan_blocks": scan,
        "lr_warmup_iters": 0,  # the first step already moves the params
        **ARCH,
        **arch,
    }


def _args(fp, batch=1):
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.normal(size=(batch, 4, fp.in_channels)), jnp.float32),
        jnp.zeros((batch, 4, 3)).at[:, :, 1].set(jnp.arange(4.0)),
        jnp.asarray(rng.normal(size=(batch, 4, fp.context_in_dim)), jnp.float32),
        jnp.zeros((batch, 4, 3)),
        jnp.full((batch,), 0.5),
        jnp.asarray(rng.normal(size=(batch, fp.vec_in_dim)), jnp.float32),
    )


def _init(config):
    """(FluxParams, model, variables) of a config; params from config.seed as train.py draws them."""
    fp = setup.flux_params(config)
    net = steps.make_model(config, fp, config.fp8 is not None)
    init_rng = jax.random.split(jax.random.key(config.seed), 3)[0]
    return fp, net, nn.unbox(jax.jit(net.init)(init_rng, *_args(fp)))


@functools.cache
def _built(scan, fp8, first_last):
    """(config, FluxParams, model, state) of one policy."""
    from conftest import make_tiny_config

    config = make_tiny_config(**_overrides(scan, fp8, first_last))
    fp, net, variables = _init(config)
    params = variables["params"]
    state = {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": optim.make_optimizer(config).init(params),
        "fp8_meta": dict(variables.get("fp8_meta", {})),
        "rng": jax.random.key(1),
    }
    return config, fp, net, state


def _equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _layer(tree, kind, i, scan):
    """Block i's subtree: a slice of the stack when scanned."""
    if scan:
        return jax.tree.map(lambda x: x[i], tree[f"{kind}_scan_0_2"])
    return tree[f"{kind}_{i}"]


@pytest.mark.parametrize("scan", [False, True])
def test_every_policy_has_one_tree_and_the_same_initial_params(scan):
    _, _, _, ref = _built(scan, None, False)
    names = {"double_blocks_scan_0_2", "single_blocks_scan_0_2"} if scan else {"double_blocks_0"}
    assert names <= set(ref["params"])
    for policy in POLICIES[1:]:
        _equal(_built(scan, *policy)[3]["params"], ref["params"])
    # fp8_meta covers every block, the BF16 ones included: first_last does not change it.
    plain, first_last = _built(scan, "e4m3", False)[3]["fp8_meta"], _built(scan, "e4m3", True)[3]["fp8_meta"]
    _equal(plain, first_last)
    for kind in ("double_blocks", "single_blocks"):
        for i in range(2):
            layer = _layer(first_last, kind, i, scan)
            qkv = layer["img_attn"]["qkv"] if kind == "double_blocks" else layer["linear1"]
            assert "Fp8DotGeneral_0" in qkv, (kind, i)


def test_a_bf16_layer_of_an_fp8_run_computes_the_plain_dense_and_holds_its_state():
    from flux_jax.fp8 import Fp8DotGeneral, Fp8Spec, as_max_grad, from_max_grad
    from flux_jax.layers import dense

    held = functools.partial(Fp8DotGeneral, spec=Fp8Spec(amax_history_len=4), enabled=False)
    ours, plain = (
        dense(24, (None, None), "d", jnp.bfloat16, held),
        dense(24, (None, None), "d", jnp.bfloat16, None),
    )
    x = jax.random.normal(jax.random.key(0), (3, 5, 40), jnp.float32)
    variables = ours.init(jax.random.key(1), x)
    params = jax.tree.map(lambda p: p + 0.01, variables["params"])
    meta = jax.tree.map(lambda m: m + 0.5, variables["fp8_meta"])  # not the initial values
    assert set(meta["Fp8DotGeneral_0"]) == {
        f"{o}_{k}" for o in ("input", "kernel", "output_grad") for k in ("amax_history", "scale")
    }

    def run(module, params, meta, x):
        def f(params, meta, x):
            vs = {"params": params} | ({"fp8_meta": as_max_grad(meta)} if meta else {})
            return module.apply(vs, x)

        y, vjp = jax.vjp(f, params, meta, x)
        return y, vjp(jnp.cos(y.astype(jnp.float32)).astype(y.dtype))

    y, (dp, dmeta, dx) = jax.jit(run, static_argnums=0)(ours, params, meta, x)
    y_ref, (dp_ref, _, dx_ref) = jax.jit(run, static_argnums=0)(plain, params, {}, x)
    _equal((y, dp, dx), (y_ref, dp_ref, dx_ref))
    _equal(from_max_grad(dmeta), meta)  # the new state is the old one, not a zero cotangent


def test_modulation_state_follows_fp8_modulation_for_bf16_blocks_too():
    from conftest import make_tiny_config

    from flux_jax import fp8

    for fp8_modulation in (False, True):
        config = make_tiny_config(**_overrides(False, "e4m3", True), fp8_modulation=fp8_modulation)
        policy = fp8.make_policy(config, setup.flux_params(config))
        for site, enabled in (
            ("double_blocks.0", False),
            ("double_blocks.1", True),
            ("single_blocks.1", False),
        ):
            assert policy(site)().enabled == enabled
            mod = policy(f"{site}.modulation")
            assert (mod is None) != fp8_modulation and (mod is None or mod().enabled == enabled)


def test_a_scanned_stack_with_a_bf16_layer_in_the_middle_computes_what_unscanned_blocks_do():
    # 3 double blocks BF16 / FP8 / BF16: three scans over slices of one stack; the single block BF16.
    from conftest import make_tiny_config

    from flux_jax import convert, fp8

    arch = {"model.depth": 3, "model.depth_single_blocks": 1, "num_layers_at_end_in_bf16": 2}
    _, _, variables = _init(make_tiny_config(**_overrides(False, "e4m3", True, **arch)))
    results = []
    for scan in (False, True):
        config = make_tiny_config(**_overrides(scan, "e4m3", True, **arch))
        fp = setup.flux_params(config)
        net = steps.make_model(config, fp, True)
        segments = model.block_segments(3, "double_blocks", net.dot_general_policy)
        assert [s[:2] for s in segments] == [(0, 1), (1, 2), (2, 3)]
        params = variables["params"]
        # Scaling state off its initial values, so a held layer that lost it would show.
        meta = jax.tree.map(lambda x: x + 0.25, variables["fp8_meta"])
        if scan:
            params = convert.load_torch_state_dict(
                convert.export_bfl_state_dict({"params": params}, fp), fp, True
            )
            params = params["params"]
            meta = {k: v for k, v in meta.items() if not k.startswith(("double_blocks", "single_blocks"))} | {
                "double_blocks_scan_0_3": jax.tree.map(
                    lambda *x: jnp.stack(x), *(meta[f"double_blocks_{i}"] for i in range(3))
                ),
                "single_blocks_scan_0_1": jax.tree.map(lambda x: x[None], meta["single_blocks_0"]),
            }

        def loss(params, meta, net=net, fp=fp):
            out = net.apply({"params": params, "fp8_meta": fp8.as_max_grad(meta)}, *_args(fp, 2))
            return jnp.mean(jnp.square(out - 0.1))

        value, (grads, new_meta) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, meta)
        results.append(
            (value, convert.export_bfl_state_dict({"params": grads}, fp), fp8.from_max_grad(new_meta), meta)
        )
    (v0, g0, m0, _), (v1, g1, m1, m1_in) = results
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    for k in g0:
        np.testing.assert_allclose(g1[k], g0[k], rtol=1e-4, atol=1e-7, err_msg=k)
    # Layer 1 (FP8) records what the unscanned block does; layers 0 and 2 (BF16) keep their state.
    stack, stack_in = m1["double_blocks_scan_0_3"], m1_in["double_blocks_scan_0_3"]
    got = jax.tree.leaves(jax.tree.map(lambda x: x[1], stack))
    for a, b in zip(got, jax.tree.leaves(m0["double_blocks_1"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    assert float(np.max(got[0])) > 0.25  # a fresh amax went in
    for i in (0, 2):
        _equal(jax.tree.map(lambda x, i=i: x[i], stack), jax.tree.map(lambda x, i=i: x[i], stack_in))
    _equal(m1["single_blocks_scan_0_1"], m1_in["single_blocks_scan_0_1"])


@functools.cache
def _bf16_step(scan):
    config, fp, _, _ = _built(scan, None, False)
    net = steps.make_model(config, fp, False)
    return jax.jit(steps.make_train_step(config, net, optim.make_optimizer(config), 1, False))


def _batch(fp, batch=2):
    img, img_ids, txt, txt_ids, _, y = _args(fp, batch)
    return {"img": img, "img_ids": img_ids, "txt": txt, "txt_ids": txt_ids, "y": y}


def _changed(a, b) -> bool:
    return any(
        not np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


@pytest.mark.parametrize("scan,num_micro", [(False, 1), (True, 2)])
def test_an_fp8_step_with_bf16_first_last_layers_leaves_their_state_alone(scan, num_micro):
    # num_micro 2: gradient accumulation (states merged by max) and kernels cast once per step.
    config, fp, net, state = _built(scan, "e4m3", True)
    fp8_step = jax.jit(steps.make_train_step(config, net, optim.make_optimizer(config), num_micro, True))
    new, m = fp8_step(state, _batch(fp))
    assert bool(m["finite"]) and _changed(new["params"], state["params"])
    for kind in ("double_blocks", "single_blocks"):
        for i in range(2):
            before, after = _layer(state["fp8_meta"], kind, i, scan), _layer(new["fp8_meta"], kind, i, scan)
            if i in HELD[kind]:
                _equal(after, before)  # not zeroed by the unused state's zero cotangent
            else:
                paths = jax.tree_util.tree_leaves_with_path(after)
                hist = [np.asarray(x) for p, x in paths if "input_amax" in str(p)]
                assert hist and all(h[0] > 0 for h in hist), (kind, i)


@pytest.mark.parametrize("scan", [False, True])
def test_the_bf16_fallback_steps_on_the_state_of_every_fp8_policy(scan):
    # on_nonfinite="bf16" compiles the BF16 step for the FP8 run's state; fp8_meta rides along. (With
    # the stacks once named by policy segment, this failed: ScopeCollectionNotFound double_blocks_scan_0_2.)
    for first_last in (False, True):
        _, fp, _, state = _built(scan, "e4m3", first_last)
        new, m = _bf16_step(scan)(state, _batch(fp))
        assert bool(m["finite"]) and _changed(new["params"], state["params"])
        _equal(new["fp8_meta"], state["fp8_meta"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{(scan, policy): (workdir, state)}: a checkpoint at step 2 saved by each policy's run."""
    out = {}
    for scan in (False, True):
        for policy in POLICIES:
            config, _, _, state = _built(scan, *policy)
            # Scaling state off its initial values, so a restore that drops it would show.
            meta = jax.tree.map(lambda x: x + 0.25, state["fp8_meta"])
            state = state | {"step": jnp.asarray(2, jnp.int32), "fp8_meta": meta}
            workdir = tmp_path_factory.mktemp(f"scan{int(scan)}_{policy[0]}_{int(policy[1])}")
            ck = checkpoint.Checkpointer(workdir, config)
            assert ck.save(2, state, force=True)
            ck.close()
            out[scan, policy] = (str(workdir), state)
    return out


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


@pytest.mark.parametrize("scan", [False, True])
def test_checkpoints_switch_between_every_pair_of_policies(scan, saved):
    for src in POLICIES:
        workdir, want = saved[scan, src]
        for dst in POLICIES:
            config, _, _, fresh = _built(scan, *dst)
            ck = checkpoint.Checkpointer(workdir, config)
            got, _ = ck.restore(2, _abstract(fresh), fresh_fp8_meta=fresh["fp8_meta"])
            ck.close()
            _equal(got["params"], want["params"])
            _equal(got["opt_state"], want["opt_state"])
            # FP8 -> FP8 keeps the scaling state; BF16 -> FP8 starts fresh; a BF16 run holds none.
            _equal(got["fp8_meta"], want["fp8_meta"] if src[0] and dst[0] else fresh["fp8_meta"])


@pytest.mark.parametrize("scan", [False, True])
def test_export_and_init_from_load_every_policy_into_every_other(scan, saved, tmp_path):
    for src in POLICIES:
        workdir, want = saved[scan, src]
        exported = checkpoint.export(workdir, tmp_path / "bfl.safetensors", dtype="float32")
        for dst in POLICIES:
            _, fp, _, fresh = _built(scan, *dst)
            for path in (exported, workdir):  # BFL weights, and another run's checkpoint
                got = checkpoint.load_init_from(str(path), fp, _abstract(fresh["params"]), scan_blocks=scan)
                _equal(got, want["params"])


@pytest.mark.parametrize("scan", [False, True])
def test_sampling_reads_the_checkpoint_of_every_policy(scan, saved, tmp_path):
    grids = []
    for src in POLICIES:
        out = tmp_path / f"{src[0]}_{int(src[1])}"
        argv = ["--workdir", saved[scan, src][0], "--config", os.path.join(ROOT, "configs", "toy.py")]
        sample.main(argv + ["--out", str(out), "--num_steps", "1", "--num_images", "1"])
        grids.append(np.asarray(Image.open(out / "grid.png")))
    # One set of params for every policy, and sampling runs BF16: the same images.
    for g in grids[1:]:
        np.testing.assert_array_equal(g, grids[0])
    assert grids[0].std() > 0


def _split_stacks(tree, spans):
    """The layout of earlier versions: each scanned stack split into {kind}_scan_{start}_{stop}."""
    out = {k: v for k, v in tree.items() if k not in spans}
    for name, segments in spans.items():
        kind = name.rsplit("_scan_", 1)[0]
        for a, b in segments:
            out[f"{kind}_scan_{a}_{b}"] = jax.tree.map(lambda x, a=a, b=b: x[a:b], tree[name])
    return out


def test_a_checkpoint_in_the_segmented_layout_names_the_way_forward(tmp_path):
    config, fp, _, state = _built(True, "e4m3", True)
    spans = {"double_blocks_scan_0_2": ((0, 1), (1, 2)), "single_blocks_scan_0_2": ((0, 1), (1, 2))}
    params = _split_stacks(state["params"], spans)
    meta = _split_stacks(state["fp8_meta"], spans)
    meta = {k: v for k, v in meta.items() if k not in ("double_blocks_scan_0_1", "single_blocks_scan_1_2")}
    old = state | {"params": params, "opt_state": optim.make_optimizer(config).init(params), "fp8_meta": meta}
    fix = r"double_blocks_scan_1_2, single_blocks_scan_1_2\), a layout of earlier .* --config.init_from="
    _old_layout_names_the_way_forward(tmp_path, config, fp, state, old, fix)


def _old_layout_names_the_way_forward(tmp_path, config, fp, state, old, fix):
    """A checkpoint of ``old`` (an earlier layout of ``state``) fails to restore and to init from with
    ``fix``; the fix it names, export (which reads either layout) then init_from, gives ``state``'s params."""
    ck = checkpoint.Checkpointer(tmp_path, config)
    assert ck.save(2, old, force=True)
    with pytest.raises(ValueError, match=fix):
        ck.restore(2, _abstract(state), fresh_fp8_meta=state["fp8_meta"])
    ck.close()
    with pytest.raises(ValueError, match=fix):
        checkpoint.load_init_from(str(tmp_path), fp, _abstract(state["params"]), scan_blocks=True)
    exported = checkpoint.export(tmp_path, tmp_path / "params.safetensors", dtype="float32")
    got = checkpoint.load_init_from(str(exported), fp, _abstract(state["params"]), scan_blocks=True)
    _equal(got, state["params"])


def _flat_fused(tree, lead=0):
    """The layout of earlier versions: each fused kernel a flat (in, out) matrix, its bias flat (behind
    the ``lead`` layer axis of a scanned stack)."""
    if "kernel" in tree:
        k, b = tree["kernel"], tree["bias"]
        n_in = k.ndim - b.ndim
        size = int(np.prod(k.shape[lead : lead + n_in]))
        return {
            **tree,
            "kernel": k.reshape(*k.shape[:lead], size, -1),
            "bias": b.reshape(*b.shape[:lead], -1),
        }
    return {
        k: _flat_fused(v, 1 if "_scan_" in k else lead) if isinstance(v, dict) else v for k, v in tree.items()
    }


def test_a_checkpoint_with_flat_fused_projections_names_the_way_forward(tmp_path):
    config, fp, _, state = _built(True, "e4m3", False)
    params = _flat_fused(state["params"])
    assert params["double_blocks_scan_0_2"]["img_attn"]["qkv"]["kernel"].shape == (2, 32, 96)
    assert params["single_blocks_scan_0_2"]["linear2"]["kernel"].shape == (2, 160, 32)
    old = state | {"params": params, "opt_state": optim.make_optimizer(config).init(params)}
    fix = r"as flat matrices \(double_blocks_scan_0_2/img_attn/qkv/bias, .* --config.init_from="
    _old_layout_names_the_way_forward(tmp_path, config, fp, state, old, fix)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def test_cli_resumes_a_scanned_first_last_fp8_run_in_bf16(tmp_path):
    flags = ["--config=configs/toy.py", f"--workdir={tmp_path}", "--config.model.preset=tiny"]
    flags += [f"--config.{k}={v}" for k, v in _overrides(True, "e4m3", True).items() if k != "fp8"]
    flags += ["--config.data.image_size=32", "--config.data.txt_len=4", "--config.global_batch_size=2"]
    flags += ["--config.micro_batch_size=2", "--config.eval_interval=0", "--config.log_interval=1"]
    fp8 = _cli(
        "flux_jax.train", *flags, "--config.fp8=e4m3", "--config.train_iters=2", "--config.save_interval=2"
    )
    assert fp8.returncode == 0, fp8.stderr[-3000:]
    bf16 = _cli("flux_jax.train", *flags, "--config.fp8=None", "--config.train_iters=3")
    assert bf16.returncode == 0, bf16.stderr[-3000:]
    assert "resuming at step 2" in bf16.stderr
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    train_lines = [x for x in lines if x["split"] == "train"]
    assert [x["step"] for x in train_lines] == [1, 2, 3]
    assert "scale_min" in train_lines[1] and "scale_min" not in train_lines[2]  # FP8, then BF16
    assert all(np.isfinite(x["loss"]) for x in train_lines)
