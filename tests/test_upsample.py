"""Upsampling (export/upsample.py, joint/upsample.py): nearest by integer factors as views (its gradient a window
sum), (bi/tri)linear as interpolation matmuls in training, other ratios and bicubic by torch's gathers (their
gradient a scatter-add extern); inference and training against eager on the CPU path."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Up(nn.Module):
    """conv -> interpolate -> a consumer, as a UNet decoder stage; `loss`: the mean square (training)."""

    def __init__(self, nd=2, loss=False, **kw):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[nd]
        self.c = conv(3, 4, 3, padding=1)
        self.kw, self.loss = kw, loss

    def forward(self, x):
        u = F.interpolate(self.c(x), **self.kw)
        y = torch.tanh(u * 0.5) + u.mean()
        return y.square().mean() if self.loss else y


def _x(nd, b=2):
    return torch.randn(b, 3, *(7, 5, 4)[:nd])


@pytest.mark.parametrize("nd,kw", [
    (2, dict(scale_factor=2, mode="nearest")),
    (2, dict(scale_factor=(3, 2), mode="nearest")),
    (2, dict(size=(21, 10), mode="nearest")),
    (1, dict(scale_factor=4, mode="nearest")),
    (1, dict(scale_factor=41, mode="nearest")),  # float32 1/41 rounds low: eager's index is not a repeat
    (3, dict(scale_factor=2, mode="nearest")),
    (2, dict(scale_factor=1.5, mode="nearest")),
    (2, dict(size=(9, 8), mode="nearest")),
    (2, dict(scale_factor=2, mode="bilinear", align_corners=False)),
    (2, dict(scale_factor=2, mode="bilinear", align_corners=True)),
    (2, dict(size=(11, 13), mode="bicubic", align_corners=False)),
    (1, dict(scale_factor=2, mode="linear", align_corners=False)),
])
def test_inference_matches_eager(nd, kw):
    torch.manual_seed(0)
    model = Up(nd, **kw).eval()
    res = aotfuse.build(model, (_x(nd),), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    for b in (2,):
        x = _x(nd, b) * 2 + 0.5
        torch.testing.assert_close(art(x), model(x), rtol=1e-5, atol=1e-5)


def test_channels_last_nearest_matches_eager():
    torch.manual_seed(0)
    model = Up(2, scale_factor=2, mode="nearest").eval().to(memory_format=torch.channels_last)
    x = _x(2).contiguous(memory_format=torch.channels_last)
    art = aotfuse.load(aotfuse.build(model, (x,), targets=("sm_90",)).data, device="cpu")
    x2 = (_x(2) * 3).contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(art(x2), model(x2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nd,kw", [(2, dict(scale_factor=2)), (2, dict(size=(14, 15))), (1, dict(scale_factor=3)),
                                   (1, dict(scale_factor=41)),
                                   (3, dict(scale_factor=(1, 2, 2)))])
def test_nearest_integer_factor_gradients_match_eager(nd, kw):
    _train_check(nd, dict(mode="nearest", **kw))


def _train_check(nd, kw):
    torch.manual_seed(0)
    model = Up(nd, loss=True, **kw)
    x = _x(nd).requires_grad_()
    res = aotfuse.build(model, (x,), train=True, targets=("sm_90",))
    mod = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    x2 = _x(nd) * 2 - 1
    xa, xb = x2.clone().requires_grad_(), x2.clone().requires_grad_()
    loss, want = mod(xa), ref(xb)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-6)
    grads = dict(mod.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("nd,kw", [
    (2, dict(scale_factor=2, mode="bilinear", align_corners=False)),
    (2, dict(scale_factor=2, mode="bilinear", align_corners=True)),
    (2, dict(size=(11, 9), mode="bilinear", align_corners=False)),
    (2, dict(scale_factor=(1.5, 3), mode="bilinear", align_corners=False)),
    (1, dict(scale_factor=2, mode="linear", align_corners=False)),
    (3, dict(scale_factor=2, mode="trilinear", align_corners=False)),
    (2, dict(size=(3, 2), mode="bilinear", align_corners=False)),  # downsampling
])
def test_linear_modes_train_as_matmuls_and_match_eager(nd, kw):
    _train_check(nd, kw)


@pytest.mark.parametrize("kw", [dict(size=(9, 8), mode="bicubic", align_corners=False),
                                dict(scale_factor=1.5, mode="nearest")])
def test_training_through_torchs_gathers_matches_eager(kw):
    """Bicubic and fractional nearest keep torch's gathers; their gradient is a scatter-add (aten.index_put with
    accumulate, an extern)."""
    _train_check(2, kw)
