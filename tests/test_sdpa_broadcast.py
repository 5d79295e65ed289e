"""scaled_dot_product_attention with broadcast leading dims (aotfuse/sdpa_shapes.py): Falcon's multi-query
attention passes one key/value head against H query heads (grouped-query attention with Hk = 1, no copy);
a key and value with batch 1 are expanded. Inference and training match eager; before, the inference archive
built and then refused its own extern at run time, and the training trace failed in a reshape."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.testing.train_check import assert_training_matches
from aotfuse.sdpa_shapes import plan


class MQA(nn.Module):
    def __init__(self, batch_broadcast: bool):
        super().__init__()
        self.q = nn.Linear(16, 64)
        self.kv = nn.Linear(16, 32)
        self.batch_broadcast = batch_broadcast

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 16).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, 1, 16).transpose(1, 3).unbind(2)  # [B, 1, T, 16]: one head
        if self.batch_broadcast:  # [1, 4, T, 16]: the first sequence's key and value for every batch
            k, v = (z[:1].expand(1, 4, t, 16) * 1.0 for z in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Loss(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).square().mean()


def test_plan():
    assert plan((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16)) is None
    p = plan((2, 4, 8, 16), (2, 1, 8, 16), (2, 1, 8, 16))
    assert p.gqa and p.lead is None and "1 head" in p.why
    p = plan((2, 4, 8, 16), (1, 4, 8, 16), (1, 4, 8, 16))
    assert not p.gqa and p.lead == (2, 4)
    assert plan((2, 4, 8, 16), (3, 4, 8, 16), (3, 4, 8, 16)) is None  # not broadcastable: torch's error


@pytest.mark.parametrize("batch_broadcast", [False, True], ids=["one_head", "batch1"])
def test_inference(batch_broadcast):
    torch.manual_seed(0)
    model = MQA(batch_broadcast)
    res = aotfuse.build(model, (torch.randn(2, 8, 16),), targets=("sm_90",))
    recs = [d for d in res.report.lowering if "attention_broadcast" in d]
    assert len(recs) == 1 and ("grouped-query" in recs[0]["why"]) != batch_broadcast, recs
    x = torch.randn(2, 8, 16)
    torch.testing.assert_close(aotfuse.load(res.data, device="cpu")(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_broadcast", [False, True], ids=["one_head", "batch1"])
def test_training(batch_broadcast):
    torch.manual_seed(0)
    model = Loss(MQA(batch_broadcast))
    res = aotfuse.build(model, (torch.randn(2, 8, 16),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(2, 8, 16),))


class Rank3(nn.Module):
    """sdpa on [B, L, E] (no head dim), causal or with a [B, L, S] mask."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 48)

    def forward(self, x, m=None):
        q, k, v = self.lin(x).chunk(3, -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None)


def test_rank3_inference_and_training():
    """Before: the build made an extern on 3-d views, which the runtime refused at load as a damaged archive."""
    torch.manual_seed(0)
    model = Rank3()
    x = torch.randn(2, 10, 16)
    mask = torch.rand(2, 10, 10) > 0.3
    mask[:, :, 0] = True
    for args in ((x,), (x, mask)):
        res = aotfuse.build(model, args, targets=("sm_90",))
        fresh = (torch.randn(2, 10, 16), *args[1:])
        torch.testing.assert_close(aotfuse.load(res.data, device="cpu")(*fresh), model(*fresh), rtol=1e-5, atol=1e-5)
    loss_model = Loss(Rank3())
    res = aotfuse.build(loss_model, (x,), train=True, targets=("sm_90",))
    assert_training_matches(res.data, loss_model, (x,))
