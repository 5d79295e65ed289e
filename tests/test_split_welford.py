"""A mean and a variance split together (schedule/split_welford.py): each chunk's partial is the chunk's sum and
its M2 about its own mean, computed in one kernel; the final combines them by Chan's formula. Checked on the
CPU path against eager and against float64, with means far from zero (where a sum of squares would cancel)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.knobs import override
from aotfuse.runtime.explain import explain_report

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SPLIT = dict(split_min_elems=1024, split_min_chunk=16, split_min_programs=64)
CL = torch.channels_last


class MeanVar(nn.Module):
    """Per-column mean and biased variance of x [N, C], written out as a norm's decomposition does."""

    def forward(self, x):
        m = x.mean(0, keepdim=True)
        v = ((x - m) * (x - m)).mean(0)
        return m.squeeze(0), v


def _build(model, inputs, train=False):
    with override(**SPLIT):
        return aotfuse.build(model, inputs, train=train, targets=("sm_90",))


def test_variance_splits_with_its_mean_one_partial_kernel():
    x = torch.randn(4096, 16)
    res = _build(MeanVar(), (x,))
    text = explain_report(res.report)
    assert "Welford pair with" in text, text
    # the two partials share one kernel, and so do the two finals
    parts = [g for g in res.report.groups if any(n.endswith("_part") for n in g.nodes)]
    assert len(parts) == 1 and sum(n.endswith("_part") for n in parts[0].nodes) == 2, res.report.groups
    art = aotfuse.load(res.data, device="cpu")
    # Relative error of the variance against float64: within 1e-6 where the mean is up to 100 standard
    # deviations from zero. At 1e5 (a mean of 1000, sd 0.01) the chunk means differ from the mean by about
    # ten fp32 ulps of it, and the combination's terms C * (mean_s - mean)**2 carry that rounding: within
    # 1e-3 (an fp32 two-pass variance: about 1e-5; per-chunk Welford partials, as GPU BatchNorms and
    # Inductor's split Welford compute them, share this bound).
    for mu, sd in ((0.0, 1.0), (100.0, 1.0), (-30.0, 5.0), (1000.0, 0.01)):
        x2 = torch.randn(4096, 16) * sd + mu
        m, v = art(x2)
        x64 = x2.double()
        m64, v64 = x64.mean(0), x64.var(0, unbiased=False)
        two_pass = float((((x2 - x2.mean(0)) ** 2).mean(0).double() - v64).abs().max() / v64.min())
        assert float((m.double() - m64).abs().max()) <= 1e-6 * (abs(mu) + sd), mu
        rel = float(((v.double() - v64).abs() / v64).max())
        assert rel <= (1e-6 if abs(mu) <= 100 * sd else 1e-3), (mu, sd, rel, two_pass)


@pytest.mark.parametrize("rows", [4099, 4096 + 31])
def test_masked_chunks_pair_with_per_chunk_counts(rows):
    """A split whose last chunk is short (no chunk length divides r) pairs too: each chunk's mean and the
    combination take that chunk's own count, the tail's masked elements add nothing."""
    x = torch.randn(rows, 16) * 2 + 5
    res = _build(MeanVar(), (x,))
    text = explain_report(res.report)
    assert "Welford pair with" in text and "flat, masked" in text, text
    art = aotfuse.load(res.data, device="cpu")
    x2 = torch.randn(rows, 16) * 2 + 5
    m, v = art(x2)
    v64 = x2.double().var(0, unbiased=False)
    assert float(((v.double() - v64).abs() / v64).max()) < 1e-6
    torch.testing.assert_close(m, x2.mean(0), rtol=1e-6, atol=1e-5)


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))).square().mean()


@pytest.mark.parametrize("mu", [0.0, 50.0])
def test_batchnorm_training_statistics_paired_and_match_eager(mu):
    torch.manual_seed(0)
    model = ConvBN().to(memory_format=CL).train()
    nn.init.normal_(model.bn.weight)
    x = torch.randn(4, 8, 32, 32).contiguous(memory_format=CL)
    res = _build(model, (x,), train=True)
    assert "Welford pair with" in explain_report(res.report)
    mod = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    x2 = (torch.randn(4, 8, 32, 32) + mu).contiguous(memory_format=CL)
    loss, want = mod(x2), ref(x2)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    ours = dict(mod.named_parameters())
    for n, p in ref.named_parameters():
        assert float((ours[n].grad - p.grad).norm() / p.grad.norm()) < 1e-4, n
    bufs = dict(mod.named_buffers())
    for n in ("bn.running_mean", "bn.running_var"):
        torch.testing.assert_close(bufs[n], dict(ref.named_buffers())[n], rtol=1e-5, atol=1e-5)


