"""Constant attention masks become flags (export/masks.py): an all-kept mask is dropped and a causal
(tril) mask becomes is_causal=True, in inference (aten sdpa) and training (aotfuse::attention and its
backward); a causal sliding window becomes is_causal=True with window=W in training (sdpa has no window
argument: inference keeps it); any other mask is kept. Outputs and every gradient match eager on the CPU
path."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.archive import read_archive
from aotfuse.export.masks import classify
from aotfuse.runtime.explain import explain
from aotfuse.runtime.payload import read_payload

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class ConstMask(nn.Module):
    """Attention whose mask depends on shapes only (as transformers builds them under tracing), or on
    the `keep` input (a padding mask: kept)."""

    def __init__(self, kind: str, dim=32, heads=4, loss=False):
        super().__init__()
        self.kind, self.h, self.loss = kind, heads, loss
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def mask(self, b, t, keep, dtype):
        ar = torch.arange(t)
        if self.kind == "all_true":  # ViT's create_bidirectional_mask under tracing
            return (ar[None, :] + 0 >= 0)[None, None, :, :].expand(b, 1, t, t)
        if self.kind == "causal_bool":  # built through a scan, as masking_utils does
            pos = torch.ones(t, dtype=torch.int64).cumsum(0) - 1
            return (pos[None, :] <= pos[:, None])[None, None].expand(b, 1, t, t)
        if self.kind == "causal_float":  # additive: 0 kept, finfo.min masked
            return torch.full((t, t), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]
        if self.kind == "window":  # causal with a window of 4: a real mask
            return (ar[None, :] <= ar[:, None]) & (ar[None, :] > ar[:, None] - 4)
        if self.kind == "padding":
            return keep[:, None, None, :]
        raise ValueError(self.kind)

    def forward(self, x, keep, target):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(b, t, keep, x.dtype))
        y = self.proj(a.transpose(1, 2).reshape(b, t, c))
        return F.mse_loss(y, target) if self.loss else y


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, 9:] = False
    return torch.randn(2, 12, 32, generator=g), keep, torch.randn(2, 12, 32, generator=g)


def _attention_calls(data: bytes) -> list:
    with read_archive(data) as ar:
        progs = read_payload(ar).programs
    return [i for p in progs.values() for i in p.instructions if i.op == "extern" and "attention" in i.target]


def _mask_and_causal(ins):
    if ins.target == "aten.scaled_dot_product_attention.default":
        return ins.args[3], ins.kwargs["is_causal"]
    if ins.target == "aotfuse.attention.default":
        return ins.args[3], ins.args[4]
    return ins.args[4], ins.args[7]  # aotfuse.attention_backward


def _window_arg(ins) -> int:
    n = 7 if ins.target == "aotfuse.attention.default" else 10
    return ins.args[n] if len(ins.args) > n else 0


EXPECT = {"all_true": (None, False), "causal_bool": (None, True), "causal_float": (None, True),
          "window": ("kept", False), "padding": ("kept", False)}


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("kind", list(EXPECT))
def test_inference_mask_rewritten_exactly(kind):
    torch.manual_seed(0)
    model = ConstMask(kind).eval()
    res = aotfuse.build(model, _inputs(), targets=("sm_90",))
    calls = _attention_calls(res.data)
    assert len(calls) == 1
    mask, causal = _mask_and_causal(calls[0])
    want_mask, want_causal = EXPECT[kind]
    assert (mask is None) == (want_mask is None) and bool(causal) == want_causal, (mask, causal)
    art = aotfuse.load(res.data, device="cpu")
    x, keep, tgt = _inputs(seed=5)  # fresh inputs
    with torch.no_grad():
        assert rel(art(x, keep, tgt), model(x, keep, tgt)) < 1e-5
    if want_mask is None:
        assert "attention mask removed" in explain(res.data)


def test_inference_window_in_half_precision_becomes_the_fused_op_with_its_window():
    """sdpa has no window argument: a bf16 inference sdpa with a constant causal window becomes
    aotfuse::attention(..., window=4)[0] (flash's local kernel on CUDA); on the CPU the runtime rebuilds the mask.
    Against eager in bf16 and in float32: no further from float32 than eager bf16 is (plus a floor)."""
    torch.manual_seed(0)
    model = ConstMask("window").eval().to(torch.bfloat16)
    x, keep, tgt = _inputs()
    res = aotfuse.build(model, (x.bfloat16(), keep, tgt.bfloat16()), targets=("sm_90",))
    calls = _attention_calls(res.data)
    assert [c.target for c in calls] == ["aotfuse.attention.default"]
    assert calls[0].args[3] is None and calls[0].args[4] is True and _window_arg(calls[0]) == 4
    assert "sdpa -> aotfuse::attention(is_causal=True, window=4)" in explain(res.data)
    art = aotfuse.load(res.data, device="cpu")
    x, keep, tgt = _inputs(seed=5)
    with torch.no_grad():
        got, ref = art(x.bfloat16(), keep, tgt.bfloat16()), model(x.bfloat16(), keep, tgt.bfloat16())
        ref32 = copy.deepcopy(model).float()(x, keep, tgt)
    assert rel(got, ref32) <= 1.5 * rel(ref, ref32) + 1e-3, (rel(got, ref32), rel(ref, ref32))


class _BroadcastKV(nn.Module):
    """sdpa broadcasting a key/value batch of 1 over the query's batch of 2, with a constant window mask."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(32, 32), nn.Linear(32, 64)

    def forward(self, x, mem):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 8).transpose(1, 2)
        k, v = self.kv(mem).view(mem.shape[0], t, 2, 4, 8).permute(2, 0, 3, 1, 4)
        ar = torch.arange(t)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(ar[None, :] <= ar[:, None]) &
                                              (ar[None, :] > ar[:, None] - 4))


