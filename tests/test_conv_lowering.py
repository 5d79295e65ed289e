"""Convolution lowering choices: the bias split from the cuDNN call (lower/extern.py `_convolution`, knob
AOTFUSE_CONV_BIAS_SPLIT) and the channels-last layout of a half-precision CNN (lower/conv_layout.py,
AOTFUSE_CONV_LAYOUT), each built both ways and checked against eager on the CPU path."""
from __future__ import annotations

import pytest
import torch

import aotfuse
from test_upsample import Up, _x

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_conv_bias_is_split_into_the_consumer_and_matches_eager():
    """A biased conv calls cuDNN without its bias; the per-channel add fuses into the consumer (here the tanh and
    the mean of Up), channels-last or not; AOTFUSE_CONV_BIAS_SPLIT=0 passes it to the call."""
    from aotfuse.knobs import override
    from aotfuse.runtime.explain import explain_report

    torch.manual_seed(0)
    for cl in (False, True):
        model = Up(2, scale_factor=2, mode="nearest").eval()
        x = _x(2)
        if cl:
            model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
        for split in (True, False):
            with override(conv_bias_split=split):
                res = aotfuse.build(model, (x,), targets=("sm_90",))
            text = explain_report(res.report)
            assert ("convolution + bias add" in text) == split, text
            x2 = _x(2) * 2
            x2 = x2.contiguous(memory_format=torch.channels_last) if cl else x2
            torch.testing.assert_close(aotfuse.load(res.data, device="cpu")(x2), model(x2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_conv_layout_auto_matches_keep_and_eager(dtype):
    """AOTFUSE_CONV_LAYOUT=auto (the default) on the zoo's UNet: bf16 values around the convs and their filters are
    stored channels-last (one record), its GroupNorms' statistics walk their rows in storage order; fp32 is left
    alone; the outputs stay row-major and match eager as `keep` does."""
    from aotfuse.knobs import override
    from aotfuse.runtime.explain import explain_report
    from aotfuse.testing.zoo import entry

    ex = entry("unet").tiny(train=False, dtype=dtype)
    a, k = ex.make_inputs(5)
    want = ex.model(*a, **k).double()
    errs = {}
    for lay in ("auto", "keep"):
        with override(conv_layout=lay):
            res = aotfuse.build(ex.model, ex.args, targets=("sm_90",))
        text = explain_report(res.report)
        lines = [ln for ln in text.splitlines() if "stored channels-last" in ln]
        assert len(lines) == (1 if lay == "auto" and dtype == torch.bfloat16 else 0), lines
        assert ("storage order" in text) == (lay == "auto" and dtype == torch.bfloat16), text
        got = aotfuse.load(res.data, device="cpu")(*a, **k)
        assert got.is_contiguous()
        errs[lay] = float((got.double() - want).norm() / want.norm())
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    assert all(e < tol for e in errs.values()), errs


class Inverted(torch.nn.Module):
    """MobileNetV2's inverted residual: 1x1 expand, 3x3 depthwise, 1x1 project, BatchNorm, ReLU6, a residual."""

    def __init__(self, c=8, e=4):
        super().__init__()
        n = torch.nn
        self.block = n.Sequential(n.Conv2d(c, c * e, 1, bias=False), n.BatchNorm2d(c * e), n.ReLU6(),
                                  n.Conv2d(c * e, c * e, 3, padding=1, groups=c * e, bias=False), n.BatchNorm2d(c * e),
                                  n.ReLU6(), n.Conv2d(c * e, c, 1, bias=False), n.BatchNorm2d(c))

    def forward(self, x):
        return x + self.block(x)


def test_conv_layout_auto_stores_a_batchnorm_cnn_channels_last():
    from aotfuse.runtime.explain import explain_report

    torch.manual_seed(0)
    model = Inverted().eval().to(torch.bfloat16)
    x = torch.randn(2, 8, 12, 12, dtype=torch.bfloat16)
    res = aotfuse.build(model, (x,), targets=("sm_90",))
    assert "stored channels-last" in explain_report(res.report)
    x = torch.randn(2, 8, 12, 12, dtype=torch.bfloat16)
    got = aotfuse.load(res.data, device="cpu")(x)
    assert got.is_contiguous()
    want = model.float()(x.float())
    assert float((got.float() - want).norm() / want.norm()) < 1e-2
