"""argmax / argmin (max.dim and min.dim indices, argmax, argmin), NaN-propagating max / min, one-index
scatter, and cumprod's backward (which needs all three), against eager on the CPU path, rows held in
registers and looped (the persistent limit lowered), including ties, NaN, +-inf and zeros."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import aotfuse
from aotfuse.errors import UnsupportedOpError
from aotfuse.knobs import override
from aotfuse.testing.opcases import Fn

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _same(a, b):
    if a.is_floating_point():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    return torch.equal(a, b)


def _extremes(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[0] = -float("inf")                 # a row of -inf: position 0
    x[1, 3] = x[1, shape[1] - 2] = 50.0  # a tie: the first
    x[2, 7] = float("nan")               # NaN wins, the first NaN
    x[2, 9] = float("nan")
    x[3, 4] = float("inf")               # +inf then NaN: the NaN
    x[3, 6] = float("nan")
    x[4, 5] = -50.0
    return x


def _fn(x, y, i):
    v, ix = x.max(1)
    w, iw = y.min(-1, keepdim=True)
    return v, ix, w, iw, torch.argmax(x, 0), torch.argmin(y), torch.argmax(i, 1), torch.argmin(x, 1, keepdim=True)


@pytest.mark.parametrize("persistent_limit", [4096, 64])
def test_arg_reductions_and_nan_max_match_eager(persistent_limit):
    x = _extremes((7, 300), 0)
    y = torch.randn(5, 3, 200)
    y[0, 0, 150] = float("nan")
    y[1, 1] = float("inf")
    i = torch.randint(-3, 3, (4, 33))
    with override(persistent_rblock_max=persistent_limit):
        res = aotfuse.build(Fn(_fn), (x, y, i), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    x2, y2 = _extremes((7, 300), 1), torch.randn(5, 3, 200)
    y2[2, 2, 10] = y2[2, 2, 190] = -99.0
    y2[3, 0, 40] = float("nan")
    i2 = torch.randint(-3, 3, (4, 33))
    for k, (a, b) in enumerate(zip(art(x2, y2, i2), _fn(x2, y2, i2))):
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert _same(a, b), (k, a, b)


def test_scatter_one_index_per_row_and_extern():
    def fn(x, idx, idx0, src):
        return x.scatter(1, idx, 7.5), x.scatter(0, idx0, src)
    x = torch.randn(3, 5)
    idx = torch.tensor([[1], [4], [0]])
    idx0 = torch.tensor([[0, 2, 1, 1, 0]])
    src = torch.randn(1, 5)
    res = aotfuse.build(Fn(fn), (x, idx, idx0, src), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    for a, b in zip(art(x, idx, idx0, src), fn(x, idx, idx0, src)):
        assert torch.equal(a, b)
    # k indices per row (a top-k's positions; repeated ones write the same value)
    two = (x, torch.tensor([[0, 3], [2, 2], [4, 1]]))
    res = aotfuse.build(Fn(lambda x, i: x.scatter(1, i, 1.0)), two, targets=("sm_90",))
    assert torch.equal(aotfuse.load(res.data, device="cpu")(*two), two[0].scatter(1, two[1], 1.0))
    # an index over fewer rows than self: torch's kernel, as an extern
    few = (x, torch.tensor([[4, 0], [1, 1]]))
    res = aotfuse.build(Fn(lambda x, i: x.scatter(1, i, 1.0)), few, targets=("sm_90",))
    assert "aten.scatter.value" in _extern_targets(res.data)
    assert torch.equal(aotfuse.load(res.data, device="cpu")(*few), few[0].scatter(1, few[1], 1.0))


class CumprodLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(6, 9) + 0.5)

    def forward(self, x):
        return (torch.cumprod(x * self.w, 1) * torch.linspace(-1, 2, 9)).sum()


@pytest.mark.parametrize("zeros", [False, True])
def test_cumprod_training_matches_eager(zeros):
    """cumprod's backward (torch's formula: zeros handled through the first zero's position) lowers."""
    torch.manual_seed(0)
    model = CumprodLoss()
    res = aotfuse.build(model, (torch.rand(6, 9) + 0.5,), train=True, targets=("sm_90",))
    mod = aotfuse.load(res.data, device="cpu").as_module()
    x = torch.rand(6, 9) + 0.5
    if zeros:
        x[1, 3] = 0.0
        x[2, 0] = x[2, 5] = 0.0
        x[4, 8] = 0.0
    loss = mod(x)
    loss.backward()
    ref = copy.deepcopy(model)
    r = ref(x)
    r.backward()
    assert abs(float(loss) - float(r)) <= 1e-5 * abs(float(r))
    g, rg = dict(mod.named_parameters())["w"].grad, ref.w.grad
    assert float((g - rg).norm() / rg.norm()) < 1e-5


def _extern_targets(data: bytes) -> set:
    from aotfuse.archive import read_archive
    from aotfuse.runtime.payload import read_payload

    progs = read_payload(read_archive(data)).programs
    return {i.target for p in progs.values() for i in p.instructions if hasattr(i, "target")}
