"""benchmarks/versus.py: ours against the PyTorch peer, per shape, from the two benchmarks' JSON."""

import json

from benchmarks import versus


def _row(shape, recipe, ms, framework=None):
    return {"shape": shape, "recipe": recipe, "ms_per_step": ms} | (
        {"framework": framework} if framework else {}
    )


def test_ratios_per_shape_from_both_files(tmp_path, capsys):
    ours = [_row("block", "bf16", 60.0), _row("block", "delayed", 48.0), _row("block", "rocm:delayed", 40.0)]
    ours += [_row("mlperf", "bf16", 80.0)]
    peer = [_row("block", "bf16", 72.0, "torch"), _row("block", "tensorwise", 64.0, "torch")]
    (tmp_path / "ours.json").write_text(json.dumps(ours))
    (tmp_path / "peer.json").write_text(json.dumps(peer))
    assert versus.main([str(tmp_path / "ours.json"), str(tmp_path / "peer.json")]) == 0
    block, mlperf = versus.table(ours + peer)
    assert (block["ours_fp8"], block["peer_fp8"]) == (48.0, 64.0)  # the ROCm-path twin is not ours' FP8
    assert block["ours_fp8_vs_peer_fp8"] == 64.0 / 48.0 and block["ours_fp8_vs_ours_bf16"] == 60.0 / 48.0
    assert block["ours_bf16_vs_peer_bf16"] == 72.0 / 60.0
    assert mlperf["ours_fp8"] is None and mlperf["ours_fp8_vs_peer_fp8"] is None
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("shape | ours_bf16") and lines[1].startswith(
        "block | 60.00 | 48.00 | 72.00 | 64.00 | 1.33"
    )
    assert lines[2].startswith("mlperf | 80.00 | -")
