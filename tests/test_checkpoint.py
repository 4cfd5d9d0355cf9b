"""Checkpointer: exact round trips, retention, atomicity, resharding, precision switches, errors."""

import json
import os
import signal
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from flux_jax import checkpoint, model


def make_config(save_interval=1, max_to_keep=None, keep_period=None, async_save=False):
    return ml_collections.ConfigDict(
        {
            "save_interval": save_interval,
            "model": {"preset": "tiny"},
            "checkpoint": {"max_to_keep": max_to_keep, "keep_period": keep_period, "async_save": async_save},
        }
    )


def make_state(seed=0, fp8=True, width=8):
    k = jax.random.split(jax.random.key(seed), 3)
    params = {
        "img_in": {"kernel": jax.random.normal(k[0], (width, 16)), "bias": jnp.zeros((16,))},
        "final_layer": {"linear": {"kernel": jax.random.normal(k[1], (16, width))}},
    }
    fp8_meta = {"img_in": {"amax_history": jnp.arange(4.0), "scale": jnp.full((), 2.0)}} if fp8 else {}
    return {
        "step": jnp.int32(3),
        "params": params,
        "opt_state": {"mu": jax.tree.map(lambda x: 0.5 * x, params)},
        "fp8_meta": fp8_meta,
        "rng": k[2],
    }


def abstract_of(state, sharding_for):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_for(x)), state)


def mesh_shardings(shape, names, spec_for):
    mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
    return lambda x: NamedSharding(mesh, spec_for(x))