def test_inference_window_on_operands_the_fused_op_refuses_keeps_its_mask():
    """A key/value batch sdpa broadcasts: the fused op takes no broadcast batch, so the call keeps its mask, with
    the reason (the build had failed on the fused op's shape check)."""
    torch.manual_seed(0)
    model = _BroadcastKV().eval().to(torch.bfloat16)
    x, mem = torch.randn(2, 12, 32, dtype=torch.bfloat16), torch.randn(1, 12, 32, dtype=torch.bfloat16)
    res = aotfuse.build(model, (x, mem), targets=("sm_90",))
    assert [c.target for c in _attention_calls(res.data)] == ["aten.scaled_dot_product_attention.default"]
    assert "on sdpa: the mask stays (query [2, 4, 12, 8], key [1, 4, 12, 8]" in explain(res.data)
    with torch.no_grad():
        assert rel(aotfuse.load(res.data, device="cpu")(x, mem), model(x, mem)) < 1e-2


def test_training_window_in_bf16_becomes_the_window_argument_and_gradients_match():
    """bf16 training: the constant window (4 keys) becomes is_causal=True, window=4 on aotfuse::attention and its
    backward (flash's local kernel on CUDA; the CPU rebuilds the mask). Loss and gradients against eager bf16, each
    no further from float32 eager than eager bf16 is (plus a floor)."""
    torch.manual_seed(0)
    model = ConstMask("window", loss=True).to(torch.bfloat16)
    x, keep, tgt = _inputs()
    res = aotfuse.build(model, (x.bfloat16(), keep, tgt.bfloat16()), train=True, targets=("sm_90",))
    calls = _attention_calls(res.data)
    assert {c.target for c in calls} == {"aotfuse.attention.default", "aotfuse.attention_backward.default"}
    for c in calls:
        mask, causal = _mask_and_causal(c)
        assert mask is None and causal is True and _window_arg(c) == 4, c.target
    mod = aotfuse.load(res.data, device="cpu").as_module()
    x, keep, tgt = _inputs(seed=7)
    loss = mod(x.bfloat16(), keep, tgt.bfloat16())
    loss.backward()
    ref_model, ref32 = copy.deepcopy(model), copy.deepcopy(model).float()
    ref_model(x.bfloat16(), keep, tgt.bfloat16()).backward()
    ref32(x, keep, tgt).backward()
    lo, l32 = dict(ref_model.named_parameters()), dict(ref32.named_parameters())
    for n, p in mod.named_parameters():
        assert rel(p.grad, l32[n].grad) <= 2 * rel(lo[n].grad, l32[n].grad) + 1e-2, n


