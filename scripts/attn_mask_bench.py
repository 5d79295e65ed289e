"""Masked attention: aotfuse's flash-attention template vs torch's sdpa with the same kept mask (a padding
mask [B, 1, 1, T] in bool and in float, a sliding window [B, 1, T, T]), on the anchor GPT's attention shape
(12 heads of 64, not causal, bf16, q/k/v views of a [B, T, 3 x 768] projection).

    python3 scripts/attn_mask_bench.py [--batch 8] [--seq 1024] [--iters 50]

Per case: eager sdpa (torch picks the backend), the archive with AOTFUSE_ATTENTION=template and with
=extern (torch's sdpa through aotfuse's runtime); kernel time by CUDA-graph replay of `iters` calls, median
of 7 rounds; each checked against fp32 sdpa.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

import aotfuse
from aotfuse.knobs import override

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_runtime_probe import graph_us  # noqa: E402

H, D = 12, 64


class Attn(torch.nn.Module):
    def forward(self, qkv, mask):
        b, t, _ = qkv.shape
        q, k, v = (z.view(b, t, H, D).transpose(1, 2) for z in qkv.split(H * D, dim=2))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, H * D)


def masks(b, t, dtype):
    lengths = torch.linspace(t // 4, t, b).long()
    keep = torch.arange(t)[None, :] < lengths[:, None]
    i = torch.arange(t)
    window = ((i[:, None] - i[None, :]).abs() <= 128)[None, None].expand(b, 1, t, t).contiguous()
    return {"padding bool [B,1,1,T]": keep[:, None, None, :],
            "padding float [B,1,1,T]": torch.zeros(b, 1, 1, t, dtype=dtype).masked_fill(~keep[:, None, None, :],
                                                                                       torch.finfo(dtype).min),
            "window bool [B,1,T,T]": window}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    dt = torch.bfloat16
    torch.manual_seed(0)
    qkv = torch.randn(a.batch, a.seq, 3 * H * D, dtype=dt)
    rows = []
    for name, mask in masks(a.batch, a.seq, dt).items():
        x, m = qkv.cuda(), mask.cuda()
        ref = Attn()(x.float(), m if m.dtype == torch.bool else m.float())
        times = {"eager sdpa": graph_us(lambda: Attn()(x, m), a.iters)}
        for mode in ("template", "extern"):
            with override(attention=mode, targets=(arch,)):
                res = aotfuse.build(Attn(), (qkv, mask), targets=(arch,))
            kinds = {k.kind for k in aotfuse.load(res.data, device="cpu").kernels.values()}
            art = aotfuse.load(res.data, device="cuda", cuda_graphs=False)
            out = art(x, m)
            out = out[0] if isinstance(out, (tuple, list)) else out
            err = float((out.float() - ref).norm() / ref.norm())
            times[f"aotfuse {mode}{' (template kernel)' if 'template_attn' in kinds else ''}, err {err:.1e}"] = \
                graph_us(lambda: art(x, m), a.iters)
        print(f"\n== {name}, {a.batch} x {a.seq}, 12 x 64, not causal")
        for k, v in times.items():
            print(f"  {v:8.1f} us  {k}")
        tmpl = next(v for k, v in times.items() if k.startswith("aotfuse template"))
        rows.append((name, times["eager sdpa"], tmpl))
    print("\n| mask | eager sdpa us | aotfuse template us | template / sdpa |\n|---|---|---|---|")
    for name, e, t in rows:
        print(f"| {name} | {e:.1f} | {t:.1f} | {t / e:.2f} |")


if __name__ == "__main__":
    main()