def assert_tree_equal(a, b):
    a, b = checkpoint._keys_to_data(a), checkpoint._keys_to_data(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


REPLICATED = mesh_shardings((8,), ("data",), lambda x: P())


def test_save_restore_exact_with_data_state_and_config(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path, make_config(async_save=True))
    state = make_state()
    assert ckpt.save(3, state, {"epoch": 1, "position": 17})
    ckpt.wait_until_finished()
    assert ckpt.latest_step() == 3
    restored, data_state = ckpt.restore(3, abstract_of(state, REPLICATED))
    assert_tree_equal(restored, state)
    assert data_state == {"epoch": 1, "position": 17}
    assert jax.dtypes.issubdtype(restored["rng"].dtype, jax.dtypes.prng_key)
    saved_config = (tmp_path / "checkpoints" / "3" / "config").iterdir()
    assert any(p.name != "commit_success.txt" for p in saved_config)
    ckpt.close()


def test_save_interval_force_and_no_duplicate(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path, make_config(save_interval=5))
    state = make_state()
    assert not ckpt.save(3, state)
    assert ckpt.save(3, state, force=True)
    assert ckpt.save(5, state)
    assert not ckpt.save(5, state, force=True)
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [3, 5]


def test_keeps_last_k_and_every_mth(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path, make_config(max_to_keep=2, keep_period=3))
    state = make_state()
    for step in range(1, 9):
        ckpt.save(step, state)
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [3, 6, 7, 8]
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [
        3,
        6,
        7,
        8,
    ]


def test_unfinished_write_is_never_latest(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path, make_config())
    state = make_state()
    ckpt.save(2, state)
    ckpt.wait_until_finished()
    ckpt.close()
    # What a run killed mid-save leaves behind: orbax's temporary directory for the next step.
    partial = tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-1234" / "state"
    partial.mkdir(parents=True)
    (partial / "garbage").write_bytes(b"\0" * 10)
    resumed = checkpoint.Checkpointer(tmp_path, make_config())
    assert resumed.latest_step() == 2
    restored, _ = resumed.restore(resumed.latest_step(), abstract_of(state, REPLICATED))
    assert_tree_equal(restored, state)


def test_restore_onto_a_different_mesh_reshards(tmp_path):
    fsdp8 = mesh_shardings((8,), ("fsdp",), lambda x: P("fsdp") if x.ndim == 2 else P())
    state = jax.tree.map(lambda x: jax.device_put(x, fsdp8(x)), make_state())
    ckpt = checkpoint.Checkpointer(tmp_path, make_config())
    ckpt.save(1, state)
    ckpt.wait_until_finished()
    mesh_2x4 = mesh_shardings((2, 4), ("data", "tensor"), lambda x: P(None, "tensor") if x.ndim == 2 else P())
    restored, _ = ckpt.restore(1, abstract_of(state, mesh_2x4))
    kernel = restored["params"]["img_in"]["kernel"]
    assert kernel.sharding.spec == P(None, "tensor")
    assert kernel.sharding.mesh.shape == {"data": 2, "tensor": 4}
    assert_tree_equal(restored, state)


def test_fp8_checkpoint_restores_into_bf16_run_and_keeps_fp8_on_disk(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path, make_config())
    fp8_state = make_state(fp8=True)
    ckpt.save(1, fp8_state)
    ckpt.wait_until_finished()
    bf16_abstract = abstract_of(make_state(fp8=False), REPLICATED)
    restored, _ = ckpt.restore(1, bf16_abstract)
    assert restored["fp8_meta"] == {}
    assert_tree_equal(restored["params"], fp8_state["params"])
    again, _ = ckpt.restore(1, abstract_of(fp8_state, REPLICATED))
    assert_tree_equal(again["fp8_meta"], fp8_state["fp8_meta"])


def test_bf16_checkpoint_restores_into_fp8_run_with_fresh_state(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path, make_config())
    bf16_state = make_state(fp8=False)
    ckpt.save(1, bf16_state)
    ckpt.wait_until_finished()
    fresh = make_state(fp8=True)["fp8_meta"]
    fp8_abstract = abstract_of(make_state(fp8=True), REPLICATED)
    restored, _ = ckpt.restore(1, fp8_abstract, fresh_fp8_meta=fresh)
    assert_tree_equal(restored["fp8_meta"], fresh)
    assert_tree_equal(restored["opt_state"], bf16_state["opt_state"])
    with pytest.raises(ValueError, match="fresh_fp8_meta"):
        ckpt.restore(1, fp8_abstract)


def test_wrong_model_size_names_dir_paths_and_fix(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path, make_config())
    ckpt.save(1, make_state(width=8))
    ckpt.wait_until_finished()
    wider = make_state(width=12)
    wider["params"]["extra"] = {"kernel": jnp.zeros((2, 2))}
    with pytest.raises(ValueError) as info:
        ckpt.restore(1, abstract_of(wider, REPLICATED))
    msg = str(info.value)
    assert str(tmp_path / "checkpoints" / "1") in msg
    assert "params/img_in/kernel: expected (12, 16), found (8, 16)" in msg
    assert "params/extra/kernel: expected (2, 2), missing in checkpoint" in msg
    assert "Fix:" in msg


def test_truncated_checkpoint_raises_one_clear_error(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path, make_config())
    state = make_state()
    ckpt.save(1, state)
    ckpt.save(2, state)
    ckpt.wait_until_finished()
    state_dir = tmp_path / "checkpoints" / "2" / "state"
    for f in state_dir.rglob("*"):
        if f.is_file() and "metadata" not in f.name:
            f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 3])
    with pytest.raises(ValueError) as info:
        ckpt.restore(2, abstract_of(state, REPLICATED))
    msg = str(info.value)
    assert str(tmp_path / "checkpoints" / "2") in msg and "step 1" in msg


def test_restore_of_missing_step_lists_available(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path, make_config())
    ckpt.save(1, make_state())
    ckpt.wait_until_finished()
    with pytest.raises(ValueError, match=r"found \[1\]"):
        ckpt.restore(7, abstract_of(make_state(), REPLICATED))


def test_load_init_from_checkpoint_dir_params_only(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path, make_config())
    state = make_state()
    ckpt.save(4, state)
    ckpt.wait_until_finished()
    sharded = mesh_shardings((8,), ("fsdp",), lambda x: P("fsdp") if x.ndim == 2 else P())
    abstract = abstract_of(state["params"], sharded)
    for path in (tmp_path, tmp_path / "checkpoints", tmp_path / "checkpoints" / "4"):
        params = checkpoint.load_init_from(path, None, abstract)
        assert_tree_equal(params, state["params"])
        assert params["img_in"]["kernel"].sharding.spec == P("fsdp")
    with pytest.raises(ValueError, match="fit this model"):
        checkpoint.load_init_from(tmp_path, None, abstract_of(make_state(width=4)["params"], sharded))


