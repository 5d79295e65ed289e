"""Test table: a small attention model (causal + padding mask as one boolean mask, GQA, RoPE on the
transposed views) for the training-attention tests on the CPU path and the GPU."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attn(nn.Module):
    """x -> qkv -> attention (causal + padding mask as one boolean mask, or GQA) -> proj -> mse loss."""

    def __init__(self, dim=32, heads=4, kv_heads=4, masked=False, causal=True, rope=False):
        super().__init__()
        self.rope = rope
        self.h, self.hk, self.d = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.d)
        self.proj = nn.Linear(dim, dim)
        self.masked, self.causal = masked, causal

    def forward(self, x, keep, target):
        b, t, c = x.shape
        q = self.q(x).view(b, t, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.hk, self.d).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.rope:  # pointwise on the transposed views (as Llama's RoPE): the FX layout is [B, T, H, E]
            pos = torch.arange(t, dtype=x.dtype, device=x.device)[:, None] * 0.1
            cos, sin = torch.cos(pos), torch.sin(pos)
            q = q * cos + torch.cat((-q[..., self.d // 2:], q[..., :self.d // 2]), -1) * sin
            k = k * cos + torch.cat((-k[..., self.d // 2:], k[..., :self.d // 2]), -1) * sin
        if self.masked:  # causal and padding: one boolean [B, 1, T, T] mask (sdpa refuses a mask with is_causal)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            mask = causal & keep[:, None, None, :]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.hk != self.h)
        y = self.proj(a.transpose(1, 2).reshape(b, t, c))
        return F.mse_loss(y, target)


def attn_case(**kw):
    torch.manual_seed(0)
    model = Attn(**kw)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 32, generator=g)
    keep = torch.ones(2, 16, dtype=torch.bool)
    keep[1, 11:] = False  # the second sequence is padded
    return model, (x, keep, torch.randn(2, 16, 32, generator=g))
