"""Write artifacts/golden/v1_model.aotf + v1_model.json: a tiny model built by aotfuse, kept forever.
With --cnn: artifacts/golden/v1_cnn.aotf + v1_cnn.json, a tiny CNN (built at 2026-11-23 by the aotfuse
of commit 10df033, whose convolutions call aten.convolution.out, an allow-list entry kept for such archives).

Every later aotfuse must load this archive and reproduce the stored outputs on the CPU path (and on
the GPU where one is present). Regenerate only when FORMAT_VERSION or the program format changes
on purpose, and then add a new golden next to the old one instead of replacing it.

    python scripts/make_golden_model.py
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse

ROOT = Path(__file__).resolve().parents[1] / "artifacts" / "golden"


class Tiny(nn.Module):
    """Embedding, LayerNorm, GELU MLP, softmax: one of each kind of kernel and extern."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 12)
        self.ln = nn.LayerNorm(12)
        self.fc = nn.Linear(12, 20)
        self.out = nn.Linear(20, 7)

    def forward(self, ids):
        h = self.ln(self.emb(ids))
        return F.softmax(self.out(F.gelu(self.fc(h))), dim=-1), h.sum(-1)


class TinyCNN(nn.Module):
    """conv 3x3 (padding) -> ReLU -> conv 1x1 -> spatial mean: the convolution extern."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.c2(torch.relu(self.c1(x))).mean((2, 3))


def cnn_and_inputs():
    torch.manual_seed(0)
    return TinyCNN().eval(), (torch.arange(50, dtype=torch.float32).reshape(1, 2, 5, 5).repeat(1, 2, 1, 1)[:, :3] / 25,)


def main_cnn():
    model, inputs = cnn_and_inputs()
    res = aotfuse.build(model, inputs, targets=("sm_80", "sm_90"))
    res.save(ROOT / "v1_cnn.aotf")
    x = torch.linspace(-1, 1, 75).reshape(1, 3, 5, 5)
    with torch.no_grad():
        out = model(x)
    (ROOT / "v1_cnn.json").write_text(json.dumps({
        "input": x.tolist(), "outputs": [out.tolist()],
        "note": "expected outputs of artifacts/golden/v1_cnn.aotf for `input` (fp32, eager at build time)",
    }, indent=1) + "\n")
    print(f"wrote {ROOT / 'v1_cnn.aotf'} ({len(res.data)} bytes)")


def model_and_inputs():
    torch.manual_seed(0)
    return Tiny().eval(), (torch.arange(6).reshape(2, 3) % 11,)


def main():
    model, inputs = model_and_inputs()
    res = aotfuse.build(model, inputs, targets=("sm_80", "sm_90"))
    ROOT.mkdir(parents=True, exist_ok=True)
    res.save(ROOT / "v1_model.aotf")
    ids = torch.tensor([[10, 0, 5], [3, 3, 7]])
    with torch.no_grad():
        outs = model(ids)
    (ROOT / "v1_model.json").write_text(json.dumps({
        "input": ids.tolist(), "outputs": [o.tolist() for o in outs],
        "note": "expected outputs of artifacts/golden/v1_model.aotf for `input` (fp32, eager at build time)",
    }, indent=1) + "\n")
    print(f"wrote {ROOT / 'v1_model.aotf'} ({len(res.data)} bytes)")


if __name__ == "__main__":
    import sys

    main_cnn() if "--cnn" in sys.argv else main()
