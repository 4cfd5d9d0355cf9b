"""benchmarks/step.py on the CPU: the compile-only path writes its JSON, bad flags name the fix."""

import json

import jax
import pytest

from benchmarks import step


def test_parse_variant_overrides():
    assert step.parse_variant("bf16") == ("bf16", {})
    recipe, overrides = step.parse_variant("delayed@fp8_modulation=true;fp8_amax_history_len=16;x=none")
    assert recipe == "delayed"
    assert overrides == {"fp8_modulation": True, "fp8_amax_history_len": 16, "x": None}


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


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN attention is valid on a GPU")
def test_cudnn_off_gpu_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        step.main(["--compile-only", "--recipes", "bf16"])
    assert "--attention xla" in capsys.readouterr().err
