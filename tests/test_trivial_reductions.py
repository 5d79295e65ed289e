"""A reduction that reads no reduced index (schedule/trivial.py) becomes a pointwise node: n * v for a
sum, v for max/min/any; the report says so, and results match eager (forward and gradients)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import aotfuse
from aotfuse.ir.loop import Const, Load, LoopGraph, Buffer, Pointwise, Reduction
from aotfuse.ir.indexing import syms
from aotfuse.schedule.trivial import pointwise_of, trivial_reductions

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
    g2, dec = trivial_reductions(g)
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


class _Pick(torch.nn.Module):
    """sum_r where(r == t, f(x), 0), as nll_loss's one-hot pick, with an ignored (-100) and an
    out-of-range target: at most one term, or none."""

    def forward(self, x, t):
        onehot = torch.arange(x.shape[1])[None, :] == t[:, None]
        return torch.where(onehot, torch.exp(x) * 2.0, 0.0).sum(1)


def test_onehot_pick_is_one_indirect_load_and_matches_eager():
    x = torch.randn(6, 50)
    t = torch.tensor([0, 49, 7, -100, 50, 3])
    res = aotfuse.build(_Pick(), (x, t), targets=("sm_90",))
    dec = [d for d in _lowering(res.report) if "onehot" in d]
    assert dec == [{"onehot": dec[0]["onehot"], "n": 50}]
    assert all(g.kind != "reduction" for g in res.report.groups)  # no row loop left
    art = aotfuse.load(res.data, device="cpu")
    for seed in (1, 2):
        xs = torch.randn(6, 50, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(art(xs, t), _Pick()(xs, t), rtol=1e-6, atol=0)


def test_cross_entropy_target_pick_and_int32_compare():
    """The fused cross-entropy step: the target logit is a gather, the gradient's one-hot compares int32,
    and loss and gradient match eager with ignored targets."""
    L = torch.randn(16, 300, requires_grad=True)
    t = torch.randint(0, 300, (16,))
    t[3] = -100

    class CE(torch.nn.Module):
        def forward(self, logits, target):
            return torch.nn.functional.cross_entropy(logits.float(), target)

    res = aotfuse.build(CE(), (L, t), train=True, targets=("sm_90",), step="auto")
    assert any("onehot" in d for d in _lowering(res.report))
    art = aotfuse.load(res.data, device="cpu")
    from aotfuse.runtime.payload import read_sources
    src = "\n".join(read_sources(art.archive, art.kernels).values())
    assert ".to(tl.int32) ==" in src or ".to(tl.int32)) ==" in src
    pm = art.as_module()
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(16, 300, generator=g).requires_grad_()
        b = a.detach().clone().requires_grad_()
        tt = torch.randint(0, 300, (16,), generator=g)
        tt[5] = -100
        la, lb = pm(a, tt), CE()(b, tt)
        la.backward()
        lb.backward()
        torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


class _Mask(torch.nn.Module):
    """`position == target` inside a row reduction (not a one-hot: the other branch is not 0):
    compared in int32, the target narrowed per row."""

    def forward(self, x, t):
        return torch.where(torch.arange(x.shape[1])[None, :] == t[:, None], x, -x).sum(1)


def test_index_compare_in_int32_never_matches_a_value_outside_the_index_range():
    x = torch.randn(5, 40)
    # 2**32 + 3 would equal position 3 if it were truncated to int32; -1 and 40 are outside [0, 39]
    t = torch.tensor([0, 39, 2**32 + 3, -1, 40])
    res = aotfuse.build(_Mask(), (x, t), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    from aotfuse.runtime.payload import read_sources
    src = "\n".join(read_sources(art.archive, art.kernels).values())
    assert "<= 39), " in src and ".to(tl.int32)" in src  # the narrowed target
    for seed in (1, 2):
        xs = torch.randn(5, 40, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(art(xs, t), _Mask()(xs, t), rtol=1e-5, atol=1e-5)


class _PickPositional(torch.nn.Module):
    """The picked value depends on its position through a producer (a positional mask): not rewritten
    into a pick (r would stay unbound), still correct."""

    def forward(self, x, t):
        pos = torch.arange(x.shape[1])[None, :]
        v = torch.where(pos < 20, x, x * 3.0)  # a producer whose body reads the position, kept as a node
        return torch.where(pos == t[:, None], v, 0.0).sum(1), v.amax(1)  # (two point readers)


def test_onehot_with_a_positional_producer_matches_eager():
    x = torch.randn(4, 30)
    t = torch.tensor([0, 25, 19, 29])
    res = aotfuse.build(_PickPositional(), (x, t), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    for seed in (1, 2):
        xs = torch.randn(4, 30, generator=torch.Generator().manual_seed(seed))
        for got, want in zip(art(xs, t), _PickPositional()(xs, t)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_duplicate_reductions_read_the_first_one():
    """A reduction equal to an earlier one (body, loops, type, accumulator, buffer dims and dtype) becomes a
    pointwise read of its buffer, whatever size-1 dims either buffer has; a different body, type or buffer
    dtype keeps its own reduction."""
    p0, = syms("p", 1)
    r0, = syms("r", 1)
    a = Reduction("a1", (4,), (3,), Load("x", p0 + 4 * r0, "float32"), "sum", "float32")
    dup = dataclasses.replace(a, name="a2")
    other_body = Reduction("a3", (4,), (3,), Load("x", p0 + 4 * r0 + 0 * p0 + 1, "float32"), "sum", "float32")
    other_type = dataclasses.replace(a, name="a4", rtype="max")
    half = dataclasses.replace(a, name="a5")
    bufs = (Buffer("x", (16,), "float32", "input"), Buffer("a1", (1, 4, 1), "float32", "node"),
            Buffer("a2", (4,), "float32", "node"), Buffer("a3", (4,), "float32", "node"),
            Buffer("a4", (4,), "float32", "node"), Buffer("a5", (4,), "bfloat16", "node"))
    g = LoopGraph(buffers=bufs, nodes=(a, dup, other_body, other_type, half), inputs=("x",), weights=(), outputs=())
    g2, dec = trivial_reductions(g)
    assert dec == ({"duplicate": "a2", "of": "a1"},)
    copy = g2.nodes[1]
    assert isinstance(copy, Pointwise) and copy.name == "a2" and copy.ranges == (4,)
    assert copy.body == Load("a1", p0, "float32")
    assert g2.nodes[0] is a and all(isinstance(n, Reduction) for n in g2.nodes[2:])


class _BNTwice(torch.nn.Module):
    """A channels-last conv + BatchNorm (train) whose backward sums dy and dy * x_hat for the input gradient
    and again for the weight and bias gradients."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))).square().mean()


def test_batchnorm_backward_sums_once_and_matches_eager():
    import copy as _copy

    torch.manual_seed(3)
    cl = torch.channels_last
    model = _BNTwice().to(memory_format=cl).train()
    torch.nn.init.normal_(model.bn.weight)
    x = torch.randn(2, 3, 10, 10).contiguous(memory_format=cl)
    res = aotfuse.build(model, (x,), train=True, targets=("sm_90",))
    dups = [d for d in _lowering(res.report) if "duplicate" in d]
    assert len(dups) == 2, _lowering(res.report)
    mod = aotfuse.load(res.data, device="cpu").as_module()
    ref = _copy.deepcopy(model)
    x2 = torch.randn(2, 3, 10, 10).contiguous(memory_format=cl)
    loss, want = mod(x2), ref(x2)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    ours = dict(mod.named_parameters())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(ours[n].grad, p.grad, rtol=1e-4, atol=1e-5)
