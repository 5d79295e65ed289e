"""torch.var / torch.var_mean / torch.std with any correction (aten.var.correction, aten.var_mean.correction:
export/decomp.py): values, dtypes, shapes and gradients against eager on the CPU path; a long statistic
splits as a Welford pair."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.knobs import override
from aotfuse.runtime.explain import explain_report

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Stats(nn.Module):
    def forward(self, x):
        v, m = torch.var_mean(x, dim=(0, 2), correction=1)
        return (x.var(), x.var(1, unbiased=False, keepdim=True), v, m, x.std(0),
                torch.var(x, dim=-1, correction=2), torch.var_mean(x, -1, keepdim=True)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_var_and_var_mean_match_eager(dtype):
    x = (torch.randn(5, 6, 7) * 3 + 10).to(dtype)
    art = aotfuse.load(aotfuse.build(Stats(), (x,), targets=("sm_90",)).data, device="cpu")
    x2 = (torch.randn(5, 6, 7) * 3 + 10).to(dtype)
    for got, want in zip(art(x2), Stats()(x2)):
        assert got.shape == want.shape and got.dtype == want.dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_var_of_one_element_is_nan_as_torch():
    class One(nn.Module):
        def forward(self, x):
            return x.var(0), torch.var(x, 0, correction=0)

    x = torch.randn(1, 4)
    got = aotfuse.load(aotfuse.build(One(), (x,), targets=("sm_90",)).data, device="cpu")(x)
    assert torch.isnan(got[0]).all() and torch.equal(got[1], torch.zeros(4))


class VarLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16))

    def forward(self, x):
        h = x * self.w
        return h.var(0).sum() + torch.var_mean(h, 1, correction=0)[1].square().mean()


def test_var_gradients_match_eager():
    torch.manual_seed(0)
    model = VarLoss()
    x = torch.randn(64, 16, requires_grad=True)
    mod = aotfuse.load(aotfuse.build(model, (x,), train=True, targets=("sm_90",)).data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    x2 = torch.randn(64, 16)
    xa, xb = x2.clone().requires_grad_(), x2.clone().requires_grad_()
    loss, want = mod(xa), ref(xb)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dict(mod.named_parameters())["w"].grad, ref.w.grad, rtol=1e-4, atol=1e-6)


def test_long_variance_splits_as_a_welford_pair():
    class ColVar(nn.Module):
        def forward(self, x):
            return x.var(0)

    x = torch.randn(4096, 16) * 2 + 30
    with override(split_min_elems=1024, split_min_chunk=16, split_min_programs=64):
        res = aotfuse.build(ColVar(), (x,), targets=("sm_90",))
    assert "Welford pair with" in explain_report(res.report)
    got = aotfuse.load(res.data, device="cpu")(x)
    want = x.double().var(0)
    assert float(((got.double() - want).abs() / want).max()) < 1e-6
