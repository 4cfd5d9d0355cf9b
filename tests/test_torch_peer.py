"""benchmarks/torch_peer.py on the CPU: the PyTorch peer builds the shape's model, trains, reports."""

import importlib.util
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from benchmarks import torch_peer  # noqa: E402
from benchmarks.shapes import SHAPES  # noqa: E402

CPU_ARGS = ["--shape", "tiny", "--device", "cpu", "--no-compile", "--sdpa", "default", "--steps", "2"]


def test_tiny_bf16_step_runs_and_writes_json(tmp_path):
    out = tmp_path / "peer.json"
    assert torch_peer.main([*CPU_ARGS, "--warmup", "1", "--recipes", "bf16", "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())
    depth, single, batch, side, txt_len = SHAPES["tiny"]
    assert (r["recipe"], r["framework"], r["batch"]) == ("bf16", "torch", batch)
    assert (r["depth"], r["depth_single_blocks"], r["image_tokens"], r["text_tokens"]) == (
        depth,
        single,
        4,
        4,
    )
    assert r["ms_per_step"] > 0 and r["model_tflops"] > 0 and r["float8_linears"] == 0
    assert r["loss"] == r["loss"] and r["loss"] > 0  # finite


def test_float8_goes_to_the_block_token_linears_only():
    model, _ = torch_peer.model_for("tiny", torch.device("cpu"))
    chosen = [n for n, m in model.named_modules() if torch_peer.is_block_token_linear(m, n)]
    # Per double block: q, k, v, out and the MLP's two for each stream; per single block: q, k, v and
    # the fused MLP in / out. Modulations (norm*.linear), embedders and the final layer stay BF16.
    assert len(chosen) == 12 * SHAPES["tiny"][0] + 5 * SHAPES["tiny"][1]
    assert not [n for n in chosen if ".norm" in n or not n.startswith(torch_peer.BLOCK_PREFIXES)]
    if importlib.util.find_spec("torchao") is None:
        with pytest.raises(SystemExit, match="needs torchao"):
            torch_peer.to_float8(model, "tensorwise")
    else:
        assert torch_peer.to_float8(model, "tensorwise") == len(chosen)


def test_unknown_recipe_is_named(capsys):
    with pytest.raises(SystemExit):
        torch_peer.main([*CPU_ARGS, "--recipes", "bf16,delayed"])
    assert "unknown ['delayed']" in capsys.readouterr().err
