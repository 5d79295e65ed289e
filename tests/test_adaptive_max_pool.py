"""Adaptive max pooling over whole windows (joint/pooling.divisible_windows): a max pool with stride = kernel in
inference (export/decomp.py) and in the joint trace (its gradient is max_pool2d's), the global 1 x 1 pool as a max
over the flattened plane; other sizes are refused by name. Against eager, values, indices and gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.errors import UnsupportedOpError
from aotfuse.testing.train_check import assert_training_matches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Net(nn.Module):
    def __init__(self, out, indices=False):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AdaptiveMaxPool2d(out, return_indices=indices)

    def forward(self, x):
        return self.pool(self.conv(x))


@pytest.mark.parametrize("out", [1, 2, (4, 2)])
def test_inference_values_and_indices(out):
    torch.manual_seed(0)
    model = Net(out, indices=True).eval()
    res = aotfuse.build(model, (torch.randn(2, 3, 8, 8),), targets=("sm_90",))
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        want = model(x)
    got = aotfuse.load(res.data, device="cpu")(x)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("out", [1, 2])
def test_training_matches_eager(out):
    torch.manual_seed(0)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Net(out)

        def forward(self, x):
            return self.net(x).square().sum()

    model = Loss().train()
    res = aotfuse.build(model, (torch.randn(2, 3, 8, 8),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(2, 3, 8, 8),), grad_rtol=1e-4, grad_atol=1e-5)


def test_windows_that_do_not_tile_the_input_are_refused_by_name():
    with pytest.raises(UnsupportedOpError, match="adaptive_max_pool2d"):
        aotfuse.build(Net(3).eval(), (torch.randn(2, 3, 8, 8),), targets=("sm_90",))
