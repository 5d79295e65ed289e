"""Write artifacts/golden/v1_small.aotf, the committed format-v1 golden archive.

Deterministic: every input is a literal, so rerunning yields byte-identical output (given the
same libzstd; tests/test_archive.py compares against the committed file). Run from the repo root:

    python scripts/make_golden_archive.py [OUT]

Never regenerate the committed golden to make a test pass: a difference means the writer's output
changed, which for an unchanged FORMAT_VERSION is a format break.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from aotfuse.archive import save_archive  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "artifacts", "golden", "v1_small.aotf")


def golden_inputs() -> tuple[dict, dict[str, bytes], dict[str, torch.Tensor]]:
    manifest = {
        "name": "golden-v1-small",
        "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1],
        "floats": [0.5, -2.25, 1e300],
        "flag": True,
        "nothing": None,
        "blob": b"\x00\x01\xfe\xff",
        "nested": {"b": [1, {"c": "d"}], "a": "\u00fcnicode \u2713"},
    }
    parts = {
        "program": b"PROGRAM v1\n" + bytes(range(256)),
        "kernels": bytes(range(256)) * 8,
        "sources": ("def kernel():\n    return 42\n" * 20).encode(),
        "report": b"",
    }
    weights = {
        "emb.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4,
        "ln.weight": torch.tensor([1.0, 0.5, -2.0, 3.0], dtype=torch.bfloat16),
        "ln.bias": torch.tensor([0.25, -0.125, 65504.0], dtype=torch.float16),
        "pos": torch.tensor([-(2**63), -1, 0, 2**63 - 1], dtype=torch.int64),
        "mask": torch.tensor([[True, False], [False, True]]),
        "scale": torch.tensor(0.125, dtype=torch.float32),
        "empty": torch.zeros(0, 4, dtype=torch.float32),
        "codes": torch.tensor([0, 1, 127, 255], dtype=torch.uint8),
    }
    return manifest, parts, weights


def main(argv: list[str]) -> int:
    out = argv[1] if len(argv) > 1 else GOLDEN
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    size = save_archive(out, *golden_inputs())
    print(f"wrote {out} ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
