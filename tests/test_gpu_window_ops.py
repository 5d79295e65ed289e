"""GPU tier: the twenty-first session's ops compiled for this GPU and run by the runtime: unfold, cdist,
logcumsumexp (a Triton associative scan with the logaddexp combine, one block and looped), nn.Bilinear;
inference against eager on CUDA, and one training step through all of them (loss and gradients)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.testing.train_check import assert_training_matches

pytestmark = pytest.mark.gpu


def _arch():
    return "sm_%d%d" % torch.cuda.get_device_capability()


class Ops(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.bil = nn.Bilinear(16, 16, 8)

    def forward(self, x, y):
        h = self.proj(x)
        win = h.unfold(1, 4, 2)  # [B, windows, 16, 4]
        dist = torch.cdist(h, y)
        scan = torch.logcumsumexp(h * 4, 1)
        bil = self.bil(h, y[:, : h.shape[1]])
        return win.sum(-1), dist, scan, bil


class Loss(nn.Module):
    def __init__(self):
        super().__init__()
        self.ops = Ops()

    def forward(self, x, y):
        win, dist, scan, bil = self.ops(x, y)
        return win.square().mean() + dist.mean() + scan.sin().mean() + bil.square().mean()


@pytest.mark.parametrize("rows", [12, 3000], ids=["one-block", "looped-scan"])
def test_window_ops_match_eager(rows):
    torch.manual_seed(0)
    model = Ops().eval()
    x, y = torch.randn(2, rows, 16), torch.randn(2, rows + 5, 16)
    res = aotfuse.build(model, (x, y), targets=(_arch(),))
    x, y = torch.randn(2, rows, 16).cuda(), torch.randn(2, rows + 5, 16).cuda()
    ref = copy.deepcopy(model).cuda()
    with torch.no_grad():
        got = aotfuse.load(res.data, device="cuda")(x, y)
        want = ref(x, y)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-4, atol=2e-4)


def test_window_ops_train():
    torch.manual_seed(0)
    model = Loss().train()
    x, y = torch.randn(2, 12, 16), torch.randn(2, 17, 16)
    res = aotfuse.build(model, (x, y), train=True, targets=(_arch(),))
    assert_training_matches(res.data, model, (torch.randn(2, 12, 16), torch.randn(2, 17, 16)), loss_rtol=1e-4,
                            loss_atol=1e-5, grad_rtol=1e-3, grad_atol=1e-4, device="cuda")
