"""LayerNorm's output is contiguous whatever its input's strides, as in eager (export/decomp.py,
`_as_eager_layout`): a channels-last LayerNorm after a permute (ConvNeXt's block) feeds the next Linear as one
matmul over every row, not a bmm over all leading dims but one (which ran 3584 cuBLAS matmuls of 56 rows each in
ConvNeXt-T at 224 x 224). Checked on the explain report and against eager, inference and training."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.runtime.explain import explain_report
from aotfuse.testing.train_check import assert_training_matches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Block(nn.Module):
    """ConvNeXt's block: depthwise conv (NCHW), permute to NHWC, LayerNorm, Linear, GELU, Linear, permute back,
    residual."""

    def __init__(self, c=16):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.ln = nn.LayerNorm(c)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        h = self.dw(x).permute(0, 2, 3, 1)
        h = self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(h))))
        return x + h.permute(0, 3, 1, 2)


def _matmul_lines(report) -> list[str]:
    return [ln for ln in explain_report(report).splitlines() if "-> extern" in ln and "mm" in ln]


def test_permuted_layernorm_feeds_one_matmul_and_matches_eager():
    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(2, 16, 8, 8)
    res = aotfuse.build(model, (x,), targets=("sm_90",))
    lines = _matmul_lines(res.report)
    assert len(lines) == 2 and not any("bmm" in ln for ln in lines), lines
    assert all("addmm 1x128x" in ln for ln in lines), lines  # all 2 x 8 x 8 rows in one matmul
    x2 = torch.randn(2, 16, 8, 8) * 2 + 0.5
    with torch.no_grad():
        want = model(x2)
    torch.testing.assert_close(aotfuse.load(res.data, device="cpu")(x2), want, rtol=1e-4, atol=1e-4)


def test_layer_norm_of_a_permuted_view_is_contiguous_like_eager():
    torch.manual_seed(0)
    ln = nn.LayerNorm(16).eval()

    class M(nn.Module):
        def forward(self, x):
            return ln(x.permute(0, 2, 3, 1))

    x = torch.randn(2, 16, 4, 4)
    got = aotfuse.load(aotfuse.build(M(), (x,), targets=("sm_90",)).data, device="cpu")(x)
    want = M()(x)
    assert got.is_contiguous() and want.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class Loss(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x).square().mean()


def test_permuted_layernorm_block_trains_like_eager():
    torch.manual_seed(0)
    model = Loss().train()
    x = torch.randn(2, 16, 8, 8)
    res = aotfuse.build(model, (x,), train=True, targets=("sm_90",))
    assert not any("bmm" in ln for ln in _matmul_lines(res.report))
    assert_training_matches(res.data, model, (torch.randn(2, 16, 8, 8) * 2 + 0.5,))
