"""ELU (and SELU, CELU), LeakyReLU, clamp with tensor bounds and one_hot (export/decomp.py): inference and training
against eager on fresh inputs, both signs and NaN (clamp keeps a NaN input NaN)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.testing.train_check import assert_training_matches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ACTS = {"elu": lambda: nn.ELU(alpha=0.7), "selu": nn.SELU, "celu": lambda: nn.CELU(alpha=1.5),
        "leaky_relu": lambda: nn.LeakyReLU(0.2)}


class Net(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc, self.act = nn.Linear(8, 16), act

    def forward(self, x):
        return self.act(self.fc(x))


class Clamp(nn.Module):
    def __init__(self):
        super().__init__()
        self.lo, self.hi = nn.Parameter(torch.full((16,), -0.5)), nn.Parameter(torch.full((16,), 0.75))

    def forward(self, x):
        return torch.clamp(x, self.lo, self.hi) * 2


@pytest.mark.parametrize("name", sorted(ACTS))
def test_activation_matches_eager(name):
    torch.manual_seed(0)
    model = Net(ACTS[name]()).eval()
    res = aotfuse.build(model, (torch.randn(4, 8),), targets=("sm_90",))
    x = torch.randn(4, 8) * 3
    with torch.no_grad():
        want = model(x)
    assert (want < 0).any() and (want > 0).any()
    torch.testing.assert_close(aotfuse.load(res.data, device="cpu")(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(ACTS))
def test_activation_trains(name):
    torch.manual_seed(0)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Net(ACTS[name]())

        def forward(self, x):
            return self.net(x).square().mean()

    model = Loss().train()
    res = aotfuse.build(model, (torch.randn(4, 8),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(4, 8) * 3,))


def test_clamp_with_tensor_bounds_keeps_nan_and_trains():
    torch.manual_seed(0)
    model = Clamp().eval()
    res = aotfuse.build(model, (torch.randn(4, 16),), targets=("sm_90",))
    x = torch.randn(4, 16)
    x[0, 3] = float("nan")
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(aotfuse.load(res.data, device="cpu")(x), want, equal_nan=True)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = Clamp()

        def forward(self, x):
            return self.c(x).square().sum()

    model = Loss().train()
    res = aotfuse.build(model, (torch.randn(4, 16),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(4, 16),))


def test_one_hot_in_inference():
    """torch's one_hot decomposition checks the ids' range on the host (`_assert_async`, refused before); ours
    compares with arange: the same one-hot rows for ids in range."""
    import torch.nn.functional as F

    class M(nn.Module):
        def forward(self, t, x):
            oh = F.one_hot(t, 10)
            return oh, (oh.float() * x).sum(-1)

    t, x = torch.randint(0, 10, (4, 3)), torch.randn(4, 3, 10)
    res = aotfuse.build(M(), (t, x), targets=("sm_90",))
    t2, x2 = torch.randint(0, 10, (4, 3)), torch.randn(4, 3, 10)
    got, want = aotfuse.load(res.data, device="cpu")(t2, x2), M()(t2, x2)
    assert got[0].dtype == torch.int64 and torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
