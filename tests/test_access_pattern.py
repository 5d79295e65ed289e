"""Fusion refuses to put a row-order group and a column-order group into one kernel (FuseRefusal.ACCESS_PATTERN):
the kernel lays its tile out for one order and reads the other side strided. The case that showed it is a
channels-last BatchNorm backward: the per-channel partial sums (contiguous along the channels) next to the
input gradient (contiguous along the flat NHWC index). Checked on the CPU path: the refusal in the report,
no kernel whose loads run both ways, results and gradients against eager."""
from __future__ import annotations

import copy
import re

import msgpack
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.knobs import override
from aotfuse.runtime.explain import explain_report

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
CL = torch.channels_last


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)

    def forward(self, x, t):
        return F.mse_loss(torch.relu(self.bn(self.conv(x))).mean((2, 3)), t)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 8, 32, 32, generator=g).contiguous(memory_format=CL), torch.randn(4, 16, generator=g)


def _mixed(src: str) -> bool:
    loads = [ln for ln in src.splitlines() if "tl.load(" in ln and "rindex" in ln and "xindex" in ln]
    columns = [ln for ln in loads if re.search(r"\(\d+ \* rindex\)", ln) and "(xindex % " in ln]
    rows = [ln for ln in loads if re.search(r"\(rindex \+ |\(rindex % \d+\)", ln)]
    return bool(columns and rows)


class RowsAndColumns(nn.Module):
    """Over a channels-last input: a pointwise node in flat (row) order and a per-channel sum of squares, split
    into column partials; both read x, so fusion weighs them as one kernel."""

    def forward(self, x):
        return torch.relu(x) * 2, (x * x).sum((0, 2, 3))


def test_row_and_column_groups_are_refused_one_kernel():
    x = torch.randn(4, 16, 32, 32).contiguous(memory_format=CL)
    with override(split_min_elems=1024, split_min_chunk=16, split_min_programs=64):
        res = aotfuse.build(RowsAndColumns(), (x,), targets=("sm_90",))
    text = explain_report(res.report, program="forward")
    assert re.search(r"refused horizontal \w+ \+ \w+_part .*access pattern: \w+ reads rows, \w+_part reads columns",
                     text), text
    art = aotfuse.load(res.data, device="cpu")
    srcs = msgpack.unpackb(bytes(art.archive.part("sources")))
    assert not [n for n, s in srcs.items() if _mixed(s)]
    x2 = torch.randn(4, 16, 32, 32).contiguous(memory_format=CL)
    for got, want in zip(art(x2), RowsAndColumns()(x2)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_channels_last_batchnorm_backward_keeps_rows_and_columns_apart():
    """The BatchNorm backward (its sums of dy and dy * x_hat computed once each: schedule/trivial.py
    duplicates): no kernel reads both ways; gradients against eager."""
    torch.manual_seed(0)
    model = ConvBN().to(memory_format=CL).train()
    with override(split_min_elems=1024, split_min_chunk=16, split_min_programs=64):
        res = aotfuse.build(model, _inputs(1), train=True, targets=("sm_90",))
    text = explain_report(res.report, program="backward")
    assert "the same reduction as" in text, text
    art = aotfuse.load(res.data, device="cpu")
    srcs = msgpack.unpackb(bytes(art.archive.part("sources")))
    assert not [n for n, s in srcs.items() if _mixed(s)]
    mod = art.as_module()
    x, t = _inputs(2)
    loss = mod(x, t)
    loss.backward()
    ref_model = copy.deepcopy(model)
    ref = ref_model(x, t)
    ref.backward()
    assert float((loss - ref).abs()) <= 1e-5 * float(ref.abs()) + 1e-6
    ours = dict(mod.named_parameters())
    for n, p in ref_model.named_parameters():
        got, want = ours[n].grad.double(), p.grad.double()
        assert float((got - want).norm() / want.norm()) < 1e-4, n


def _full_size_stores(srcs: dict, numel: int, dtype: str) -> int:
    return sum(len(re.findall(rf"tl\.store\(out_ptr\d+ \+ xindex, \w+\.to\(tl\.{dtype}\)", s))
               for s in srcs.values() if f"xindex < {numel}" in s and "rindex" not in s)


def test_widening_producers_are_recomputed_not_stored_in_fp32():
    """A cheap node whose stored element is wider than its one per-element input (x_hat = (x - mean) * rstd in
    fp32 from bf16 x; a cast up) is recomputed at every consumer instead of stored (schedule/inline.py), and an
    expensive node whose only consumer casts it up is stored at its own (bf16) type: the bf16 BatchNorm
    backward stores no fp32 tensor of the activation's size; gradients stay within bf16 eager's own error."""
    torch.manual_seed(0)
    model = ConvBN().to(memory_format=CL).to(torch.bfloat16).train()
    x, t = _inputs(1)
    x, t = x.to(torch.bfloat16), t.to(torch.bfloat16)
    res = aotfuse.build(model, (x, t), train=True, targets=("sm_90",))
    text = explain_report(res.report, program="backward")
    assert "recomputed from narrower inputs (widens)" in text, text
    art = aotfuse.load(res.data, device="cpu")
    srcs = msgpack.unpackb(bytes(art.archive.part("sources")))
    assert _full_size_stores(srcs, 4 * 16 * 32 * 32, "float32") == 0
    x2, t2 = (v.to(torch.bfloat16) for v in _inputs(2))
    x2 = x2.contiguous(memory_format=CL)
    mod = art.as_module()
    mod(x2, t2).backward()
    low, ref = copy.deepcopy(model), copy.deepcopy(model).float()
    low(x2, t2).backward()
    ref(x2.float(), t2.float()).backward()
    ours, theirs = dict(mod.named_parameters()), dict(low.named_parameters())
    for n, p in ref.named_parameters():
        want = p.grad.double()
        err = float((ours[n].grad.double() - want).norm() / want.norm())
        eager_err = float((theirs[n].grad.double() - want).norm() / want.norm())
        assert err <= max(2 * eager_err, 2e-2), (n, err, eager_err)
