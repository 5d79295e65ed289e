"""Probe: attention rows whose keys are all masked, on the GPU (bool padding mask [B, 1, 1, T], one sequence of
length 0). Compares what each path gives on those rows and checks every other row against fp32 math sdpa:
eager sdpa (torch's pick), eager math sdpa, the archive with AOTFUSE_ATTENTION=extern (sdpa with the mask made
additive 0/-inf once) and =template (aotfuse's flash-attention kernel).

    python3 scripts/masked_rows_probe.py [--batch 4] [--seq 256]

Prints, per path: NaN count on the fully-masked rows, their largest magnitude, and the relative error on the
other rows. aotfuse's convention (docs/architecture.md): a fully-masked row is 0, as -inf gives in the math form.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import aotfuse
from aotfuse.knobs import override

H, D = 4, 64


class Attn(torch.nn.Module):
    def forward(self, qkv, mask):
        b, t, _ = qkv.shape
        q, k, v = (z.view(b, t, H, D).transpose(1, 2) for z in qkv.split(H * D, dim=2))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, H * D)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    a = ap.parse_args()
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    torch.manual_seed(0)
    dt = torch.bfloat16
    qkv = torch.randn(a.batch, a.seq, 3 * H * D, dtype=dt)
    lengths = torch.linspace(0, a.seq, a.batch).long()  # sequence 0: no key kept
    mask = (torch.arange(a.seq)[None, :] < lengths[:, None])[:, None, None, :]
    x, m = qkv.cuda(), mask.cuda()
    with sdpa_kernel(SDPBackend.MATH):
        ref = Attn()(x.float(), m)
    dead = lengths == 0
    outs = {"eager sdpa": Attn()(x, m)}
    with sdpa_kernel(SDPBackend.MATH):
        outs["eager math sdpa"] = Attn()(x, m)
    for mode in ("extern", "template"):
        with override(attention=mode, targets=(arch,)):
            res = aotfuse.build(Attn(), (qkv, mask), targets=(arch,))
        art = aotfuse.load(res.data, device="cuda", cuda_graphs=False)
        o = art(x, m)
        outs[f"aotfuse {mode}"] = o[0] if isinstance(o, (tuple, list)) else o
    print(f"{a.batch} x {a.seq}, {H} heads of {D}, bf16; fully-masked sequences: {int(dead.sum())}")
    print("| path | NaN on masked rows | max abs on masked rows | rel err elsewhere |\n|---|---|---|---|")
    live_ref = ref[~dead.cuda()]
    for name, o in outs.items():
        o = o.float()
        dm, live = o[dead.cuda()], o[~dead.cuda()]
        err = float((live - live_ref).norm() / live_ref.norm())
        finite = dm[torch.isfinite(dm)]
        mx = float(finite.abs().max()) if finite.numel() else float("nan")
        print(f"| {name} | {int(torch.isnan(dm).sum())} | {mx:.3g} | {err:.2e} |")


if __name__ == "__main__":
    main()
