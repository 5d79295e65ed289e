"""A group of reductions walks its reduced index in its largest input's storage order (schedule/reorder.py): a
GroupNorm's statistics over channels-last activations read each row's contiguous channel chunks first instead of
elements C apart. Numerics against eager; row-major inputs and order-sensitive reductions keep eager's order."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.knobs import override
from aotfuse.runtime.explain import explain_report

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class ConvNorm(nn.Module):
    def __init__(self, c=16, groups=4):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.GroupNorm(groups, c)
        self.out = nn.Conv2d(c, c, 1)

    def forward(self, x):
        return self.out(torch.nn.functional.silu(self.norm(self.conv(x))))


def _build(layout, dtype=torch.bfloat16, model=None, shape=(2, 16, 12, 12)):
    torch.manual_seed(0)
    model = (model or ConvNorm()).eval().to(dtype)
    with override(conv_layout=layout):
        res = aotfuse.build(model, (torch.randn(shape, dtype=dtype),), targets=("sm_90",))
    return model, res


@pytest.mark.parametrize("groups", [4, 2])
def test_channels_last_group_statistics_walk_channels_first(groups):
    model, res = _build("auto", model=ConvNorm(16, groups))
    text = explain_report(res.report)
    lines = [ln for ln in text.splitlines() if "storage order" in ln]
    assert len(lines) == 2, text  # the mean and the variance, one group
    assert f"digits [12, 12, {16 // groups}]" in lines[0] and "strides [16, 192, 1]" in lines[0], lines
    x = torch.randn(2, 16, 12, 12, dtype=torch.bfloat16)
    got = aotfuse.load(res.data, device="cpu")(x).float()
    want = model.float()(x.float())
    assert float((got - want).norm() / want.norm()) < 1e-2


def test_row_major_statistics_keep_their_order():
    _, res = _build("keep")
    assert "storage order" not in explain_report(res.report)


def test_order_sensitive_reductions_keep_their_order():
    """argmax over a channels-last value's flattened plane: the first maximum wins, so its order stays."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            h = self.conv(x)
            return h.flatten(1).argmax(1), h.flatten(1).sum(1)

    torch.manual_seed(0)
    model = M().eval().to(torch.bfloat16)
    x = torch.randn(2, 4, 6, 6, dtype=torch.bfloat16)
    with override(conv_layout="auto"):
        res = aotfuse.build(model, (x,), targets=("sm_90",))
    got = aotfuse.load(res.data, device="cpu")(x)
    want = model(x)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=2e-2, atol=2e-2)
