"""benchmarks/step.py on the CPU: the compile-only path writes its JSON, bad flags name the fix."""

import argparse
import json

import jax
import pytest

from benchmarks import step
from benchmarks.shapes import SHAPES, params_for
from flux_jax import setup
from flux_jax.errors import UserError


def test_variant_overrides_take_the_fields_types():
    args = argparse.Namespace(
        attention="xla", scan=False, remat=None, depth=2, single=4, batch=0, micro=1, format="hybrid"
    )
    c, *_ = step.bench_config(
        "tiny", "delayed@fp8_wgrad=false;fp8_amax_history_len=16;model.attention=xla", args
    )
    assert (c.fp8_recipe, c.fp8_wgrad, c.fp8_amax_history_len, c.model.attention) == (
        "delayed",
        False,
        16,
        "xla",
    )
    with pytest.raises(UserError, match="--recipes delayed@fp8_amax_history_len=.many.: expected an integer"):
        step.bench_config("tiny", "delayed@fp8_amax_history_len=many", args)


def test_compile_only_writes_json(tmp_path):
    out = tmp_path / "c.json"
    argv = "--shape mlperf --attention xla --depth 1 --single 1 --batch 1 --scan --remat full"
    assert step.main([*argv.split(), "--compile-only", "--recipes", "bf16", "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())
    assert r["recipe"] == "bf16" and r["compile_only"] and r["scan_blocks"]
    assert (r["depth"], r["depth_single_blocks"]) == (1, 1)
    # float32 params + AdamW moments are the arguments: 12 bytes per parameter, plus the batch.
    assert r["memory_gib"]["arguments"] * 2**30 >= 12 * r["params"]
    assert r["compiled_memory_bytes"] > r["memory_gib"]["arguments"] * 2**30


def test_zero_micro_batches_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        step.main(["--micro", "0", "--attention", "xla"])
    assert "--micro 0" in capsys.readouterr().err


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN attention is valid on a GPU")
def test_cudnn_off_gpu_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        step.main(["--compile-only", "--recipes", "bf16", "--attention", "cudnn"])
    assert "--attention auto or xla" in capsys.readouterr().err


def test_each_variant_in_its_own_process_side_by_side(tmp_path):
    out = tmp_path / "r.json"
    argv = [
        "--shape",
        "tiny",
        "--attention",
        "xla",
        "--recipes",
        "bf16,delayed",
        "--steps",
        "2",
        "--batch",
        "4",
        "--micro",
        "2",
    ]
    assert step.main([*argv, "--warmup", "1", "--out", str(out)]) == 0
    bf16, fp8 = json.loads(out.read_text())
    # Two micro batches of 4 per step: the images are counted over both.
    assert (fp8["batch"], fp8["micro_batches"]) == (4, 2)
    assert fp8["images_per_sec"] == pytest.approx(8 / (fp8["ms_per_step"] / 1e3))
    assert (bf16["recipe"], bf16["fp8"], fp8["recipe"], fp8["fp8"]) == ("bf16", False, "delayed", True)
    assert fp8["speedup_vs_bf16"] == bf16["ms_per_step"] / fp8["ms_per_step"]
    assert fp8["finite"] and fp8["ms_per_step"] > 0 and fp8["model_tflops"] > 0
    # CPU keeps no allocator stats; on a GPU each child reports its own peak, compared to BF16's.
    if jax.default_backend() == "gpu":
        assert fp8["peak_memory_vs_bf16"] > 0
    else:
        assert fp8["process_peak_bytes"] is None and "peak_memory_vs_bf16" not in fp8


def test_failed_variant_names_it():
    with pytest.raises(SystemExit, match="'nonsense'"):
        step.main(["--shape", "tiny", "--attention", "xla", "--recipes", "nonsense,bf16", "--steps", "1"])


def test_gemm_only_bound_replaces_the_gemm_time_only():
    # BF16: 60 ms wall, 30 ms of GEMMs; FP8: 14 ms of FP8 GEMMs + 2 ms of 16-bit ones, and a 3 ms cast
    # that the bound leaves out: 60 / (60 - 30 + 16) = 1.30x.
    base = {"ms_per_step": 60.0, "profile": {"by_category_ms": {"gemm": 30.0, "fusion": 20.0}}}
    fp8_cats = {"fp8_gemm": 14.0, "gemm": 2.0, "fusion": 20.0, "transpose": 3.0}
    fp8 = {"ms_per_step": 48.0, "profile": {"by_category_ms": fp8_cats}}
    assert step.gemm_only_bound(base, fp8) == pytest.approx(60 / 46)
    assert step.gemm_only_bound(base, {"ms_per_step": 48.0}) is None


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_both_benchmarks_train_the_same_model_at_each_shape(shape):
    # step.py (ours) and torch_peer.py (PyTorch) count model FLOPs from these FluxParams: they must be
    # the shape's, or the two TFLOP/s columns measure different models.
    args = argparse.Namespace(
        attention="xla",
        scan=False,
        remat=None,
        depth=SHAPES["mlperf"][0],
        single=SHAPES["mlperf"][1],
        batch=0,
        micro=1,
        format="hybrid",
    )
    c, *_ = step.bench_config(shape, "bf16", args)
    assert setup.flux_params(c) == params_for(shape)
    assert (params_for(shape).depth, params_for(shape).depth_single_blocks) == SHAPES[shape][:2]
