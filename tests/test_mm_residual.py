"""Residual adds fused into the cuBLAS matmul feeding them (lower/residual.py, runtime/mm_residual.py): which
adds fuse and why not, and the numbers against eager on the CPU path (the extern's reference implementation),
inference and training (forward and gradients), fp32 and bf16."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.knobs import override
from aotfuse.runtime.explain import explain_report

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Block(nn.Module):
    """A pre-LayerNorm transformer block's residual structure: attention-output and MLP projections added
    to the residual stream."""

    def __init__(self, d=32, bias=True):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.out = nn.Linear(d, d, bias=bias)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d, bias=bias)

    def forward(self, x):
        x = x + self.out(self.ln1(x))
        x = self.proj(torch.relu(self.fc(self.ln2(x)))) + x  # the matmul as the add's first operand
        return self.ln2(x)


def _residual_lines(report) -> list[str]:
    return [ln for ln in explain_report(report).splitlines() if "residual add" in ln]


@pytest.mark.parametrize("bias", [True, False])
def test_block_residuals_fuse_and_match_eager(bias):
    torch.manual_seed(0)
    model = Block(bias=bias)
    x = torch.randn(2, 8, 32)
    res = aotfuse.build(model, (x,), targets=("sm_90",))
    lines = _residual_lines(res.report)
    assert len(lines) == 2 and all("fused into the matmul" in ln for ln in lines), lines
    assert ("the bias in its epilogue" in lines[0]) == bias
    x2 = torch.randn(2, 8, 32) * 3 + 1
    got = aotfuse.load(res.data, device="cpu")(x2)
    torch.testing.assert_close(got, model(x2), rtol=1e-5, atol=1e-5)


def test_knob_off_and_template_mode_keep_the_add_outside():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 8, 32)
    for knob, why in (({"mm_residual": False}, "AOTFUSE_MM_RESIDUAL=0"),
                      ({"mm": "template"}, "a matmul template adds the residual in its own epilogue")):
        with override(**knob):
            res = aotfuse.build(model, (x,), targets=("sm_90",))
        lines = _residual_lines(res.report)
        assert len(lines) == 2 and all("not fused" in ln and why in ln for ln in lines), lines
        got = aotfuse.load(res.data, device="cpu")(x)
        torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)


def test_auto_mode_asks_the_cost_model():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 8, 32)
    with override(mm="auto"):
        res = aotfuse.build(model, (x,), targets=("sm_90",))
    lines = _residual_lines(res.report)
    assert len(lines) == 2, lines
    for ln in lines:  # either side, with both estimates named
        assert ("cuBLASLt" in ln and "template" in ln and "both fuse the bias and the residual" in ln), ln
    torch.testing.assert_close(aotfuse.load(res.data, device="cpu")(x), model(x), rtol=1e-5, atol=1e-5)


class Refused(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.a, self.b, self.c, self.e = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, row):
        h = self.a(x)
        y1 = h + x  # the product is also read below: written anyway
        y2 = self.b(x) + row  # the residual broadcasts over the rows
        y3 = self.c(x) + y1.t().contiguous().t()  # a residual that is not row-major
        y4 = torch.add(self.e(x), x, alpha=2.0)  # alpha 2
        y5 = self.b(row[None])[:, :, None] + x[:, :, None]  # the product [1, 16, 1] broadcasts to [8, 16, 1]
        return y1 + y2 + y3 + y4 + h + y5.squeeze(-1)


def test_refusals_say_why_and_match_eager():
    torch.manual_seed(0)
    model = Refused()
    x, row = torch.randn(8, 16), torch.randn(16)
    res = aotfuse.build(model, (x, row), targets=("sm_90",))
    text = "\n".join(_residual_lines(res.report))
    for why in ("also read by", "broadcasts to the sum", "alpha other than 1", "the product [1, 16, 1] broadcasts"):
        assert why in text, text
    got = aotfuse.load(res.data, device="cpu")(x, row)
    torch.testing.assert_close(got, model(x, row), rtol=1e-5, atol=1e-5)


def test_the_residual_computed_after_the_matmul_is_refused():
    class Late(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            r = x.exp()  # traced after the matmul
            return h + r

    model, x = Late(), torch.randn(4, 8)
    res = aotfuse.build(model, (x,), targets=("sm_90",))
    lines = _residual_lines(res.report)
    assert len(lines) == 1 and "computed after the matmul" in lines[0], lines
    torch.testing.assert_close(aotfuse.load(res.data, device="cpu")(x), model(x), rtol=1e-5, atol=1e-5)


def test_training_gradients_match_eager():
    torch.manual_seed(0)
    model = Block()

    class Loss(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x).square().mean()

    wrapped = Loss(model)
    x = torch.randn(2, 8, 32, requires_grad=True)
    res = aotfuse.build(wrapped, (x,), train=True, targets=("sm_90",))
    assert sum("fused into the matmul" in ln for ln in _residual_lines(res.report)) >= 2
    mod = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(wrapped)
    x2 = torch.randn(2, 8, 32) * 2 + 0.5
    xa, xb = x2.clone().requires_grad_(), x2.clone().requires_grad_()
    loss, want = mod(xa), ref(xb)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-6)
    grads = dict(mod.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_bf16_within_one_rounding_of_eager():
    torch.manual_seed(0)
    model = Block(d=64).to(torch.bfloat16)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    res = aotfuse.build(model, (x,), targets=("sm_90",))
    assert sum("fused into the matmul" in ln for ln in _residual_lines(res.report)) == 2
    got = aotfuse.load(res.data, device="cpu")(x).double()
    want64 = copy.deepcopy(model).double()(x.double())
    eager = model(x).double()
    err, eager_err = float((got - want64).norm() / want64.norm()), float((eager - want64).norm() / want64.norm())
    assert err <= max(2 * eager_err, 1e-2), (err, eager_err)


def test_dynamic_rows_fuse_and_match_eager_at_many_shapes():
    torch.manual_seed(0)
    model = Block()
    res = aotfuse.build(model, (torch.randn(2, 8, 32),), targets=("sm_90",), dynamic_shapes=["x.0=1..8", "x.1=1..64"])
    assert sum("fused into the matmul" in ln for ln in _residual_lines(res.report)) == 2
    art = aotfuse.load(res.data, device="cpu")
    for b, t in ((1, 1), (3, 17), (8, 64)):
        x = torch.randn(b, t, 32) * 2 - 1
        torch.testing.assert_close(art(x), model(x), rtol=1e-5, atol=1e-5)