def test_load_init_from_unknown_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="config.init_from"):
        checkpoint.load_init_from(tmp_path / "nope", None, {})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither a .safetensors file"):
        checkpoint.load_init_from(tmp_path / "empty", None, {})


def tiny_flux_params():
    fp = model.PRESETS["tiny"]
    args = (
        jnp.zeros((1, 4, fp.in_channels)),
        jnp.zeros((1, 4, len(fp.axes_dim))),
        jnp.zeros((1, 2, fp.context_in_dim)),
        jnp.zeros((1, 2, len(fp.axes_dim))),
        jnp.zeros((1,)),
        jnp.zeros((1, fp.vec_in_dim)),
    )
    variables = model.Flux(fp, dtype=jnp.float32).init(jax.random.key(1), *args)
    return fp, nn.unbox(variables)["params"]


def test_export_then_init_from_safetensors_round_trips(tmp_path):
    fp, params = tiny_flux_params()
    ckpt = checkpoint.Checkpointer(tmp_path / "run", make_config())
    state = {
        "step": jnp.int32(5),
        "params": params,
        "opt_state": {},
        "fp8_meta": {},
        "rng": jax.random.key(0),
    }
    ckpt.save(5, state)
    ckpt.wait_until_finished()
    out = tmp_path / "flux.safetensors"
    checkpoint.main(
        ["export", "--workdir", str(tmp_path / "run"), "--output", str(out), "--dtype", "float32"]
    )
    abstract = abstract_of(params, REPLICATED)
    loaded = checkpoint.load_init_from(out, fp, abstract)
    assert_tree_equal(loaded, params)
    with pytest.raises(ValueError, match="No checkpoint 9"):
        checkpoint.export(tmp_path / "run", out, step=9)


TRAIN_ARGS = ["--config.train_iters=8", "--config.save_interval=2", "--config.log_interval=1"]
TRAIN_ARGS += ["--config.eval_interval=0", "--config.checkpoint.async_save=True"]
# The toy config shrunk to the tiny preset: three runs of it fit in the CI budget.
TRAIN_ARGS += ["--config.model.preset=tiny", "--config.data.image_size=32", "--config.data.txt_len=4"]


def run_train(workdir, wait=True):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "flux_jax.train", "--config", "configs/toy.py", "--workdir", str(workdir)]
    proc = subprocess.Popen(cmd + TRAIN_ARGS, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if wait:
        assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()[-3000:]
    return proc


def losses(workdir) -> dict[int, float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {
        r["step"]: r["loss"] for r in rows if r.get("split") == "train"
    }  # a resumed step's last line wins


def test_sigkill_or_sigterm_mid_run_then_resume_matches_uninterrupted_run(tmp_path):
    run_train(tmp_path / "reference")
    killed = run_train(tmp_path / "killed", wait=False)
    first = tmp_path / "killed" / "checkpoints" / "2"
    while not first.exists() and killed.poll() is None:
        time.sleep(0.02)
    killed.kill()
    assert killed.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    assert checkpoint.Checkpointer(tmp_path / "killed", make_config()).latest_step() < 8
    run_train(tmp_path / "killed")
    assert losses(tmp_path / "killed") == losses(tmp_path / "reference")
    assert sorted(losses(tmp_path / "reference")) == list(range(1, 9))

    # SIGTERM (preemption) saves the step it stopped at: nothing is lost, and the resume matches.
    stopped = run_train(tmp_path / "stopped", wait=False)
    while not (tmp_path / "stopped" / "checkpoints" / "2").exists() and stopped.poll() is None:
        time.sleep(0.02)
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=600) == 0, stopped.stderr.read().decode()[-3000:]
    saved = checkpoint.Checkpointer(tmp_path / "stopped", make_config()).latest_step()
    assert 2 <= saved < 8, "the run finished before the signal arrived"
    assert max(losses(tmp_path / "stopped")) == saved
    run_train(tmp_path / "stopped")
    assert losses(tmp_path / "stopped") == losses(tmp_path / "reference")