def test_whole_tiles_take_the_welford_update_without_counts():
    """Looped partials whose tiles are all whole (x and the chunk multiples of the blocks): the Welford pair's
    update has no selects and no per-lane counts (emit/online.py); a row pair of whole rows likewise."""
    import msgpack

    x = torch.randn(16384, 64) * 3 + 20
    res = aotfuse.build(MeanVar(), (x,), targets=("sm_90",))
    whys = [g.blocks.get("why", "") for g in res.report.groups if g.blocks]
    assert any("one pass: Welford" in w for w in whys), whys
    art = aotfuse.load(res.data, device="cpu")
    srcs = msgpack.unpackb(bytes(art.archive.part("sources")))
    pair = [s for s in srcs.values() if "for roffset" in s and "(1.0 / (roffset //" in s]
    assert pair and all("_n = " not in s and "tl.where(xmask & rmask, acc" not in s for s in pair), srcs
    x2 = torch.randn(16384, 64) * 3 + 20
    m, v = art(x2)
    v64 = x2.double().var(0, unbiased=False)
    assert float(((v.double() - v64).abs() / v64).max()) < 1e-6
    torch.testing.assert_close(m, x2.mean(0), rtol=1e-6, atol=1e-5)
    ln = nn.LayerNorm(8192)
    nn.init.normal_(ln.weight)
    nn.init.normal_(ln.bias)
    xr = torch.randn(3, 8192) * 2 + 7
    with override(persistent_rblock_max=1024):
        res = aotfuse.build(ln, (xr,), targets=("sm_90",))
    assert any("one pass: Welford" in g.blocks.get("why", "") for g in res.report.groups if g.blocks)
    ref = copy.deepcopy(ln).double()(xr.double())
    ours = float((aotfuse.load(res.data, device="cpu")(xr).double() - ref).abs().max())
    assert ours <= 3 * float((ln(xr).double() - ref).abs().max()) + 1e-6


class NotVariances(nn.Module):
    """Squared deviations that look like a variance but are not x's: a cast that changes values on f, on the
    mean or on the square. None of them may be paired (the pair would compute x's M2)."""

    def forward(self, x):
        m = x.mean(0)
        return (m, ((x.long().float() - m) ** 2).mean(0), ((x.bool().float() - m) ** 2).mean(0),
                ((x - m.long().float()) ** 2).mean(0), ((x - m) ** 2).long().float().mean(0))


@pytest.mark.parametrize("dim", [0, 1])
def test_value_changing_casts_are_not_paired(dim):
    """dim 0: column statistics split in chunks (split_welford); dim 1: a looped row kernel (emit/online.py)."""
    torch.manual_seed(0)
    x = torch.randn(4096, 16) * 3 if dim == 0 else torch.randn(4, 8192) * 3
    model = NotVariances() if dim == 0 else _Rows()
    kn = SPLIT if dim == 0 else dict(persistent_rblock_max=1024)
    with override(**kn):
        res = aotfuse.build(model, (x,), targets=("sm_90",))
    text = explain_report(res.report)
    assert "Welford pair with" not in text and "one pass: Welford" not in text, text
    for got, want in zip(aotfuse.load(res.data, device="cpu")(x), model(x)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class _Rows(nn.Module):
    def forward(self, x):
        m = x.mean(1, keepdim=True)
        return m, ((x.long().float() - m) ** 2).mean(1), ((x - m.long().float()) ** 2).mean(1)


def test_widening_casts_still_pair():
    """A bf16 input's statistics in fp32 (the upcast keeps every value): still one Welford pair."""
    x = (torch.randn(4096, 16) * 2 + 3).bfloat16()

    class HalfStats(nn.Module):
        def forward(self, x):
            xf = x.float()
            m = xf.mean(0)
            return m, ((xf - m) ** 2).mean(0)

    res = _build(HalfStats(), (x,))
    assert "Welford pair with" in explain_report(res.report)
    m, v = aotfuse.load(res.data, device="cpu")(x)
    v64 = x.double().var(0, unbiased=False)
    assert float(((v.double() - v64).abs() / v64).max()) < 1e-6
