"""GPU tier: NaN propagates as in eager through relu, clamp, torch.maximum / minimum (tl.maximum's default,
PropagateNan.NONE, returned the other operand on the GPU while the interpreter returned NaN) and through max pools
(values and indices, a 5 x 5 window with padding and a whole 4 x 4 window)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse

pytestmark = pytest.mark.gpu


def _arch():
    return "sm_%d%d" % torch.cuda.get_device_capability()


class Pointwise(nn.Module):
    def forward(self, x, y):
        return torch.relu(x) * 2, x.clamp(-1, 1) + 1, torch.maximum(x, y), torch.minimum(x, y), F.relu6(x)


class Pools(nn.Module):
    def forward(self, x):
        a, ia = F.max_pool2d(x, 5, 1, 2, return_indices=True)
        b, ib = F.max_pool2d(x, 4, 4, return_indices=True)
        return a, ia, b, ib, F.max_pool2d(x, 3, 2, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_nan_like_eager(dtype):
    x, y = torch.randn(4, 1000, dtype=dtype), torch.randn(4, 1000, dtype=dtype)
    x[0, ::7] = float("nan")
    y[1, ::5] = float("nan")
    res = aotfuse.build(Pointwise(), (x, y), targets=(_arch(),))
    got = aotfuse.load(res.data, device="cuda")(x.cuda(), y.cuda())
    for g, w in zip(got, Pointwise()(x.cuda(), y.cuda())):
        torch.testing.assert_close(g, w, equal_nan=True)


def test_max_pools_nan_like_eager():
    x = torch.randn(2, 4, 16, 16)
    x[0, 0, 3, 3] = float("nan")
    x[1, 2, 8:10, 8] = float("nan")
    res = aotfuse.build(Pools(), (x,), targets=(_arch(),))
    got = aotfuse.load(res.data, device="cuda")(x.cuda())
    want = Pools()(x.cuda())
    for g, w in zip(got, want):
        if g.dtype == torch.int64:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g, w, equal_nan=True)
