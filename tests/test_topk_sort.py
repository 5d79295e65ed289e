"""topk and sort as externs (torch's kernels, two results each), against eager on the CPU path; training through
topk (a few indices per row: compares and wheres) and through sort or a large-k topk (their gradient's scatter as
torch's kernel, an extern)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.testing.train_check import assert_training_matches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Route(nn.Module):
    """Top-2 routing as a mixture-of-experts layer does it, and an argsort."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 8)

    def forward(self, x):
        logits = self.gate(x)
        w, idx = torch.topk(logits.softmax(-1), 2, dim=-1)
        order = torch.argsort(logits[:, 0], descending=True)
        vals, _ = torch.sort(logits, dim=0)
        return w / w.sum(-1, keepdim=True), idx, order, vals


def test_topk_and_sort_match_eager():
    torch.manual_seed(0)
    model = Route().eval()
    art = aotfuse.load(aotfuse.build(model, (torch.randn(6, 16),), targets=("sm_90",)).data, device="cpu")
    x = torch.randn(6, 16) * 3
    for got, want in zip(art(x), model(x)):
        if want.dtype == torch.int64:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_training_through_topk():
    """topk's backward scatters the k gradients of each row back to their positions (lower/gather._scatter, k
    indices per row: a mixture of experts' router); before, the scatter was refused by name."""
    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.topk(self.lin(x), 3, dim=-1)[0].square().sum()

    torch.manual_seed(0)
    model = Loss()
    res = aotfuse.build(model, (torch.randn(4, 8),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(4, 8),), loss_atol=1e-5, grad_rtol=1e-5, grad_atol=1e-5)


@pytest.mark.parametrize("op", ["sort", "topk40"])
def test_training_through_sort_and_large_topk(op):
    """sort's gradient scatters every element of a row back (64 indices per row), a top-40's 40: more than
    lower/gather.py writes as compares, so torch's scatter kernel runs as an extern."""
    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            h = self.lin(x)
            v = torch.sort(h, -1)[0] if op == "sort" else torch.topk(h, 40, dim=-1)[0]
            return (v * torch.linspace(-1, 1, v.shape[-1])).sum()

    torch.manual_seed(0)
    model = Loss()
    res = aotfuse.build(model, (torch.randn(4, 64),), train=True, targets=("sm_90",))
    assert "aten.scatter.src" in _extern_targets(res.data)
    assert_training_matches(res.data, model, (torch.randn(4, 64),), loss_atol=1e-5, grad_rtol=1e-5, grad_atol=1e-5)


@pytest.mark.gpu
def test_topk_sort_and_scatter_add_on_cuda_with_graphs():
    class M(nn.Module):
        def forward(self, x, seg):
            w, idx = torch.topk(x.softmax(-1), 2, dim=-1)
            sums = torch.zeros(4, x.shape[1], device=x.device, dtype=x.dtype).scatter_add(
                0, seg[:, None].expand(-1, x.shape[1]), x)
            return w, idx, torch.sort(x, dim=0)[0], sums

    x, seg = torch.randn(6, 16), torch.tensor([0, 3, 3, 1, 0, 2])
    art = aotfuse.load(aotfuse.build(M(), (x, seg), targets=("sm_90",)).data, device="cuda", cuda_graphs=True)
    for s in (1, 2):  # the second call replays
        x2 = torch.randn(6, 16, generator=torch.Generator().manual_seed(s))
        for got, want in zip(art(x2.cuda(), seg.cuda()), M()(x2, seg)):
            if want.dtype == torch.int64:
                assert torch.equal(got.cpu(), want)
            else:
                torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def _extern_targets(data: bytes) -> set:
    from aotfuse.archive import read_archive
    from aotfuse.runtime.payload import read_payload

    progs = read_payload(read_archive(data)).programs
    return {i.target for p in progs.values() for i in p.instructions if hasattr(i, "target")}


class SortRouted(nn.Module):
    """An MoE's sort of its routed experts (topk indices of router logits, many ties), an argmax sorted
    descending, and a sort of a user's int64 tensor (values unknown: stays int64). The logits are an input, so
    that eager and the archive route alike (a matmul's rounding could flip a near tie)."""

    def forward(self, logits, ids):
        _, idx = torch.topk(logits, 2, dim=-1)
        vals, perm = torch.sort(idx.reshape(-1))
        top, order = torch.sort(logits.argmax(-1), descending=True)
        big, bperm = torch.sort(ids)
        return vals, perm, top, order, big, bperm


def _sort_decisions(res) -> list:
    from aotfuse.runtime.payload import read_report
    from aotfuse.archive import read_archive

    rep = read_report(read_archive(res.data))
    return [d for d in rep.lowering if "narrow_sort" in d]


def test_sorts_of_small_indices_run_on_int16_keys_and_match_eager():
    torch.manual_seed(0)
    model = SortRouted()
    ex = (torch.randn(40, 6), torch.randint(-2**40, 2**40, (50,)))
    res = aotfuse.build(model, ex, targets=("sm_90",))
    assert len(_sort_decisions(res)) == 2  # the routed experts' and the argmax's, not the user's int64 tensor
    art = aotfuse.load(res.data, device="cpu")
    fresh = (torch.randn(40, 6), torch.randint(-2**40, 2**40, (50,)))
    got, want = art(*fresh), model(*fresh)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.int64 and torch.equal(g, w)
    with __import__("aotfuse").knobs.override(narrow_sort=False):
        assert not _sort_decisions(aotfuse.build(model, ex, targets=("sm_90",)))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [40, 3000])  # torch's in-place small sort, and its radix sort (over 4096 keys)
def test_int16_sorts_match_eager_on_cuda_with_graphs(tokens):
    """The narrowed sort on CUDA gives eager's exact order, ties included, on both of torch's sort paths."""
    torch.manual_seed(1)
    model = SortRouted()
    ex = (torch.randn(tokens, 6), torch.randint(-2**40, 2**40, (50,)))
    art = aotfuse.load(aotfuse.build(model, ex, targets=("sm_90",)).data, device="cuda", cuda_graphs=True)
    for seed in (2, 3):
        g = torch.Generator().manual_seed(seed)
        x, ids = torch.randn(tokens, 6, generator=g).cuda(), torch.randint(-2**40, 2**40, (50,), generator=g).cuda()
        for got, want in zip(art(x, ids), model(x, ids)):
            assert torch.equal(got, want)
