"""Ours against the PyTorch peer, from the JSON of benchmarks/step.py and benchmarks/torch_peer.py.

    python benchmarks/step.py --shape block --recipes bf16,delayed --out ours.json
    python benchmarks/torch_peer.py --shape block --recipes bf16,tensorwise --out peer.json
    python benchmarks/versus.py ours.json peer.json

Prints one row per shape: each framework's BF16 and FP8 ms/step and the ratios issue 32 asks about
(our FP8 against the peer's float8, our FP8 against our BF16). Run both benchmarks in one call on one
GPU: figures from different machines do not compare.
"""

import argparse
import json
import sys


def load(paths) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += json.load(f)
    return rows


def table(rows: list[dict]) -> list[dict]:
    """Per shape: ours (bf16, the first FP8 recipe) and the peer's (bf16, the first float8 recipe)."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        ours = [
            r
            for r in rows
            if r["shape"] == shape
            and r.get("framework", "jax") == "jax"
            and not r["recipe"].startswith("rocm:")
        ]
        peer = [r for r in rows if r["shape"] == shape and r.get("framework") == "torch"]

        def pick(rs, fp8):
            return next((r["ms_per_step"] for r in rs if (r["recipe"].split("@")[0] != "bf16") == fp8), None)

        row = {
            "shape": shape,
            "ours_bf16": pick(ours, False),
            "ours_fp8": pick(ours, True),
            "peer_bf16": pick(peer, False),
            "peer_fp8": pick(peer, True),
        }
        row["ours_fp8_vs_peer_fp8"] = _ratio(row["peer_fp8"], row["ours_fp8"])
        row["ours_fp8_vs_ours_bf16"] = _ratio(row["ours_bf16"], row["ours_fp8"])
        row["ours_bf16_vs_peer_bf16"] = _ratio(row["peer_bf16"], row["ours_bf16"])
        out.append(row)
    return out


def _ratio(slow, fast):
    return None if slow is None or fast is None else slow / fast


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", help="output files of step.py and torch_peer.py (--out)")
    args = p.parse_args(argv)
    rows = table(load(args.json))
    print(" | ".join(rows[0]))
    for row in rows:
        print(" | ".join(v if isinstance(v, str) else "-" if v is None else f"{v:.2f}" for v in row.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
