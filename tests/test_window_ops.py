"""Ops a probe found refused: Tensor.unfold (a view; its backward as shifted sums, no scatter), torch.cdist (the
direct p-norm form and ATen's gradient formulas), logcumsumexp (a scan combining by logaddexp) and nn.Bilinear
(aten._trilinear as one fused product-sum). Inference and training against eager on the CPU path, fp32."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.testing.train_check import assert_training_matches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _infer(model: nn.Module, make_inputs, rtol=1e-4, atol=1e-5):
    """Build on one draw of inputs, compare with eager on a fresh one."""
    res = aotfuse.build(model.eval(), make_inputs(), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    inputs = make_inputs()
    torch.testing.assert_close(art(*inputs), model(*inputs), rtol=rtol, atol=atol, equal_nan=True)


def _train(model: nn.Module, make_inputs):
    torch.manual_seed(0)
    res = aotfuse.build(model.train(), make_inputs(), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, make_inputs(), grad_rtol=1e-4, grad_atol=1e-5)


class Unfold(nn.Module):
    def __init__(self, dim, size, step, transpose=False):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.dim, self.size, self.step, self.transpose = dim, size, step, transpose

    def forward(self, x):
        h = self.proj(x)
        if self.transpose:
            h = h.transpose(1, 2)
        w = h.unfold(self.dim, self.size, self.step)
        return (w * torch.arange(w.shape[-1], dtype=w.dtype)).square().mean()


# (dim, size, step): overlapping windows, tiling windows, gaps between windows, one window, along the last dim
UNFOLDS = [(1, 4, 2), (1, 3, 3), (1, 2, 3), (1, 11, 1), (-1, 3, 1)]


@pytest.mark.parametrize("dim,size,step", UNFOLDS)
@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "transposed"])
def test_unfold_inference(dim, size, step, transpose):
    class M(nn.Module):
        def forward(self, x):
            h = x.transpose(1, 2) if transpose else x
            return h.unfold(dim, size, step) * 2.0

    shape = (2, 6, 11) if transpose else (2, 11, 6)  # the unfolded value is [2, 11, 6] either way
    _infer(M(), lambda: (torch.randn(shape),))


@pytest.mark.parametrize("dim,size,step", UNFOLDS[:4])
def test_unfold_trains(dim, size, step):
    _train(Unfold(dim, size, step), lambda: (torch.randn(2, 11, 6),))


def test_unfold_of_a_transposed_value_trains():
    _train(Unfold(2, 4, 3, transpose=True), lambda: (torch.randn(2, 11, 6),))


PS = [0.0, 0.5, 1.0, 2.0, 3.0, math.inf]


@pytest.mark.parametrize("p", PS)
def test_cdist_inference(p):
    class M(nn.Module):
        def forward(self, x, y):
            return torch.cdist(x, y, p=p)

    _infer(M(), lambda: (torch.randn(2, 5, 4), torch.randn(2, 7, 4)))


def test_cdist_with_zero_distances_and_many_rows():
    """Rows of x repeated in y (distance 0: a zero gradient, as ATen's); 30 x 40 rows take torch.cdist's matmul
    form, which is already primitives."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x, y):
            h = self.proj(x)
            return torch.cdist(h, torch.cat([h[:, :2], y], 1)).sin().sum()

    _train(M(), lambda: (torch.randn(2, 5, 4), torch.randn(2, 3, 4)))
    _train(M(), lambda: (torch.randn(2, 30, 4), torch.randn(2, 40, 4)))


@pytest.mark.parametrize("p", [0.5, 1.0, 2.0, 3.0, math.inf])
def test_cdist_trains(p):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, y):
            return torch.cdist(self.a(x), self.b(y), p=p).square().mean()

    _train(M(), lambda: (torch.randn(2, 5, 4), torch.randn(2, 6, 4)))


class LogCumSumExp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return torch.logcumsumexp(x, self.dim)


@pytest.mark.parametrize("shape,dim", [((3, 7), -1), ((4, 5, 6), 1), ((2, 3000), 1)], ids=["rows", "middle", "long"])
def test_logcumsumexp_inference(shape, dim):
    _infer(LogCumSumExp(dim), lambda: (torch.randn(shape) * 30,))


def test_logcumsumexp_keeps_early_terms_far_below_later_ones():
    """A running max rescale would underflow the first terms to -inf; logaddexp keeps them; -inf and NaN pass
    through as in eager."""
    x = torch.tensor([[-1000.0, 0.0, 5.0, -2000.0], [float("-inf"), float("-inf"), 1.0, 2.0],
                      [1.0, float("nan"), 2.0, 3.0], [float("inf"), 1.0, float("-inf"), 0.0]])
    _infer(LogCumSumExp(1), lambda: (x.clone(),))


def test_logcumsumexp_half_inputs():
    _infer(LogCumSumExp(1), lambda: (torch.randn(4, 50).to(torch.bfloat16) * 10,), rtol=1.6e-2, atol=1e-2)


def test_logcumsumexp_trains():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(6, 6)

        def forward(self, x):
            return torch.logcumsumexp(self.proj(x) * 3, 1).sin().sum()

    _train(M(), lambda: (torch.randn(2, 9, 6),))


class Bilinear(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.b = nn.Bilinear(4, 5, 3, bias=bias)

    def forward(self, x, y):
        return self.b(x, y)


@pytest.mark.parametrize("bias", [True, False])
def test_bilinear_inference(bias):
    _infer(Bilinear(bias), lambda: (torch.randn(2, 6, 4), torch.randn(2, 6, 5)))


def test_bilinear_trains():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.b = nn.Bilinear(4, 5, 3)

        def forward(self, x, y):
            return self.b(self.proj(x).tanh(), y).square().mean()

    _train(M(), lambda: (torch.randn(6, 4), torch.randn(6, 5)))
