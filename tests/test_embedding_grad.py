"""An embedding's weight gradient (runtime/embedding_grad.py): atomic adds into fp32, the padding row
zeroed, aten's sorted kernel for scale_grad_by_freq and under torch's deterministic algorithms."""
from __future__ import annotations

import copy

import pytest
import torch

import aotfuse
from aotfuse.runtime.embedding_grad import embedding_backward
from aotfuse.testing.opcases import TRAIN_CASES

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _case(name):
    return next(c for c in TRAIN_CASES if c.name == name)




@pytest.mark.parametrize("name,target", [("embedding_backward", "aotfuse.embedding_backward.default"),
                                         ("embedding_backward_padding", "aotfuse.embedding_backward.default"),
                                         ("embedding_backward_freq", "aten.embedding_dense_backward.out")])
def test_weight_gradient_matches_eager(name, target):
    torch.manual_seed(0)
    model, (idx,) = _case(name).make(torch.float32)
    with torch.no_grad():
        model.emb.weight.normal_()
    res = aotfuse.build(model, (idx,), train=True, targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    called = {getattr(i, "target", None) for i in art.executors["backward"].program.instructions}
    assert target in called
    pm = art.as_module()
    ref = copy.deepcopy(model)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        batch = torch.randint(0, 11, idx.shape, generator=g)
        for m in (pm, ref):
            m.zero_grad(set_to_none=True)
            m(batch).backward()
        got, want = dict(pm.named_parameters())["emb.weight"].grad, ref.emb.weight.grad
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
        if model.emb.padding_idx is not None:
            assert not got[model.emb.padding_idx].any()


def test_repeated_indices_sum_in_fp32_and_round_once():
    """Many bf16 rows into one weight row: summed in fp32, then rounded (as aten's kernel)."""
    g = torch.randn(4096, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    idx = torch.zeros(4096, dtype=torch.long)
    idx[::2] = 5
    got = embedding_backward(g, idx, 7, -1)
    want = torch.ops.aten.embedding_dense_backward(g, idx, 7, -1, False)
    exact = torch.zeros(7, 8, dtype=torch.float64).index_add_(0, idx, g.double())
    assert got.dtype == torch.bfloat16 and got.shape == (7, 8)
    assert torch.equal(got[1:5], torch.zeros(4, 8, dtype=torch.bfloat16))
    assert float((got.double() - exact).abs().max()) <= float((want.double() - exact).abs().max()) + 1e-2


def test_deterministic_algorithms_take_atens_sorted_kernel(monkeypatch):
    calls = []
    real = torch.ops.aten.embedding_dense_backward

    def spy(*a):
        calls.append(a)
        return real(*a)
    import aotfuse.runtime.embedding_grad as eg
    monkeypatch.setattr(eg, "aten", type("A", (), {"embedding_dense_backward": staticmethod(spy)}))
    g, idx = torch.randn(6, 4), torch.tensor([0, 1, 1, 2, 2, 2])
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out = embedding_backward(g, idx, 3, -1)
    finally:
        torch.use_deterministic_algorithms(prev)
    assert len(calls) == 1 and torch.allclose(out, real(g, idx, 3, -1, False))
    embedding_backward(g, idx, 3, -1)
    assert len(calls) == 1  # off again: the atomic path
