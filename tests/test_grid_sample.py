"""F.grid_sample (RAFT, spatial transformers, deformable sampling) and F.max_pool3d: torch's decomposition of aten.grid_sampler_2d,
every mode, padding and corner alignment in inference; bilinear and bicubic in training (routed above autograd,
joint/sampling.py), the grid's gradient included; nearest training refused by name. Against eager, fp32."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.errors import UnsupportedOpError
from aotfuse.testing.train_check import assert_training_matches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Sample(nn.Module):
    def __init__(self, mode, pad, ac):
        super().__init__()
        self.mode, self.pad, self.ac = mode, pad, ac

    def forward(self, x, g):
        return F.grid_sample(x, g, mode=self.mode, padding_mode=self.pad, align_corners=self.ac)


def _grid(*shape):
    return torch.rand(*shape, 2) * 2.4 - 1.2  # some samples outside [-1, 1]: the padding modes matter


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("pad", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("ac", [False, True])
def test_grid_sample_inference(mode, pad, ac):
    model = Sample(mode, pad, ac)
    res = aotfuse.build(model, (torch.randn(2, 3, 7, 9), _grid(2, 5, 6)), targets=("sm_90",))
    x, g = torch.randn(2, 3, 7, 9), _grid(2, 5, 6)
    torch.testing.assert_close(aotfuse.load(res.data, device="cpu")(x, g), model(x, g), rtol=1e-5, atol=1e-5)


class Transformer(nn.Module):
    """A spatial transformer: an affine grid from a parameterized map, sampling a conv's output."""

    def __init__(self, mode, pad):
        super().__init__()
        self.mode, self.pad = mode, pad
        self.conv = nn.Conv2d(3, 3, 1)
        self.theta = nn.Linear(4, 6)

    def forward(self, x, z):
        grid = F.affine_grid(self.theta(z).view(-1, 2, 3), (2, 3, 5, 6), align_corners=False)
        out = F.grid_sample(self.conv(x), grid, mode=self.mode, padding_mode=self.pad, align_corners=False)
        return out.square().mean()


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("pad", ["zeros", "border", "reflection"])
def test_grid_sample_trains(mode, pad):
    torch.manual_seed(0)
    model = Transformer(mode, pad).train()
    res = aotfuse.build(model, (torch.randn(2, 3, 7, 9), torch.randn(2, 4)), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(2, 3, 7, 9), torch.randn(2, 4)), grad_rtol=1e-4,
                            grad_atol=1e-5)


def test_nearest_grid_sample_training_is_refused_by_name():
    with pytest.raises(UnsupportedOpError, match="grid_sampler_2d_backward"):
        aotfuse.build(Transformer("nearest", "zeros").train(), (torch.randn(2, 3, 7, 9), torch.randn(2, 4)),
                      train=True, targets=("sm_90",))


class Pool3d(nn.Module):
    def forward(self, x):
        a = F.max_pool3d(x, (1, 3, 3), (1, 2, 2), (0, 1, 1))
        b, idx = F.max_pool3d(x, 3, 2, 1, return_indices=True)
        return a, b, idx


def test_max_pool3d_inference_matches_eager_with_nan():
    """F.max_pool3d (MViT, video models) by export/maxpool3d.py: values and indices as eager's, NaN included."""
    res = aotfuse.build(Pool3d(), (torch.randn(2, 4, 3, 9, 9),), targets=("sm_90",))
    x = torch.randn(2, 4, 3, 9, 9)
    x[0, 0, 1, 2, 2] = float("nan")
    got, want = aotfuse.load(res.data, device="cpu")(x), Pool3d()(x)
    torch.testing.assert_close(got[0], want[0], equal_nan=True)
    torch.testing.assert_close(got[1], want[1], equal_nan=True)
    assert torch.equal(got[2], want[2])


def test_max_pool3d_training_is_refused_by_name():
    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv3d(4, 4, 1)

        def forward(self, x):
            return F.max_pool3d(self.c(x), 3, 2, 1).square().mean()

    with pytest.raises(UnsupportedOpError, match="max_pool3d_with_indices_backward"):
        aotfuse.build(Loss().train(), (torch.randn(2, 4, 3, 9, 9),), train=True, targets=("sm_90",))


@pytest.mark.parametrize("kernel,stride,padding,dilation,ceil", [
    ((2, 3, 3), (1, 2, 2), (1, 1, 0), 1, False),
    (3, 2, 1, (1, 2, 1), True),
    ((1, 2, 2), None, 0, 1, True),
    (2, 3, 0, 2, False),
])
def test_max_pool3d_windows_match_eager(kernel, stride, padding, dilation, ceil):
    """aotfuse's own decomposition (export/maxpool3d.py) across strides, padding, dilation and ceil_mode, batched and
    unbatched: values and ATen's flat indices."""
    class P(nn.Module):
        def forward(self, x, y):
            a = F.max_pool3d(x, kernel, stride, padding, dilation, ceil, return_indices=True)
            b = F.max_pool3d(y, kernel, stride, padding, dilation, ceil, return_indices=True)
            return (*a, *b)

    res = aotfuse.build(P(), (torch.randn(2, 3, 5, 9, 8), torch.randn(3, 6, 7, 7)), targets=("sm_90",))
    x, y = torch.randn(2, 3, 5, 9, 8), torch.randn(3, 6, 7, 7)
    for got, want in zip(aotfuse.load(res.data, device="cpu")(x, y), P()(x, y)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want)
