"""Attention masks of dynamic size (export/mask_range.py): a mask whose ops keep each element whatever the sizes
is evaluated once at the range's end and classified there (causal -> is_causal, all kept -> dropped); a mask
that lets a size enter a value, counts from the end, or reads an input stays, with the op named. Outputs match
eager at the range's ends and in between, where a mask that looked causal at the example (a window wider than
it) must stay."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.runtime.explain import explain

from test_attention_masks import _attention_calls, _mask_and_causal, rel

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

T_LO, T_EX, T_HI = 2, 12, 40


class DynMask(nn.Module):
    """Attention with a mask built from the sequence length t only (as transformers builds them), or from the
    `keep` input."""

    def __init__(self, kind: str, dim=32, heads=4):
        super().__init__()
        self.kind, self.h = kind, heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def mask(self, b, t, keep):
        ar = torch.arange(t)
        if self.kind == "causal_packed":  # masking_utils: causal, and packed-sequence ids from position diffs
            pos = ar[None, :].expand(b, -1)
            first = pos[:, :1] - 1
            seq = (torch.diff(pos, dim=-1, prepend=first) != 1).cumsum(-1)
            causal = ar[None, None, None, :] <= ar[None, None, :, None]
            same = seq[:, None, :, None] == seq[:, None, None, :]
            return (causal & same).expand(b, 1, t, t)
        if self.kind == "all_true":
            return (ar[None, :] >= 0)[None, None].expand(b, 1, t, t)
        if self.kind == "wide_window":  # causal at the example (t <= 12), a window of 20 keys at t = 40
            return (ar[None, :] <= ar[:, None]) & (ar[None, :] > ar[:, None] - 20)
        if self.kind == "size_in_value":  # keys before t // 2 and the causal ones: t enters the values
            return (ar[None, :] <= ar[:, None]) | (ar[None, :] < t // 2)
        if self.kind == "from_the_end":  # a flipped anti-causal mask: flip counts from the end
            return torch.flip((ar[None, :] >= ar[:, None]), dims=(0, 1))
        if self.kind == "negative_index":  # ar[-1] is t - 1: all kept below the range's end (review, 2026-11-28)
            return (ar[None, :] <= ar[:, None]) | (ar[torch.tensor([-1])] < T_HI - 1)
        if self.kind == "padding":
            return keep[:, None, None, :]
        raise ValueError(self.kind)

    def forward(self, x, keep):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(b, t, keep))
        return a.transpose(1, 2).reshape(b, t, c)


def _inputs(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(b, t, generator=g) > 0.2
    keep[:, 0] = True
    return torch.randn(b, t, 32, generator=g), keep


DYN = [f"x.0=2..4", f"x.1={T_LO}..{T_HI}", "keep.0=2..4", f"keep.1={T_LO}..{T_HI}"]
# kind -> (mask dropped, causal, a word of the reason it stays)
EXPECT = {"causal_packed": (True, True, None), "all_true": (True, False, None),
          "wide_window": (False, False, "sliding window"), "size_in_value": (False, False, "a size as a value"),
          "from_the_end": (False, False, "flip"), "negative_index": (False, False, "counting from the end"),
          "padding": (False, False, "reads input")}


@pytest.mark.parametrize("kind", list(EXPECT))
def test_dynamic_mask_at_every_size(kind):
    torch.manual_seed(0)
    model = DynMask(kind).eval()
    res = aotfuse.build(model, _inputs(2, T_EX, 0), targets=("sm_90",), dynamic_shapes=DYN)
    dropped, causal, why = EXPECT[kind]
    (call,) = _attention_calls(res.data)
    mask, is_causal = _mask_and_causal(call)
    assert (mask is None) == dropped and bool(is_causal) == causal, (mask, is_causal)
    text = explain(res.data)
    if dropped:
        assert "at every size in range" in text
    else:
        assert "attention mask kept" in text and why in text, [ln for ln in text.splitlines() if "mask" in ln]
    art = aotfuse.load(res.data, device="cpu")
    for b, t, seed in ((2, T_LO, 1), (3, 7, 2), (2, T_EX, 3), (4, T_HI, 4)):
        x, keep = _inputs(b, t, seed)
        with torch.no_grad():
            want = model(x, keep)
        assert rel(art(x, keep), want) < 1e-5, (b, t)


def test_training_dynamic_causal_mask_becomes_causal_and_gradients_match():
    torch.manual_seed(0)
    model = DynMask("causal_packed")
    ref = copy.deepcopy(model)

    class Loss(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, keep, y):
            return F.mse_loss(self.m(x, keep), y)

    def batch(b, t, seed):
        x, keep = _inputs(b, t, seed)
        return x, keep, torch.randn(b, t, 32, generator=torch.Generator().manual_seed(seed + 100))

    res = aotfuse.build(Loss(model), batch(2, T_EX, 0), train=True, targets=("sm_90",),
                        dynamic_shapes=DYN + ["y.0=2..4", f"y.1={T_LO}..{T_HI}"])
    calls = _attention_calls(res.data)
    assert calls and all(_mask_and_causal(c) == (None, True) for c in calls), [_mask_and_causal(c) for c in calls]
    assert "at every size in range" in explain(res.data)
    pm = aotfuse.load(res.data, device="cpu").as_module()
    for b, t, seed in ((2, T_LO, 1), (3, 9, 2), (4, T_HI, 3)):
        args = batch(b, t, seed)
        for p in list(pm.parameters()) + list(ref.parameters()):
            p.grad = None
        pm(*args).backward()
        F.mse_loss(ref(*args[:2]), args[2]).backward()
        for p, q in zip(pm.parameters(), ref.parameters()):
            assert rel(p.grad, q.grad) < 1e-4, (b, t)


def test_dynamic_window_in_half_precision_becomes_the_fused_op_at_every_size():
    """A window of 20 keys looks causal at the example (12) and is a window at the range's end (40): in bf16 the
    call becomes the fused op with window=20 (flash's local attention on CUDA), equal to eager at every size."""
    torch.manual_seed(0)
    model = DynMask("wide_window").to(torch.bfloat16).eval()

    def inputs(b, t, seed):
        x, keep = _inputs(b, t, seed)
        return x.to(torch.bfloat16), keep

    res = aotfuse.build(model, inputs(2, T_EX, 0), targets=("sm_90",), dynamic_shapes=DYN)
    (call,) = _attention_calls(res.data)
    assert call.target == "aotfuse.attention.default" and call.args[7] == 20, call
    assert "window=20" in explain(res.data) and "at every size in range" in explain(res.data)
    art = aotfuse.load(res.data, device="cpu")
    for b, t, seed in ((2, T_LO, 1), (3, 19, 2), (2, 21, 3), (4, T_HI, 4)):
        x, keep = inputs(b, t, seed)
        with torch.no_grad():
            want = model(x, keep)
        assert rel(art(x, keep), want) < 2e-2, (b, t)
