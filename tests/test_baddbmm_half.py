"""baddbmm in half precision (export/decomp._baddbmm): the product stays a bf16 bmm (torch's decomposition cast the
operands to fp32 first: an fp32 bmm of upcast copies in BLOOM's ALiBi attention), the scale and add in fp32,
rounded once; as accurate as eager against an fp32 reference, inference and training."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.runtime.explain import explain_report
from aotfuse.testing.train_check import assert_training_matches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Scores(nn.Module):
    def forward(self, c, a, b):
        return torch.baddbmm(c, a, b, beta=0.5, alpha=0.125).softmax(-1)


def _rel(x, y):
    return float((x.float() - y).norm() / y.norm())


def test_half_baddbmm_is_a_half_bmm_as_accurate_as_eager():
    g = torch.Generator().manual_seed(0)
    c, a, b = (torch.randn(*s, generator=g).bfloat16() for s in ((4, 32, 32), (4, 32, 64), (4, 64, 32)))
    res = aotfuse.build(Scores(), (c, a, b), targets=("sm_90",))
    lines = [ln for ln in explain_report(res.report).splitlines() if " bmm " in ln and "-> extern" in ln]
    assert lines and all("bfloat16" in ln for ln in lines), lines
    c, a, b = (torch.randn(*s, generator=g).bfloat16() for s in ((4, 32, 32), (4, 32, 64), (4, 64, 32)))
    ref = Scores()(c.float(), a.float(), b.float())
    ours = aotfuse.load(res.data, device="cpu")(c, a, b)
    assert ours.dtype == torch.bfloat16
    assert _rel(ours, ref) <= 1.5 * _rel(Scores()(c, a, b), ref) + 1e-3


def test_baddbmm_trains():
    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 16, 8) * 0.3)
            self.bias = nn.Parameter(torch.randn(4, 6, 8) * 0.1)

        def forward(self, x):
            return torch.baddbmm(self.bias, x, self.w, beta=0.7, alpha=1.3).tanh().sum()

    torch.manual_seed(0)
    model = Loss().train()
    res = aotfuse.build(model, (torch.randn(4, 6, 16),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(4, 6, 16),), grad_rtol=1e-4, grad_atol=1e-5)
