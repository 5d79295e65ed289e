"""Adaptive average pools over large windows in training (the joint trace routes them to aten._adaptive_avg_pool2d):
a window of more than lower/pool.POOL_TAPS_MAX taps is one reduction (taps past a shorter window masked), not an
expression of nested adds, which overflowed the expression walks' recursion from about 20 x 20 (EfficientNet's
squeeze-excitation pools); small windows keep the sum of taps. Training and inference against eager."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.testing.train_check import assert_training_matches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class SqueezeExcite(nn.Module):
    def __init__(self, c=4, out=1):
        super().__init__()
        self.w = nn.Parameter(torch.randn(c, 1, 1))
        self.out = out

    def forward(self, x):
        h = x * self.w
        s = nn.functional.adaptive_avg_pool2d(h, self.out)
        return (h * s.mean((2, 3), keepdim=True).sigmoid()).square().mean() + s.square().sum()


# (input H, W, output): a global pool over 32 x 32 and 56 x 56 (a RecursionError before), whole 15 x 15 windows,
# ATen's variable windows (31 x 29 -> 2 x 3: windows of 16 and 15 rows, 10 and 11 columns), small 2 x 2 windows
CASES = [(32, 32, 1), (56, 56, 1), (30, 30, 2), (31, 29, (2, 3)), (8, 8, 4)]


@pytest.mark.parametrize("h,w,out", CASES)
def test_adaptive_avg_pool_trains(h, w, out):
    torch.manual_seed(0)
    model = SqueezeExcite(out=out).train()
    res = aotfuse.build(model, (torch.randn(2, 4, h, w),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(2, 4, h, w),), grad_rtol=1e-4, grad_atol=1e-5)


@pytest.mark.parametrize("h,w,out", CASES[2:4])
def test_adaptive_avg_pool_inference(h, w, out):
    pool = nn.AdaptiveAvgPool2d(out)
    res = aotfuse.build(pool, (torch.randn(2, 3, h, w),), targets=("sm_90",))
    x = torch.randn(2, 3, h, w)
    torch.testing.assert_close(aotfuse.load(res.data, device="cpu")(x), pool(x), rtol=1e-5, atol=1e-6)


def test_a_too_deep_expression_is_a_build_error():
    """Whatever nests deeper than a build stage's recursive walks allow is a BuildError naming the stage, not a
    RecursionError."""
    from aotfuse.errors import BuildError
    from aotfuse.pipeline import _Stages

    def walk(n):
        return walk(n + 1)

    with pytest.raises(BuildError, match="stage inline: an expression of this model is nested too deeply"):
        _Stages(None).run("inline", walk, 0)


@pytest.mark.gpu
def test_global_pool_and_sort_gradients_on_cuda():
    """The pool's reduction kernel and sort's gradient scatter (torch's kernel, an extern) compiled and run by the
    runtime on this GPU: a training step against eager on CUDA."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.se = SqueezeExcite(c=8)
            self.lin = nn.Linear(64, 64)

        def forward(self, x, y):
            v = torch.sort(self.lin(y), -1)[0]
            return self.se(x) + (v * torch.linspace(-1, 1, 64, device=v.device)).mean()

    torch.manual_seed(0)
    model = Net().train()
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    res = aotfuse.build(model, (torch.randn(2, 8, 56, 56), torch.randn(4, 64)), train=True, targets=(arch,))
    assert_training_matches(res.data, model, (torch.randn(2, 8, 56, 56), torch.randn(4, 64)), loss_rtol=1e-4,
                            loss_atol=1e-5, grad_rtol=1e-3, grad_atol=1e-4, device="cuda")


class AvgPool(nn.Module):
    """nn.AvgPool2d with a large kernel after a learned scale. EfficientNet's head pools with a kernel of its channel
    count (1280 for B0, ceil_mode) over a map of a few pixels: nearly every tap of every window lies in padding."""

    def __init__(self, k, stride=None, pad=0, ceil=False, include_pad=True):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 1, 1))
        self.pool = nn.AvgPool2d(k, stride, pad, ceil_mode=ceil, count_include_pad=include_pad)

    def forward(self, x):
        return self.pool(x * self.w)


# (H, W, kernel, stride, padding, ceil_mode, count_include_pad): EfficientNet's head (a kernel of 64 over 2 x 2,
# ceil_mode), a global 32 x 32 window, 20 x 20 windows with stride 6 and padding (masked taps, excluded from the
# divisor), 3 x 3 windows (a sum of taps)
AVG_CASES = [(2, 2, 64, None, 0, True, True), (32, 32, 32, None, 0, False, True), (45, 41, 20, 6, 10, True, False),
             (9, 9, 3, 2, 1, False, True)]


@pytest.mark.parametrize("h,w,k,stride,pad,ceil,include_pad", AVG_CASES)
def test_avg_pool_large_windows(h, w, k, stride, pad, ceil, include_pad):
    """Inference and training against eager: only taps that land on the input are visited, and more than
    POOL_TAPS_MAX of them are one reduction (the kernel of 64 was 4096 nested adds: a RecursionError)."""
    torch.manual_seed(0)
    model = AvgPool(k, stride, pad, ceil, include_pad)
    res = aotfuse.build(model.eval(), (torch.randn(2, 4, h, w),), targets=("sm_90",))
    x = torch.randn(2, 4, h, w)
    torch.testing.assert_close(aotfuse.load(res.data, device="cpu")(x), model(x), rtol=1e-5, atol=1e-6)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m(x).square().mean()

    loss = Loss().train()
    res = aotfuse.build(loss, (torch.randn(2, 4, h, w),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, loss, (torch.randn(2, 4, h, w),), grad_rtol=1e-4, grad_atol=1e-5)