@pytest.mark.parametrize("kind", list(EXPECT))
def test_training_mask_rewritten_and_gradients_match(kind):
    torch.manual_seed(0)
    model = ConstMask(kind, loss=True)
    res = aotfuse.build(model, _inputs(), train=True, targets=("sm_90",))
    calls = _attention_calls(res.data)
    assert {c.target for c in calls} == {"aotfuse.attention.default", "aotfuse.attention_backward.default"}
    want_mask, want_causal = EXPECT[kind]  # fp32: flash's local kernel would not take a window, the mask stays
    for c in calls:
        mask, causal = _mask_and_causal(c)
        assert (mask is None) == (want_mask is None) and bool(causal) == want_causal, (c.target, mask, causal)
        assert _window_arg(c) == 0, c.target
    mod = aotfuse.load(res.data, device="cpu").as_module()
    x, keep, tgt = _inputs(seed=7)
    loss = mod(x, keep, tgt)
    loss.backward()
    ref_model = copy.deepcopy(model)
    ref = ref_model(x, keep, tgt)
    ref.backward()
    assert rel(loss, ref) < 1e-5
    ref_params = dict(ref_model.named_parameters())
    for n, p in mod.named_parameters():
        assert rel(p.grad, ref_params[n].grad) < 1e-4, n


def test_classify():
    tril = torch.ones(5, 5, dtype=torch.bool).tril()
    assert classify(torch.ones(2, 1, 5, 5, dtype=torch.bool), 5, 5) == "all"
    assert classify(torch.zeros(1, 5, dtype=torch.float32), 5, 5) == "all"  # additive, broadcast
    assert classify(tril[None, None].expand(3, 2, 5, 5), 5, 5) == "causal"
    neg = torch.zeros(5, 5).masked_fill(~tril, float("-inf"))
    assert classify(neg, 5, 5) == "causal"
    assert classify(torch.zeros(5, 5, dtype=torch.bfloat16).masked_fill(~tril, torch.finfo(torch.bfloat16).min),
                    5, 5) == "causal"
    assert classify(torch.zeros(5, 5).masked_fill(~tril, -1e4), 5, 5) is None  # a finite bias: not a mask
    assert classify(torch.ones(4, 6, dtype=torch.bool).tril(2), 4, 6) is None  # bottom-right causal (L != S)
    assert classify(torch.ones(4, 6, dtype=torch.bool).tril(), 4, 6) == "causal"  # sdpa's top-left alignment
    for w in (1, 2, 4):  # a causal sliding window: keys i - w < j <= i
        win = tril & torch.ones(5, 5, dtype=torch.bool).triu(-(w - 1))
        assert classify(win[None, None].expand(2, 1, 5, 5), 5, 5) == f"window:{w}"
        assert classify(torch.zeros(5, 5).masked_fill(~win, float("-inf")), 5, 5) == f"window:{w}"
    assert classify(torch.ones(5, 5, dtype=torch.bool).triu(-1) & torch.ones(5, 5, dtype=torch.bool).tril(1), 5, 5) \
        is None  # a band that is not causal
    assert classify(torch.ones(4, 6, dtype=torch.bool).tril() & torch.ones(4, 6, dtype=torch.bool).triu(-1), 4, 6) \
        is None  # L != S: flash would align the window to the bottom right
    mixed = torch.stack([tril, tril & torch.ones(5, 5, dtype=torch.bool).triu(-1)])  # batch rows differ
    assert classify(mixed, 5, 5) is None
    padded = tril.clone()
    padded[:, 4] = False
    assert classify(padded, 5, 5) is None
