"""fnuz numerics end to end: the toy config trains in FP8 with MI300X's e4m3fnuz / e5m2fnuz (max 240) as
well as with the OCP formats (max 448), both close to the non-FP8 run; the saved scales use the fnuz max."""

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import toy as toy_config
from flux_jax import fp8, train

STEPS = 20


def _short_toy(**overrides):
    # The toy config, shortened for CI's CPU: one double and one single block, 32 px (4 image tokens),
    # batch 8 over the 8 test devices, 20 steps, no evaluation.
    c = toy_config.get_config()
    c.model.depth, c.model.depth_single_blocks = 1, 1
    c.data.image_size = 32
    c.micro_batch_size, c.global_batch_size = 1, 8
    c.train_iters = STEPS
    c.lr_warmup_iters = 4
    c.log_interval = 4
    c.eval_interval = 0
    c.save_interval = 0
    c.checkpoint.async_save = False
    for k, v in overrides.items():
        c[k] = v
    return c


def _saved_fp8_meta(workdir):
    state = ocp.StandardCheckpointer().restore(f"{workdir}/checkpoints/{STEPS}/state")
    return state["fp8_meta"]


def _scales_and_histories(meta, prefix=()):
    for key, value in meta.items():
        if isinstance(value, dict):
            yield from _scales_and_histories(value, prefix + (key,))
        elif key.endswith("_scale"):
            history = meta[key.removesuffix("scale") + "amax_history"]
            yield "/".join(prefix + (key,)), np.asarray(value), np.asarray(history)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, overrides in {
        "none": {},
        # "most_recent": each scale is one recorded amax over the format max, checked below.
        "fnuz": dict(fp8="hybrid", fp8_format_family="fnuz", fp8_amax_compute_algo="most_recent"),
        "ocp": dict(fp8="hybrid", fp8_format_family="ocp", fp8_amax_compute_algo="most_recent"),
    }.items():
        workdir = str(tmp_path_factory.mktemp(name))
        out[name] = (train.train_and_evaluate(_short_toy(**overrides), workdir), workdir)
    return out


def test_fnuz_and_ocp_train_within_5_percent_of_the_non_fp8_run(runs):
    base = runs["none"][0]["train_loss"]
    for family in ("fnuz", "ocp"):
        result = runs[family][0]
        assert result["fp8"] and np.isfinite(result["train_loss"])
        assert abs(result["train_loss"] - base) <= 0.05 * base, (family, result["train_loss"], base)
    # The FP8 runs really differ from each other and from the baseline (other formats, other rounding).
    assert runs["fnuz"][0]["train_loss"] != runs["ocp"][0]["train_loss"] != base


@pytest.mark.parametrize("family,fmax", [("fnuz", 240.0), ("ocp", 448.0)])
def test_saved_scales_map_the_amax_to_the_format_max(runs, family, fmax):
    config = _short_toy(fp8="hybrid", fp8_format_family=family)
    spec = fp8.spec_from_config(config, fp8.DeviceDescription("cpu"))
    want = {"fnuz": (jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz), "ocp": (jnp.float8_e4m3fn, jnp.float8_e5m2)}
    assert (spec.fwd_dtype, spec.bwd_dtype) == want[family]
    assert float(jnp.finfo(spec.fwd_dtype).max) == fmax
    # Hybrid: inputs and kernels in E4M3 (max 240 fnuz, 448 OCP), output gradients in E5M2 (57344 both).
    operand_max = {"input": fmax, "kernel": fmax, "output_grad": float(jnp.finfo(spec.bwd_dtype).max)}
    checked = 0
    for name, scale, history in _scales_and_histories(_saved_fp8_meta(runs[family][1])):
        operand = name.rsplit("/", 1)[1].removesuffix("_scale")
        # The last step quantized with the amax that was newest before it (the history's last entry now)
        # over the format's max: |x / scale| <= max for every value it saw.
        assert history[-1] > 0, name
        np.testing.assert_allclose(scale * operand_max[operand], history[-1], rtol=1e-5, err_msg=name)
        checked += 1
    assert checked >= 3 * 2  # input, kernel and output-gradient scales of the FP8 dots
