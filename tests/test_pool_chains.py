"""Max pools as chains (lower/pool.py): a 5 x 5 window with padding (YOLO's SPPF, three pools in a row) builds in
seconds (the running (max, index) pair doubled its expression per tap: the build hung), and values and indices
match ATen's, NaN included (the last NaN of a window wins, ties go to the first maximum)."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class SPPF(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = nn.MaxPool2d(5, 1, 2)

    def forward(self, x):
        y1 = self.m(x)
        y2 = self.m(y1)
        return torch.cat([x, y1, y2, self.m(y2)], 1)


def test_sppf_builds_quickly_and_matches_eager():
    x = torch.randn(2, 8, 20, 20)
    t0 = time.perf_counter()
    res = aotfuse.build(SPPF(), (x,), targets=("sm_90",))
    assert time.perf_counter() - t0 < 60
    x2 = torch.randn(2, 8, 20, 20)
    torch.testing.assert_close(aotfuse.load(res.data, device="cpu")(x2), SPPF()(x2))


@pytest.mark.parametrize("k,s,p,d,ceil", [(3, 2, 1, 1, False), (5, 1, 2, 1, False), (3, 2, 1, 2, True),
                                          (2, 2, 0, 1, True), (4, 4, 0, 1, False), (7, 7, 0, 1, False)])
def test_values_and_indices_with_nan_and_ties(k, s, p, d, ceil):
    class Pool(nn.Module):
        def forward(self, x):
            return F.max_pool2d(x, k, s, p, d, ceil_mode=ceil, return_indices=True)

    x = torch.randn(2, 3, 14, 14)
    res = aotfuse.build(Pool(), (x,), targets=("sm_90",))
    x2 = torch.randn(2, 3, 14, 14)
    x2[0, 0, 2, 2:4] = float("nan")  # two NaNs in a window: the last one's index
    x2[1, 1, 5, 6] = x2[1, 1, 5, 5] = 9.0  # a tie: the first one's index
    got, want = aotfuse.load(res.data, device="cpu")(x2), Pool()(x2)
    torch.testing.assert_close(got[0], want[0], equal_nan=True)
    assert torch.equal(got[1], want[1])
