"""aten.index_put as an extern (torch's kernel): a functional `x[idx] = v`, a scatter-add with repeated indices,
and the gradient of advanced indexing (CLIP's pooling at the end-of-text token) in training; against eager on
the CPU path. A boolean-mask index is refused by name."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.errors import UnsupportedOpError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class EotPool(nn.Module):
    """The hidden state at each sequence's argmax token (CLIP's text pooling), then a loss."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, ids):
        h = torch.tanh(self.lin(self.emb(ids)))
        return h[torch.arange(h.shape[0]), ids.argmax(-1)].square().mean()


def test_advanced_indexing_gradient_trains():
    torch.manual_seed(0)
    model = EotPool()
    res = aotfuse.build(model, (torch.randint(0, 20, (3, 7)),), train=True, targets=("sm_90",))
    mod = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 20, (3, 7))
    loss, want = mod(ids), ref(ids)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    grads = dict(mod.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


class Writes(nn.Module):
    def forward(self, x, idx, v):
        y = x * 2
        y[idx] = v  # functional index_put
        z = torch.zeros_like(x).index_put((idx,), v * 3, accumulate=True)
        return y, z


def test_writes_and_repeated_accumulation_match_eager():
    x, v = torch.randn(6, 4), torch.randn(5, 4)
    idx = torch.tensor([1, 3, 1, 0, 3])
    res = aotfuse.build(Writes(), (x, idx, v), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    x2, v2 = torch.randn(6, 4), torch.randn(5, 4)
    idx2 = torch.tensor([5, 5, 5, 2, 0])
    got, want = art(x2, idx2, v2), Writes()(x2, idx2, v2)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)  # repeated indices add up
    # y[idx] = v with repeated indices: which write wins is unspecified in torch; compare the rows written once
    once = torch.tensor([r for r in range(6) if int((idx2 == r).sum()) <= 1])
    torch.testing.assert_close(got[0][once], want[0][once], rtol=0, atol=0)


class Masked(nn.Module):
    def forward(self, x, c):
        y = x.clone()
        y[x > 0.5] = 0.25  # one value for every selected element: a where
        z = x.index_put((c > 0,), c.sum(), accumulate=True)  # a mask over the leading dims, accumulated
        return y, z


def test_boolean_mask_writes_of_one_value_are_wheres():
    x, c = torch.randn(4, 5), torch.randn(4)
    res = aotfuse.build(Masked(), (x, c), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    x2, c2 = torch.randn(4, 5) * 2, torch.randn(4)
    for g, w in zip(art(x2, c2), Masked()(x2, c2)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_boolean_mask_write_of_a_tensor_is_refused_by_name():
    class Gathered(nn.Module):
        def forward(self, x):
            y = x.clone()
            y[x > 0] = x[x > 0] * 2  # values per selected element: data-dependent positions
            return y

    with pytest.raises(UnsupportedOpError):
        aotfuse.build(Gathered(), (torch.randn(4, 5),), targets=("sm_90",))


@pytest.mark.gpu
def test_index_put_on_cuda_in_training_and_graphs():
    torch.manual_seed(0)
    model = EotPool()
    res = aotfuse.build(model, (torch.randint(0, 20, (3, 7)),), train=True, targets=("sm_90",))
    mod = aotfuse.load(res.data, device="cuda").as_module()
    ref = copy.deepcopy(model).cuda()
    for seed in (1, 2):  # a second step replays
        ids = torch.randint(0, 20, (3, 7), generator=torch.Generator().manual_seed(seed)).cuda()
        for p in list(mod.parameters()) + list(ref.parameters()):
            p.grad = None
        loss, want = mod(ids), ref(ids)
        loss.backward()
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        grads = dict(mod.named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    x, v, idx = torch.randn(6, 4), torch.randn(5, 4), torch.tensor([1, 3, 1, 0, 3])
    art = aotfuse.load(aotfuse.build(Writes(), (x, idx, v), targets=("sm_90",)).data, device="cuda", cuda_graphs=True)
    for _ in range(2):
        got, want = art(x.cuda(), idx.cuda(), v.cuda()), Writes()(x, idx, v)
        torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=1e-5)


def test_uint8_masks_are_masks():
    """torch's deprecated uint8 index is a mask: a where for one value, refused by name otherwise (it built and then
    failed the archive's own validation)."""
    class U(nn.Module):
        def forward(self, x, m, v):
            return x.index_put((m,), v)

    x, m = torch.randn(4, 5), torch.tensor([1, 0, 1, 1], dtype=torch.uint8)
    art = aotfuse.load(aotfuse.build(U(), (x, m, torch.tensor(2.5)), targets=("sm_90",)).data, device="cpu")
    # (eager's index_put takes a uint8 mask with one value per selected row only; the bool mask is the reference)
    torch.testing.assert_close(art(x, m, torch.tensor(-1.0)), U()(x, m.bool(), torch.tensor(-1.0)))
    with pytest.raises(UnsupportedOpError, match="boolean-mask index"):
        aotfuse.build(U(), (x, m, torch.randn(3, 5)), targets=("sm_90",))
