"""A computed value that nothing reads is not lowered (lower/graph._drop_unread): a pool's gradient reads only
its input's shape, and the partition recomputing that input in the backward left a kernel that stored nothing,
which the archive's validation refused at load (`no output argument`). Built, loaded and checked against eager
autograd, with the dropped value named in the report."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.runtime.explain import explain_report
from aotfuse.testing.train_check import assert_training_matches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

POOLS = {
    "avg_pool2d": lambda v: F.avg_pool2d(v, 2),
    "avg_pool2d_ceil_pad": lambda v: F.avg_pool2d(v, 3, 2, padding=1, ceil_mode=True),
    "max_pool2d": lambda v: F.max_pool2d(v, 2),
    "adaptive_avg_pool2d": lambda v: F.adaptive_avg_pool2d(v, (5, 7)),
}


class Scaled(nn.Module):
    """A LayerScale-style product feeding a pool: cheap to recompute in the backward."""

    def __init__(self, pool):
        super().__init__()
        self.pre = nn.Parameter(torch.rand(3, 16, 16) + 0.5)
        self.pool = pool

    def forward(self, x):
        return self.pool(x * self.pre).square().sum()


@pytest.mark.parametrize("name", sorted(POOLS))
def test_pool_of_a_recomputed_product_trains(name):
    torch.manual_seed(0)
    model = Scaled(POOLS[name]).train()
    res = aotfuse.build(model, (torch.randn(2, 3, 16, 16),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(2, 3, 16, 16) * 2 + 0.5,), grad_rtol=1e-4, grad_atol=1e-5)


def test_the_dropped_value_is_named_in_the_report():
    torch.manual_seed(0)
    res = aotfuse.build(Scaled(POOLS["avg_pool2d"]).train(), (torch.randn(2, 3, 16, 16),), train=True,
                        targets=("sm_90",))
    lines = [ln for ln in explain_report(res.report).splitlines() if "not computed" in ln]
    assert lines and all("nothing reads its value" in ln for ln in lines), lines
