"""Lowering: what an extern's operands cost, and nodes computed twice.

A view cuBLAS cannot read (a reshape of a transpose) is copied once for all its matmuls, in the order that reads
its base along the contiguous dim (LowerCtx.realize); attention operands are stored [B, T, H, E]
(layouts.attention_perm); a node that reads nothing (torch.full, ones_like) is recomputed in its consumers, never
stored; two equal stored pointwise nodes are one (schedule/inline.py)."""
from __future__ import annotations

import torch
import torch.nn as nn

import aotfuse
from aotfuse.export import capture
from aotfuse.ir.loop import Pointwise, expr_loads
from aotfuse.lower import lower
from aotfuse.schedule.inline import inline_pointwise


class _DgradWgrad(nn.Module):
    """A [B, H, T, D] gradient-like value seen as [B*T, H*D] (not strided) by a dgrad and, transposed, a wgrad."""

    def forward(self, x, w, h):
        b, nh, t, d = x.shape
        y = (x * 2.0).transpose(1, 2).reshape(b * t, nh * d)
        return y @ w, y.t() @ h


def _inputs():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(2, 4, 8, 16, generator=g), torch.randn(64, 24, generator=g), torch.randn(16, 40, generator=g))


def test_one_copy_for_both_matmuls_read_back_transposed():
    graph, ctx = lower(capture(_DgradWgrad().eval(), _inputs()))
    copies = [d for d in ctx.decisions if isinstance(d, dict) and "realize" in d]
    assert len(copies) == 2, copies
    assert len({d["realize"] for d in copies}) == 1  # the wgrad's operand reuses the dgrad's copy
    assert copies[1].get("reused")
    # [B*T, H*D] reads x's rows of D along the contiguous dim: copied as is, and its transpose reads that copy
    assert [d["order"] for d in copies] == ["as is", "last two dims swapped (read back transposed)"]


def test_transposed_first_is_copied_in_the_coalesced_order():
    class WgradFirst(_DgradWgrad):
        def forward(self, x, w, h):
            b, nh, t, d = x.shape
            y = (x * 2.0).transpose(1, 2).reshape(b * t, nh * d)
            return y.t() @ h, y @ w

    graph, ctx = lower(capture(WgradFirst().eval(), _inputs()))
    copies = [d for d in ctx.decisions if isinstance(d, dict) and "realize" in d]
    assert [d["order"] for d in copies] == ["last two dims swapped (read back transposed)", "as is"]
    assert copies[0]["realize"] == copies[1]["realize"]


def test_numerics_against_eager():
    model = _DgradWgrad().eval()
    res = aotfuse.build(model, _inputs())
    art = aotfuse.load(res.data, device="cpu")
    g = torch.Generator().manual_seed(9)
    x, w, h = torch.randn(2, 4, 8, 16, generator=g), torch.randn(64, 24, generator=g), torch.randn(16, 40, generator=g)
    for ours, ref in zip(art(x, w, h), model(x, w, h)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


class _SharedOnes(nn.Module):
    def forward(self, a, b):
        one = torch.ones_like(a)
        return (one - torch.sigmoid(a)) * b, (one + a) * b, one * 3.0 - b


def test_a_node_that_reads_nothing_is_never_stored():
    graph, _ = lower(capture(_SharedOnes().eval(), (torch.randn(8, 32), torch.randn(8, 32))))
    graph, decisions = inline_pointwise(graph)
    stored_constants = [n.name for n in graph.nodes if isinstance(n, Pointwise) and not expr_loads(n.body)]
    assert stored_constants == []
    assert any(d.reason == "reads nothing (recomputed for free)" for d in decisions)


class _RotaryAttention(nn.Module):
    """q and k scaled per position after a per-head view of a projection (rotary embeddings' shape of data flow),
    v a plain per-head view, causal attention: eager lays the scaled q and k out [B, T, H, E]."""

    def __init__(self, c=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(c, 3 * c)
        self.out = nn.Linear(c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        pos = torch.linspace(0.5, 1.5, t).view(1, 1, t, 1)
        q, k = q * pos + 0.1, k * pos - 0.1
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c)).square().mean()


def _attention_strides(data: bytes) -> list:
    import msgpack

    from aotfuse.archive import read_archive

    arc = read_archive(data)
    found = []
    for prog in ("program.forward", "program.backward"):
        p = arc.part(prog)
        p = msgpack.unpackb(p) if isinstance(p, (bytes, memoryview)) else p
        for st in p["instructions"]:
            if st.get("op") == "extern" and "attention" in st["target"]:
                found.append([tuple(a["stride"]) for a in st["args"] if isinstance(a, dict) and len(a["shape"]) == 4])
    return found


def test_attention_operands_are_stored_as_the_kernels_write_them():
    """The scaled q and k are stored [B, T, H, E] (aotfuse/layouts.attention_perm), so the attention kernels'
    results and gradients come out in the contract's layout with no copy; loss and gradients match eager."""
    from test_lifted_constants import _check as _train_check

    torch.manual_seed(0)
    model = _RotaryAttention().train()
    x = torch.randn(2, 8, 32)
    res = aotfuse.build(model, (x,), train=True)
    strides = _attention_strides(res.data)
    assert len(strides) == 2  # the forward's attention and the backward's
    for args in strides:  # [B, H, T, E] views of [B, T, H, E] storage: T steps over the heads
        assert args and all(s[3] == 1 and s[2] > s[1] for s in args), strides
    assert strides[0][:2] == [(8 * 32, 8, 32, 1)] * 2  # the scaled q and k, stored so
    _train_check(model, (x,), (torch.randn(2, 8, 32) * 2,))


class _TwiceTheSame(nn.Module):
    """Two attentions whose masks are computed alike from one bias (T5's position bias per layer): stored for
the attention kernels, the two are one."""

    def forward(self, q, k, v, bias):
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias * 0.5 + 0.1)
        b = torch.nn.functional.scaled_dot_product_attention(a, k, v, attn_mask=bias * 0.5 + 0.1)
        return a + b


def test_equal_pointwise_nodes_are_one_node():
    g = torch.Generator().manual_seed(5)
    args = tuple(torch.randn(2, 4, 16, 8, generator=g) for _ in range(3)) + (torch.randn(2, 4, 16, 16, generator=g),)
    model = _TwiceTheSame().eval()
    graph, _ = lower(capture(model, args))
    before = [(n.numel, n.body) for n in graph.nodes if isinstance(n, Pointwise)]
    assert len(before) > len(set(before))  # lowered, each attention's mask is a node of its own
    graph, decisions = inline_pointwise(graph)
    stored = [(n.numel, n.body) for n in graph.nodes if isinstance(n, Pointwise)]
    assert len(stored) == len(set(stored))  # no two stored nodes compute the same thing
    assert any(d.reason == "equal to an earlier stored node (read instead)" for d in decisions)
    res = aotfuse.build(model, args)
    art = aotfuse.load(res.data, device="cpu")
    fresh = tuple(torch.randn(2, 4, 16, 8, generator=g) for _ in range(3)) + (torch.randn(2, 4, 16, 16, generator=g),)
    torch.testing.assert_close(art(*fresh), model(*fresh), rtol=1e-5, atol=1e-5)
