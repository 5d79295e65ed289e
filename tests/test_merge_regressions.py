"""Regressions from merging the feature branches (scans/pooling, split reductions, matmul templates, zoo):
each the smallest model that reproduced the bug, built and run on the CPU path against eager."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.knobs import override


def _rel(out, ref) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _check(model, shape, tol=1e-5, dtype=torch.float32, seeds=(1, 2)):
    g = torch.Generator().manual_seed(0)
    res = aotfuse.build(model, (torch.randn(shape, generator=g).to(dtype),), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    for s in seeds:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(100 + s)).to(dtype)
        out = art(x)
        with torch.no_grad():
            ref = model(x)
        outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
        for o, r in zip(outs, refs):
            assert o.shape == r.shape and o.dtype == r.dtype
            assert _rel(o, r) <= tol, f"seed {s}: rel err {_rel(o, r):.2e}"


# ---- 1. a reduction over one element (adaptive pool / mean of 1x1 maps) fused with its consumers
# The group's space is x by r = 1, so it runs as a pointwise kernel, which computed no reduction
# values: the consumer's read of the reduction raised KeyError in _Emitter.node_value (hf_resnet's
# 32 px tiny config ends in 1x1 maps before its adaptive average pool).

class _PoolHead(nn.Module):
    def forward(self, x):
        p = F.adaptive_avg_pool2d(torch.relu(x), 1).flatten(1)
        return p * 2 + 1


class _ReduceMix(nn.Module):
    def forward(self, x):
        y = torch.relu(x)
        m = y.mean(dim=(2, 3))
        return m * y.amax(dim=(2, 3)) - y.sum(dim=(2, 3)), m


class _PoolLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(torch.relu(x), 1).flatten(1)).relu()


@pytest.mark.parametrize("model", [_PoolHead, _ReduceMix], ids=lambda m: m.__name__)
def test_one_element_reduction_fused_with_consumer(model):
    _check(model().eval(), (2, 8, 1, 1))


@pytest.mark.parametrize("mm", ["extern", "template"])
def test_one_element_pool_feeds_linear(mm):
    torch.manual_seed(0)
    with override(mm=mm):
        _check(_PoolLinear().eval(), (2, 8, 1, 1))
