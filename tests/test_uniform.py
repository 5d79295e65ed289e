"""A reduction that reads no reduced index (schedule/uniform.py) becomes a pointwise node: n * v for a
sum, v for max/min/any; the report says so, and results match eager (forward and gradients)."""
from __future__ import annotations

import pytest
import torch

import aotfuse
from aotfuse.ir.loop import Const, Load, LoopGraph, Buffer, Pointwise, Reduction
from aotfuse.ir.indexing import syms
from aotfuse.schedule.uniform import pointwise_of, uniform_reductions

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _red(body_index, rtype="sum", ranges=(4,), rranges=(3,)):
    return Reduction("red", ranges, rranges, Load("a", body_index, "float32"), rtype, "float32")


def test_pass_rewrites_only_reductions_that_read_no_reduced_index():
    p0, = syms("p", 1)
    r0, = syms("r", 1)
    uni = _red(p0)
    moving = _red(p0 + 4 * r0)
    assert pointwise_of(moving, (4,)) is None
    pw = pointwise_of(uni, (4, 1))  # keepdim: the buffer has a size-1 dim more than the ranges
    assert isinstance(pw, Pointwise) and pw.ranges == (4, 1)
    assert pw.body.op == "mul" and pw.body.args[1] == Const(3.0, "float32")
    assert pointwise_of(_red(p0, "max"), (4,)).body == Load("a", p0, "float32")
    assert pointwise_of(_red(p0, "prod"), (4,)) is None  # v ** n: not rewritten
    assert pointwise_of(_red(p0, "argmax"), (4,)) is None
    assert pointwise_of(_red(p0, rranges=(0,)), (4,)) is None  # an empty sum is 0, not 0 * v
    g = LoopGraph(buffers=(Buffer("a", (4,), "float32", "input"), Buffer("red", (4,), "float32", "node")),
                  nodes=(uni, moving), inputs=("a",), weights=(), outputs=())
    g2, dec = uniform_reductions(g)
    assert isinstance(g2.nodes[0], Pointwise) and g2.nodes[1] is moving
    assert dec == ({"uniform": "red", "rtype": "sum", "n": 3},)


def _lowering(rep):
    return list(rep.lowering) + (list(rep.backward.lowering) if rep.backward is not None else [])


class _Broadcasts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(7))

    def forward(self, x):
        e = (self.w * 1.5).expand(5, 7)  # rows of equal values
        return (e.sum(0) + e.amax(0, keepdim=True)[0] + x.sum(1)[:1].expand(7),
                e.sum(0, keepdim=True) * x[:1, :7])


def test_broadcast_sums_match_eager_and_are_reported():
    torch.manual_seed(0)
    m = _Broadcasts()
    x = torch.randn(3, 9)
    res = aotfuse.build(m, (x,), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    uniform = [d for d in _lowering(res.report) if "uniform" in d]
    assert {d["rtype"] for d in uniform} >= {"sum", "max"} and all(d["n"] == 5 for d in uniform)
    for seed in (1, 2):
        xs = torch.randn(3, 9, generator=torch.Generator().manual_seed(seed))
        for got, want in zip(art(xs), m(xs)):
            torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)


def test_layernorm_loss_bias_gradient_of_a_broadcast_tangent():
    """(layer_norm(x, w, b) * g).sum(): db = sum over rows of g, a pointwise 64 * g; grads match eager."""
    class LNLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(32)
            self.register_buffer("g", torch.randn(32))

        def forward(self, x):
            return (self.ln(x) * self.g).sum()

    torch.manual_seed(1)
    m = LNLoss()
    with torch.no_grad():
        m.ln.weight.normal_()
        m.ln.bias.normal_()
    x = torch.randn(64, 32, requires_grad=True)
    res = aotfuse.build(m, (x,), train=True, targets=("sm_90",))
    assert any("uniform" in d for d in _lowering(res.report))
    pm = aotfuse.load(res.data, device="cpu").as_module()
    xs = torch.randn(64, 32, requires_grad=True)
    x2 = xs.detach().clone().requires_grad_()
    pm(xs).backward()
    m(x2).backward()
    torch.testing.assert_close(xs.grad, x2.grad, rtol=1e-4, atol=1e-5)
    got = dict(pm.named_parameters())
    torch.testing.assert_close(got["ln.bias"].grad, m.ln.bias.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["ln.weight"].grad, m.ln.weight.grad, rtol=1e-4, atol=1e-5)
