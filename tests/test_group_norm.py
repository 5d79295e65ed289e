"""GroupNorm (aten.native_group_norm and its backward) and InstanceNorm (aten.repeat of its affine parameters, a
batch norm without running statistics over x viewed as [1, N * C, *spatial]): outputs and every gradient (input,
weight, bias) against eager on the CPU path, on fresh random inputs; fp32 and bf16, channels-last inputs, odd sizes,
groups of one channel and one group, means far from zero (checked against float64, where bf16 eager itself is off),
running statistics, dynamic dims; and a norm's mean and variance computed as one Welford pass."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.runtime.explain import explain_report

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")]
TARGETS = ("sm_90",)
CL = torch.channels_last
# relative-norm error allowed against the reference, by dtype
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _randomize(norm: nn.Module) -> nn.Module:
    """Affine parameters away from the identity defaults (weight about 1, bias about 0, both random)."""
    with torch.no_grad():
        for name, p in norm.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.5 + (1.0 if name == "weight" else 0.0))
    return norm


class NormLoss(nn.Module):
    """silu(norm(x)) against a fixed random probe: a scalar loss whose gradient reaching the norm varies per element."""

    def __init__(self, norm: nn.Module, shape):
        super().__init__()
        self.norm = norm
        self.register_buffer("probe", torch.randn(shape[1:]))

    def forward(self, x):
        return (F.silu(self.norm(x)) * self.probe).sum()


def _input(shape, dtype, channels_last=False, mean=0.0, sd=1.0) -> torch.Tensor:
    x = (torch.randn(shape) * sd + mean).to(dtype)
    return x.contiguous(memory_format=CL) if channels_last else x


def _grads(model: nn.Module, x: torch.Tensor):
    """(loss, x.grad, {parameter: grad}) of one forward and backward of `model` at x (the gradients of this
    step alone: earlier ones are cleared)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    loss = model(x)
    loss.backward()
    return loss.detach(), x.grad, {k: p.grad for k, p in model.named_parameters()}


def _train_module(model: nn.Module, example: torch.Tensor, **build) -> nn.Module:
    """The training archive of (a copy of) `model`, built at `example`, as a module."""
    res = aotfuse.build(copy.deepcopy(model), (example.detach().clone().requires_grad_(),), train=True,
                        targets=TARGETS, **build)
    return aotfuse.load(res.data, device="cpu").as_module()


def _check(got, want, tol: float, what: str):
    (gl, gx, gp), (wl, wx, wp) = got, want
    assert gx.shape == wx.shape and gx.dtype == wx.dtype, what
    assert rel(gl, wl) <= tol, (what, "loss", rel(gl, wl))
    assert rel(gx, wx) <= tol, (what, "x.grad", rel(gx, wx))
    assert set(gp) == set(wp), what
    for k in wp:
        assert gp[k] is not None and gp[k].dtype == wp[k].dtype, (what, k)
        assert rel(gp[k], wp[k]) <= tol, (what, k, rel(gp[k], wp[k]))


GN_CASES = {  # name: (norm, input shape, channels-last)
    "gn": (lambda: nn.GroupNorm(4, 16), (2, 16, 12, 12), False),
    "gn_odd": (lambda: nn.GroupNorm(6, 30), (3, 30, 7, 9), False),  # 6 groups of 5 channels, 7 x 9
    "gn_no_affine": (lambda: nn.GroupNorm(3, 12, affine=False), (2, 12, 5, 7), False),
    "gn_groups_eq_channels": (lambda: nn.GroupNorm(10, 10), (2, 10, 6, 5), False),
    "gn_one_group": (lambda: nn.GroupNorm(1, 10), (2, 10, 6, 5), False),
    "gn_channels_last": (lambda: nn.GroupNorm(6, 30), (2, 30, 7, 9), True),
    "gn_1d_input": (lambda: nn.GroupNorm(3, 12), (5, 12), False),
    "gn_3d_input": (lambda: nn.GroupNorm(2, 6), (2, 6, 3, 4, 5), False),
    "in_affine": (lambda: nn.InstanceNorm2d(6, affine=True), (3, 6, 7, 9), False),
    "in_plain": (lambda: nn.InstanceNorm2d(6), (3, 6, 7, 9), False),
    "in_channels_last": (lambda: nn.InstanceNorm2d(6, affine=True), (2, 6, 7, 9), True),
    "in_1d": (lambda: nn.InstanceNorm1d(6, affine=True), (3, 6, 11), False),
}


def _fresh(shape, dtype, cl, example, **kw) -> torch.Tensor:
    x = _input(shape, dtype, cl, **kw)
    assert not torch.equal(x, example), "fresh inputs equal the example"
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(GN_CASES))
def test_training_matches_eager(name, dtype):
    make, shape, cl = GN_CASES[name]
    torch.manual_seed(0)
    model = NormLoss(_randomize(make()), shape).to(dtype)
    example = _input(shape, dtype, cl)
    mod = _train_module(model, example)
    x = _fresh(shape, dtype, cl, example)
    _check(_grads(mod, x), _grads(copy.deepcopy(model), x), TOL[dtype], f"{name} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["gn", "gn_odd", "gn_no_affine", "gn_channels_last", "in_affine", "in_plain",
                                  "in_channels_last"])
