"""A weight used at every step of an unrolled loop: its gradient, a sum of one matmul product per use, becomes one
matmul over the concatenated inner dims (joint/product_sums.py) where that holds less memory than the products;
gradients match eager; the decision is in the partition record and in explain."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.runtime.explain import explain
from aotfuse.testing.train_check import assert_training_matches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Unrolled(nn.Module):
    """h_t = tanh(W h_{t-1} + x_t): W's gradient sums one product per step (K = batch rows each)."""

    def __init__(self, width=16, steps=6, transposed=False):
        super().__init__()
        self.w = nn.Linear(width, width)
        self.steps, self.transposed = steps, transposed

    def forward(self, x):
        h = torch.zeros_like(x[:, 0])
        for t in range(self.steps):
            z = h @ self.w.weight.t() if not self.transposed else (self.w.weight @ h.t()).t()
            h = torch.tanh(z + self.w.bias + x[:, t])
        return h.square().mean()


def _sums(res):
    return res.report.partition["product_sums"]


@pytest.mark.parametrize("transposed", [False, True], ids=["x@Wt", "(W@xt)t"])
def test_unrolled_weight_gradient_is_one_matmul(transposed):
    torch.manual_seed(0)
    model = Unrolled(transposed=transposed)
    res = aotfuse.build(model, (torch.randn(3, 6, 16),), train=True, targets=("sm_90",))
    merged = [s for s in _sums(res) if s["merged"]]
    assert merged and merged[0]["terms"] >= 5 and merged[0]["shape"] == [16, 16], _sums(res)
    assert "one matmul" in explain(res.data)
    assert_training_matches(res.data, model, (torch.randn(3, 6, 16),), grad_rtol=1e-4, grad_atol=1e-5)


def test_long_inner_dims_keep_the_chain():
    """Many rows per use (K = 64 > the products' M N / (M + N) = 8): the operands would outgrow the products."""
    torch.manual_seed(0)
    model = Unrolled(steps=4)
    x = torch.randn(64, 4, 16)
    res = aotfuse.build(model, (x,), train=True, targets=("sm_90",))
    sums = _sums(res)
    assert sums and not any(s["merged"] for s in sums), sums
    assert "the chain holds less" in sums[0]["why"]
    assert_training_matches(res.data, model, (torch.randn(64, 4, 16),), grad_rtol=1e-4, grad_atol=1e-5)


def test_bf16_sum_rounds_once():
    """Half precision: eager rounds every partial sum to bf16; the merged matmul accumulates in fp32 and rounds
    once, so it is at least as close to the fp32 gradient as eager is."""
    torch.manual_seed(0)
    model = Unrolled(width=32, steps=12).to(torch.bfloat16)
    x = torch.randn(2, 12, 32, dtype=torch.bfloat16)
    res = aotfuse.build(model, (x,), train=True, targets=("sm_90",))
    assert any(s["merged"] for s in _sums(res))
    mod = aotfuse.load(res.data, device="cpu").as_module()
    mod(x).backward()
    ref32 = Unrolled(width=32, steps=12)
    ref32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ref32(x.float()).backward()
    model.zero_grad()
    model(x).backward()
    ours = dict(mod.named_parameters())["w.weight"].grad.float()
    want, eager = ref32.w.weight.grad, model.w.weight.grad.float()
    rel = lambda a: float((a - want).norm() / want.norm())  # noqa: E731
    assert rel(ours) <= max(2 * rel(eager), 1e-2), (rel(ours), rel(eager))
