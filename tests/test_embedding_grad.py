"""An embedding's weight gradient (runtime/embedding_grad.py): atomic adds into fp32 (one accumulator row per
token when the table has more rows), the padding row zeroed, aten's sorted kernel for scale_grad_by_freq and
under torch's deterministic algorithms; a tied table's gradient in one buffer (joint/tied_embedding.py)."""
from __future__ import annotations

import copy

import pytest
import torch

import aotfuse
from aotfuse.runtime.embedding_grad import embedding_backward, mm_embedding_backward
from aotfuse.runtime.explain import explain_report
from aotfuse.testing.opcases import TRAIN_CASES

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _case(name):
    return next(c for c in TRAIN_CASES if c.name == name)




@pytest.mark.parametrize("name,target", [("embedding_backward", "aotfuse.embedding_backward.default"),
                                         ("embedding_backward_padding", "aotfuse.embedding_backward.default"),
                                         ("embedding_backward_sparse", "aotfuse.embedding_backward.default"),
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
        batch = torch.randint(0, model.emb.num_embeddings, idx.shape, generator=g)
        batch.view(-1)[:3] = batch.view(-1)[3]  # a repeated index
        if model.emb.padding_idx is not None:
            batch.view(-1)[-1] = model.emb.padding_idx
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


class Positions(torch.nn.Module):
    """Token + position embeddings (pos(arange(t)), the GPT's), a position table longer than t and an
    optional padding row: the position gradient's indices are arange(t)."""

    def __init__(self, seq=16, dim=8, padding_idx=None):
        super().__init__()
        self.tok = torch.nn.Embedding(11, dim)
        self.pos = torch.nn.Embedding(seq, dim, padding_idx=padding_idx)
        with torch.no_grad():
            self.pos.weight.normal_()

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        return (h.float() * torch.linspace(-1, 1, h.shape[-1])).pow(2).sum()


@pytest.mark.parametrize("seq,padding_idx,dtype", [(10, None, torch.float32), (16, None, torch.float32),
                                                   (16, 3, torch.float32), (16, None, torch.bfloat16)])
def test_position_embedding_gradient_is_pointwise(seq, padding_idx, dtype):
    """arange indices: the weight gradient is the output gradient's rows (lower/embedding.py), zeros for
    rows past t and the padding row, no extern; it matches eager."""
    torch.manual_seed(0)
    model = Positions(seq, padding_idx=padding_idx).to(dtype)
    tokens = torch.randint(0, 11, (3, 10))
    res = aotfuse.build(model, (tokens,), train=True, targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    called = [getattr(i, "target", None) for i in art.executors["backward"].program.instructions]
    assert called.count("aotfuse.embedding_backward.default") == 1, called  # the token table's only
    assert "indices are arange(10)" in explain_report(res.report, program="backward")
    pm = art.as_module()
    ref = copy.deepcopy(model)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        batch = torch.randint(0, 11, (3, 10), generator=g)
        for m in (pm, ref):
            m.zero_grad()
            m(batch).backward()
        ours, theirs = dict(pm.named_parameters()), dict(ref.named_parameters())
        for n in theirs:
            a, b = ours[n].grad.double(), theirs[n].grad.double()
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            assert float((a - b).norm() / b.norm()) < tol, n
        pg = ours["pos.weight"].grad
        assert pg[10:].eq(0).all() and (padding_idx is None or pg[padding_idx].eq(0).all())


@pytest.mark.parametrize("rows,tokens,padding_idx", [(40, 12, -1), (40, 12, 5), (300, 64, 7), (10, 40, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_and_dense_accumulators_match_aten(rows, tokens, padding_idx, dtype):
    """More rows than tokens: one fp32 slot per token (the first position of its index); otherwise the table-sized
    accumulator. Both sum in fp32 and round once: exactly aten's fp32 result rounded."""
    g = torch.Generator().manual_seed(rows + tokens)
    idx = torch.randint(0, rows, (2, tokens // 2), generator=g)
    idx[1, 0] = idx[0, 1] = idx[0, 0]  # repeats
    if padding_idx >= 0:
        idx[1, 1] = padding_idx
    go = torch.randn(2, tokens // 2, 8, generator=g).to(dtype)
    want = torch.ops.aten.embedding_dense_backward(go.float(), idx, rows, padding_idx, False).to(dtype)
    got = embedding_backward(go, idx, rows, padding_idx)
    assert got.dtype == dtype and got.shape == (rows, 8)
    assert float((got.float() - want.float()).abs().max()) <= (1e-6 if dtype == torch.float32 else 1e-2)
    if padding_idx >= 0:
        assert not got[padding_idx].any()


@pytest.mark.parametrize("rows,tokens", [(40, 12), (10, 40)])
def test_mm_embedding_backward_is_the_product_plus_the_rows(rows, tokens):
    g = torch.Generator().manual_seed(tokens)
    idx = torch.randint(0, rows, (tokens,), generator=g)
    idx[:2] = 3  # the padding index, twice
    go = torch.randn(tokens, 8, generator=g)
    a, b = torch.randn(rows, 5, generator=g), torch.randn(5, 8, generator=g)
    got = mm_embedding_backward(a, b, go, idx, rows, 3)
    want = a @ b + torch.ops.aten.embedding_dense_backward(go, idx, rows, 3, False)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(got[3], (a @ b)[3])  # the padding row: the product alone


def _tied_model(rows, dim, dtype=torch.float32):
    from aotfuse.testing.opcases import _TiedLoss

    torch.manual_seed(0)
    return _TiedLoss(rows, dim).to(dtype).train()


@pytest.mark.parametrize("rows,dim,dtype", [(24, 8, torch.float32), (64, 16, torch.bfloat16)])
def test_tied_table_gradient_is_one_buffer_and_matches_eager(rows, dim, dtype):
    model = _tied_model(rows, dim, dtype)
    idx = torch.randint(0, rows, (2, 8))
    res = aotfuse.build(model, (idx,), train=True, targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    called = [getattr(i, "target", None) for i in art.executors["backward"].program.instructions]
    assert "aotfuse.mm_embedding_backward.default" in called
    assert "aotfuse.embedding_backward.default" not in called
    assert "one buffer with its matmul" in explain_report(res.report)
    pm, ref = art.as_module(), copy.deepcopy(model)
    for seed in (1, 2):
        batch = torch.randint(0, rows, (2, 8), generator=torch.Generator().manual_seed(seed))
        batch[0, :2] = 1  # the padding row, read by the projection only
        for m in (pm, ref):
            m.zero_grad(set_to_none=True)
            m(batch).backward()
        ours = dict(pm.named_parameters())
        for n, p in ref.named_parameters():
            a, b = ours[n].grad.double(), p.grad.double()
            assert float((a - b).norm() / b.norm()) < (1e-6 if dtype == torch.float32 else 2e-2), n


def test_misaligned_tied_table_keeps_the_add_with_a_reason():
    """A vocabulary that is no multiple of 8 (GPT-2's 50257) keeps the padded matmul and the add."""
    model = _tied_model(27, 8, torch.bfloat16)
    res = aotfuse.build(model, (torch.randint(0, 27, (2, 8)),), train=True, targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    called = [getattr(i, "target", None) for i in art.executors["backward"].program.instructions]
    assert "aotfuse.mm_embedding_backward.default" not in called
    assert "are not all multiples of 8" in explain_report(res.report)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gradient_at_a_padding_token_leaves_the_padding_row_zero(bad):
    """The per-token accumulator's padding slot is filled with 0, not multiplied by 0 (0 * NaN is NaN): a padded
    batch whose masked positions get a NaN gradient still leaves the padding row as aten does."""
    idx = torch.tensor([1, 2, 3, 1])
    go = torch.randn(4, 4)
    go[0] = bad
    got = embedding_backward(go, idx, 40, 1)
    want = torch.ops.aten.embedding_dense_backward(go, idx, 40, 1, False)
    assert torch.equal(got, want) and not got[1].any()
    a, b = torch.randn(40, 3), torch.randn(3, 4)
    fused = mm_embedding_backward(a, b, go, idx, 40, 1)
    assert torch.equal(fused[1], (a @ b)[1]) and torch.isfinite(fused).all()