def test_inference_matches_eager(name, dtype):
    make, shape, cl = GN_CASES[name]
    torch.manual_seed(3)
    norm = _randomize(make()).to(dtype).eval()
    example = _input(shape, dtype, cl)
    art = aotfuse.load(aotfuse.build(norm, (example,), targets=TARGETS).data, device="cpu")
    x = _fresh(shape, dtype, cl, example)
    got = art(x)
    with torch.no_grad():
        want = norm(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel(got, want) <= TOL[dtype], rel(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["gn_odd", "gn_channels_last", "in_affine"])
def test_means_far_from_zero_against_float64(name, dtype):
    """x * 3 + 100: the statistics are the mean, then the mean of squared deviations about it, in fp32 (no
    sum of squares to cancel), and the backward reads them in fp32. The reference is float64 on the same
    values: bf16 eager rounds its saved mean to bf16 (steps of 0.5 at 100), which puts its own gradients
    several percent off here."""
    make, shape, cl = GN_CASES[name]
    torch.manual_seed(4)
    model = NormLoss(_randomize(make()), shape).to(dtype)
    example = _input(shape, dtype, cl, mean=100.0, sd=3.0)
    mod = _train_module(model, example)
    x = _fresh(shape, dtype, cl, example, mean=100.0, sd=3.0)
    got = _grads(mod, x)
    want = _grads(copy.deepcopy(model).double(), x.double())
    want = (want[0].to(dtype), want[1].to(dtype), {k: g.to(dtype) for k, g in want[2].items()})
    _check(got, want, TOL[dtype], f"{name} {dtype} mean 100")


@pytest.mark.parametrize("affine,mask", [(True, [True, True, True]), (True, [False, True, False]),
                                         (False, [True, False, False])])
def test_decompositions_match_aten(affine, mask):
    """native_group_norm (export/decomp.py) and native_group_norm_backward (joint/decomp_train.py) against
    aten's kernels, float64, on [3, 12, 5, 7] in 4 groups: outputs, statistics, and each masked gradient."""
    from aotfuse.export.decomp import decomposition_table
    from aotfuse.joint.decomp_train import training_decompositions

    aten = torch.ops.aten
    torch.manual_seed(10)
    x, go = torch.randn(3, 12, 5, 7, dtype=torch.float64) * 2 + 5, torch.randn(3, 12, 5, 7, dtype=torch.float64)
    w, b = (torch.randn(12, dtype=torch.float64), torch.randn(12, dtype=torch.float64)) if affine else (None, None)
    fwd = decomposition_table()[aten.native_group_norm.default](x, w, b, 3, 12, 35, 4, 1e-5)
    want = aten.native_group_norm(x, w, b, 3, 12, 35, 4, 1e-5)
    for got_t, want_t in zip(fwd, want):
        torch.testing.assert_close(got_t, want_t, rtol=1e-10, atol=1e-10)
    bwd = training_decompositions()[aten.native_group_norm_backward.default]
    got = bwd(go, x, want[1], want[2], w, 3, 12, 35, 4, mask)
    ref = aten.native_group_norm_backward(go, x, want[1], want[2], w, 3, 12, 35, 4, mask)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert (g is None) == (r is None), (i, mask)
        if r is not None:
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_half_statistics_are_fp32():
    """A bf16 group norm computes in fp32 and returns its statistics in fp32 (the backward reads them
    unrounded); the output is bf16."""
    from aotfuse.export.decomp import decomposition_table

    x = (torch.randn(2, 6, 4, 4) * 3 + 100).to(torch.bfloat16)
    out, mean, rstd = decomposition_table()[torch.ops.aten.native_group_norm.default](x, None, None, 2, 6, 16, 3, 1e-5)
    assert out.dtype == torch.bfloat16 and mean.dtype == rstd.dtype == torch.float32
    rows = x.double().reshape(2, 3, -1)
    torch.testing.assert_close(mean.double(), rows.mean(-1), rtol=1e-7, atol=0)
    torch.testing.assert_close(rstd.double(), (rows.var(-1, unbiased=False) + 1e-5).rsqrt(), rtol=1e-5, atol=0)


def test_instance_norm_running_statistics_train_and_eval():
    """track_running_stats=True: in training, batch statistics and the running buffers updated as eager
    updates them (instance_norm averages the per-sample statistics over the batch); in eval mode, the running
    statistics (repeated per sample) normalize."""
    shape = (3, 6, 7, 9)
    torch.manual_seed(5)
    model = NormLoss(_randomize(nn.InstanceNorm2d(6, affine=True, track_running_stats=True, momentum=0.3)), shape)
    with torch.no_grad():
        model.norm.running_mean.copy_(torch.randn(6))
        model.norm.running_var.copy_(torch.rand(6) + 0.5)
    example = _input(shape, torch.float32, mean=2.0)
    mod = _train_module(model, example)
    ref = copy.deepcopy(model)
    for step in range(2):
        x = _fresh(shape, torch.float32, False, example, mean=2.0)
        _check(_grads(mod, x), _grads(ref, x), 1e-4, f"step {step}")
        got, want = dict(mod.named_buffers()), dict(ref.named_buffers())
        for k in ("norm.running_mean", "norm.running_var"):
            assert rel(got[k], want[k]) <= 1e-5, (step, k, got[k], want[k])

    norm = copy.deepcopy(ref.norm).eval()
    art = aotfuse.load(aotfuse.build(norm, (example,), targets=TARGETS).data, device="cpu")
    x = _fresh(shape, torch.float32, False, example, mean=2.0)
    with torch.no_grad():
        assert rel(art(x), norm(x)) <= 1e-5


def test_batch_norm_without_running_statistics_in_eval_mode():
    """BatchNorm2d(track_running_stats=False) normalizes with the batch's statistics in eval mode too
    (_native_batch_norm_legit.no_stats, the op InstanceNorm lowers to)."""
    torch.manual_seed(6)
    norm = _randomize(nn.BatchNorm2d(5, track_running_stats=False)).eval()
    example = _input((4, 5, 6, 7), torch.float32, mean=-20.0, sd=2.0)
    art = aotfuse.load(aotfuse.build(norm, (example,), targets=TARGETS).data, device="cpu")
    x = _fresh((4, 5, 6, 7), torch.float32, False, example, mean=-20.0, sd=2.0)
    with torch.no_grad():
        assert rel(art(x), norm(x)) <= 1e-5


@pytest.mark.parametrize("cl", [False, True], ids=["contiguous", "channels_last"])
def test_group_statistics_are_one_welford_pass(cl):
    """Each (sample, group) row's mean and variance are one reduction kernel's Welford pair, the
    normalized output fused into the same kernel; in training, the backward's row means share one kernel too."""
    shape = (2, 32, 24, 24)
    torch.manual_seed(7)
    norm = _randomize(nn.GroupNorm(4, 32)).eval()
    res = aotfuse.build(norm, (_input(shape, torch.float32, cl),), targets=TARGETS)
    text = explain_report(res.report)
    assert "Welford (mean and variance)" in text, text
    assert len(res.report.groups) == 1, res.report.groups
    res = aotfuse.build(NormLoss(norm, shape), (_input(shape, torch.float32, cl).requires_grad_(),), train=True,
                        targets=TARGETS)
    assert "Welford (mean and variance)" in explain_report(res.report)


def test_dynamic_batch_and_height():
    """One archive for many shapes: the group rows' length is an expression of the dims."""
    torch.manual_seed(8)
    for norm in (nn.GroupNorm(3, 12), nn.InstanceNorm2d(12, affine=True)):
        model = NormLoss(_randomize(norm), (3, 12, 5, 7))
        model.probe = torch.randn(1, 1, 7)  # broadcast over the dynamic height
        example = _input((3, 12, 5, 7), torch.float32)
        mod = _train_module(model, example, dynamic_shapes=["x.0=1..8", "x.2=2..16"])
        for b, h in [(1, 2), (8, 16), (3, 5), (5, 11)]:
            x = _input((b, 12, h, 7), torch.float32, mean=10.0, sd=3.0)
            _check(_grads(mod, x), _grads(copy.deepcopy(model), x), 1e-4, f"{type(norm).__name__} {b} x {h}")


class RepeatLoss(nn.Module):
    """repeat of a parameter (its gradient: the sum over the tiles) and of an input, with new leading dims."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 5))

    def forward(self, x):
        tiled = self.w.repeat(2, 1, 3)  # [2, 3, 15]
        return ((x.repeat(1, 1, 3) * tiled).square() + x.transpose(1, 2).repeat(2, 1, 1).sum() * tiled).mean()


def test_repeat_gradient_and_dynamic_repeat():
    torch.manual_seed(9)
    model = RepeatLoss()
    example = torch.randn(2, 3, 5)
    mod = _train_module(model, example)
    x = _fresh((2, 3, 5), torch.float32, False, example)
    _check(_grads(mod, x), _grads(copy.deepcopy(model), x), 1e-4, "repeat")

    class Tile(nn.Module):
        def forward(self, x):
            return x.repeat(2, 1, 3) * 2 + x.repeat(1, 2, 1).sum()

    res = aotfuse.build(Tile(), (torch.randn(3, 4),), targets=TARGETS, dynamic_shapes=["x.0=1..9"])
    art = aotfuse.load(res.data, device="cpu")
    for rows in (1, 9, 4):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(art(x), Tile()(x), rtol=1e-5, atol=1e-5)
