"""Reductions along any dim: the split pass's decisions on the loop IR (no kernels), the block
heuristic's access patterns, and numerics vs eager on the CPU path (Triton interpreter) for split
full reductions, column reductions, middle-dim reductions, and LayerNorm / cross-entropy training.

Interpreter time matters: sizes are small, and the split thresholds are lowered (knobs) so small
sizes take the paths that large ones take by default."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.emit.kernel_src import block_choice
from aotfuse.export import capture
from aotfuse.ir.loop import Reduction, expr_loads
from aotfuse.knobs import override
from aotfuse.lower import lower
from aotfuse.runtime.explain import explain
from aotfuse.schedule.fusion import fuse
from aotfuse.schedule.inline import inline_pointwise
from aotfuse.schedule.split import split_reductions

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
TARGETS = ("sm_90",)
SMALL = dict(split_min_elems=1024, split_min_chunk=16)  # small sizes take the split path


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def _split(fn, *inputs, **kn):
    with override(**kn):
        graph, _ = lower(capture(Fn(fn), inputs))
        graph, _ = inline_pointwise(graph)
        return split_reductions(graph)


def _only(decisions, split=True):
    ds = [d for d in decisions if d.split == split]
    assert len(ds) == 1, ds
    return ds[0]


# ---------------------------------------------------------------- the split pass's decisions

def test_full_sum_splits_along_the_leading_dim():
    graph, ds = _split(lambda x: x.sum(), torch.randn(512, 256))
    d = _only(ds)
    assert (d.x, d.r, d.pattern, d.programs) == (1, 131072, "inner", 1)
    assert (d.how, d.chunks, d.chunk) == ("aligned", 512, 256)
    part = [n for n in graph.nodes if n.name == d.partial][0]
    final = [n for n in graph.nodes if n.name == d.node][0]
    assert (part.ranges, part.rranges) == ((512,), (256,))
    assert (final.ranges, final.rranges, final.rtype) == ((), (512,), "sum")
    assert graph.buffer(d.partial).dtype == "float32"


def test_odd_1d_sum_is_chunked_and_masked():
    graph, ds = _split(lambda x: x.sum(), torch.randn(70001))
    d = _only(ds)
    assert d.how == "flat, masked" and d.chunks >= 2
    assert (d.chunks - 1) * d.chunk < 70001 <= d.chunks * d.chunk
    part = [n for n in graph.nodes if n.name == d.partial][0]
    assert part.body.op == "where"  # the tail takes the identity
    loads = [str(ld.index) for ld in expr_loads(part.body)]
    assert all("Min" in ix for ix in loads), loads  # clamped in bounds


def test_exact_divisor_is_preferred():
    _, ds = _split(lambda x: x.amax(), torch.randn(2 ** 20))
    d = _only(ds)
    assert d.how == "flat" and d.chunks * d.chunk == 2 ** 20 and d.chunk % 1024 == 0


def test_column_sum_splits_with_s_outer():
    graph, ds = _split(lambda x: x.sum(0), torch.randn(16384, 4096))
    d = _only(ds)
    assert (d.pattern, d.programs) == ("outer", 64)  # 4096 outputs / 64-wide column tiles
    assert d.chunks * 64 >= 264 and d.chunks * d.chunk == 16384
    part = [n for n in graph.nodes if n.name == d.partial][0]
    assert part.ranges == (d.chunks, 4096)  # x stays the contiguous (inner) axis of the partial


def test_many_rows_and_short_rows_are_kept():
    _, ds = _split(lambda x: x.sum(-1), torch.randn(4096, 4096))
    assert "fill the GPU" in _only(ds, split=False).reason
    _, ds = _split(lambda x: x.sum(), torch.randn(3000))
    assert "split_min_elems" in _only(ds, split=False).reason


def test_layernorm_loss_partial_fuses_into_the_layernorm_kernel():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(256)

        def forward(self, x):
            return (self.ln(x) * 2.0).sum()

    graph, _ = lower(capture(M(), (torch.randn(512, 256),)))
    graph, _ = inline_pointwise(graph)
    graph, ds = split_reductions(graph)
    d = _only(ds)
    sched = fuse(graph)
    group = [g for g in sched.groups if d.partial in g.nodes][0]
    assert len([n for n in group.nodes if isinstance({m.name: m for m in graph.nodes}[n], Reduction)]) >= 3
    assert (group.xnumel, group.rnumel) == (512, 256)


def test_block_choice_patterns():
    col = block_choice(4096, 2048, "outer")
    assert (col.kind, col.xblock, col.rblock, col.num_warps) == ("looped_reduction", 64, 128, 8) and "column" in col.why
    # two accumulators (a norm's weight and bias gradients): half the rows per step, 32 registers each
    two = block_choice(4096, 2048, "outer", accumulators=2)
    assert (two.xblock, two.rblock, two.num_warps) == (64, 64, 8) and "2 accumulators" in two.why
    four = block_choice(4096, 2048, "outer", accumulators=4)
    assert four.rblock == 32 and four.xblock * four.rblock * 4 <= 32 * 32 * four.num_warps
    with override(outer_rblock=64):
        assert block_choice(4096, 2048, "outer").rblock == 64
    short = block_choice(4096, 40, "outer")  # a short column: one tile covers it
    assert (short.kind, short.rblock) == ("persistent_reduction", 64)
    # a sum over a batch of 8: threads hold whole columns, x covered by 8 halves x 32 lanes x 4 warps
    batch = block_choice(1024 * 768, 8, "outer")
    assert (batch.kind, batch.xblock, batch.rblock, batch.num_warps) == ("persistent_reduction", 1024, 8, 4)
    few = block_choice(768, 8, "outer")  # few outputs: narrower tiles, fewer warps, still whole columns
    assert few.xblock * few.rblock <= 1024 * 8 and few.num_warps == max(1, few.xblock // 256)
    # a split reduction's final (few outputs, a short column): narrower tiles holding whole columns, 8 programs
    fin = block_choice(64, 392, "outer")
    assert (fin.kind, fin.xblock, fin.rblock) == ("persistent_reduction", 8, 512) and "short column" in fin.why
    with override(outer_persistent_r=0):
        assert block_choice(64, 392, "outer").kind == "looped_reduction"
    assert block_choice(64, 2048, "outer").kind == "looped_reduction"  # longer than outer_persistent_r
    row = block_choice(327680, 197, "inner")
    assert row.kind == "persistent_reduction" and row.xblock > 1 and row.rblock == 256
    long = block_choice(1024, 50257, "inner")
    assert (long.kind, long.rblock, long.num_warps) == ("looped_reduction", 4096, 16)
    # a Welford pair over long rows steps by knobs.welford_rblock
    wf = block_choice(1024, 50257, "inner", welford=True)
    assert (wf.kind, wf.rblock, wf.num_warps) == ("looped_reduction", 2048, 16) and "welford_rblock" in wf.why
    with override(welford_rblock=4096):
        assert block_choice(1024, 50257, "inner", welford=True).rblock == 4096
    assert block_choice(1024, 8000, "inner", welford=True).rblock == 1024  # shorter rows: the plain loop
    # one row of 4096 in registers: 8 warps (16 per thread); four rows of 1024 packed: 4 warps (32 per thread)
    one = block_choice(8192, 4096, "inner")
    assert (one.kind, one.xblock, one.num_warps) == ("persistent_reduction", 1, 8), one
    packed = block_choice(8192, 1024, "inner")
    assert (packed.xblock, packed.num_warps) == (4, 4), packed


# ---------------------------------------------------------------- numerics vs eager (interpreter)

def _check(fn, inputs, tol=1e-5, **kn):
    with override(**{**SMALL, **kn}):
        res = aotfuse.build(Fn(fn), inputs, targets=TARGETS)
    assert any(d["split"] for d in res.report.splits), res.report.splits
    art = aotfuse.load(res.data, device="cpu")
    out = art(*inputs)
    ref = fn(*inputs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, r.shape, o.dtype, r.dtype)
        if r.is_floating_point():
            torch.testing.assert_close(o, r, rtol=tol, atol=tol)
        else:
            assert torch.equal(o, r), (o, r)
    return res


@pytest.mark.parametrize("n", [4096, 5003])
def test_full_reductions(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    p = 1 + 0.01 * torch.randn(n, generator=g)
    i = torch.randint(-50, 50, (n,), generator=g)
    _check(lambda x, p, i: (x.sum(), x.amax(), x.amin(), p.prod(0), (x > 3.0).any(), (x > 99).any(), i.sum()),
           (x, p, i), tol=1e-4)


def test_full_sum_2d_half():
    x = torch.randn(300, 67).to(torch.bfloat16)
    _check(lambda x: (x.sum(), x.float().mean()), (x,), tol=2e-2)


@pytest.mark.parametrize("shape", [(1000, 37), (4096, 64)])
def test_column_sums(shape):
    x = torch.randn(*shape)
    res = _check(lambda x: (x.sum(0), x.amax(0)), (x,), tol=1e-4)
    assert any(g.blocks["pattern"] == "outer" for g in res.report.groups if g.blocks)


@pytest.mark.parametrize("shape", [(392, 64), (300, 70), (1000, 24)])
def test_short_columns_of_few_outputs_held_whole(shape):
    """Few outputs over a short column (a split statistic's final): narrow tiles that hold the whole column
    (emit/space._few_columns), the last tile's columns masked where x is not a multiple; sums, maxima and a
    mean against eager."""
    x = torch.randn(*shape)
    with override(persistent_rblock_max=4096):
        res = aotfuse.build(Fn(lambda x: (x.sum(0), x.amax(0), x.mean(0) * 2)), (x,), targets=TARGETS)
    whys = [g.blocks.get("why", "") for g in res.report.groups if g.blocks]
    assert any("short column" in w for w in whys), whys
    art = aotfuse.load(res.data, device="cpu")
    x2 = torch.randn(*shape)
    for got, want in zip(art(x2), (x2.sum(0), x2.amax(0), x2.mean(0) * 2)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_middle_dims():
    x = torch.randn(3, 500, 70)
    y = torch.randn(4, 3000, 5)
    _check(lambda x, y: (x.sum((1, 2)), y.amax(1), y.sum(1)), (x, y), tol=1e-4)


class LayerNormLoss(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.bias = nn.Parameter(torch.randn(n))
        self.register_buffer("g", torch.randn(n))

    def forward(self, x):
        return (F.layer_norm(x, (x.shape[-1],), self.weight, self.bias).float() * self.g).sum()


class CrossEntropy(nn.Module):
    def forward(self, logits, target):
        return F.cross_entropy(logits.float(), target)


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _train_check(model, inputs, grad_of, tol=1e-4):
    with override(**SMALL, split_min_programs=64):
        res = aotfuse.build(model, inputs, train=True, targets=TARGETS)
    mod = aotfuse.load(res.data, device="cpu").as_module()
    ours = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    theirs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    loss = mod(*ours)
    loss.backward()
    ref_model = copy.deepcopy(model)
    ref = ref_model(*theirs)
    ref.backward()
    assert _rel(loss, ref) < tol
    for i in grad_of:
        assert _rel(ours[i].grad, theirs[i].grad) < tol, i
    params = dict(mod.named_parameters())
    for n, p in ref_model.named_parameters():
        assert _rel(params[n].grad, p.grad) < tol, n
    return res


def test_layernorm_loss_training():
    torch.manual_seed(0)
    res = _train_check(LayerNormLoss(256), (torch.randn(512, 256, requires_grad=True),), [0])
    fwd = [d for d in res.report.splits if d["split"]]
    bwd = [d for d in res.report.backward.splits if d["split"]]
    assert fwd and fwd[0]["how"] == "aligned"  # the loss sum, fused into the LayerNorm kernel
    assert any(d["pattern"] == "outer" for d in bwd)  # the weight gradient, a column reduction
    kernels = [g.blocks for g in res.report.backward.groups if g.blocks]
    assert any(b["pattern"] == "outer" and b["xblock"] == 64 for b in kernels)


def test_cross_entropy_training():
    torch.manual_seed(1)
    _train_check(CrossEntropy(), (torch.randn(64, 1000, requires_grad=True), torch.randint(0, 1000, (64,))), [0])


def test_explain_shows_splits_and_blocks(tmp_path):
    with override(**SMALL):
        res = aotfuse.build(Fn(lambda x: x.sum(0)), (torch.randn(1000, 37),), targets=TARGETS)
    path = tmp_path / "m.aotf"
    path.write_bytes(res.data)
    text = explain(str(path))
    assert "SPLIT" in text and "chunks of" in text
    assert "XBLOCK=64" in text and "column reduction" in text


# ---------------------------------------------------------------- online softmax (emit/online.py)

def _kernel_whys(res, program="forward"):
    rep = res.report if program == "forward" else res.report.backward
    return [g.blocks.get("why", "") for g in rep.groups if g.blocks]


def test_online_softmax_looped_rows_match_eager():
    """Rows longer than the persistent limit: max and sum of exponentials in one pass (softmax, log_softmax),
    with a masked tail (r not a multiple of the block), -inf entries and a row of -inf (NaN, as torch)."""
    g = torch.Generator().manual_seed(3)
    x = 4 * torch.randn(9, 1500, generator=g)
    x[1, 700:] = -float("inf")
    x[2, 3] = 60.0  # one dominant entry
    x[4, :] = -float("inf")
    x[5, 1200] = float("nan")  # a NaN row: NaN everywhere, and its max NaN, as torch
    with override(persistent_rblock_max=256):
        res = aotfuse.build(Fn(lambda x: (torch.softmax(x, -1), torch.log_softmax(x, -1), x.amax(-1))), (x,),
                            targets=TARGETS)
    whys = _kernel_whys(res)
    assert any("looped over r" in w and "online softmax" in w for w in whys), whys
    art = aotfuse.load(res.data, device="cpu")
    for o, r in zip(art(x), (torch.softmax(x, -1), torch.log_softmax(x, -1), x.amax(-1))):
        assert torch.equal(o.isnan(), r.isnan())
        torch.testing.assert_close(o.nan_to_num(), r.nan_to_num(), rtol=1e-5, atol=1e-5)


def test_online_softmax_cross_entropy_training_one_pass():
    torch.manual_seed(5)
    with override(persistent_rblock_max=256):
        res = _train_check(CrossEntropy(), (torch.randn(48, 1000, requires_grad=True),
                                            torch.randint(0, 1000, (48,))), [0])
    assert any("online softmax" in w for w in _kernel_whys(res)), _kernel_whys(res)


def test_online_pairs_need_the_same_values():
    """exp(y - max(x)) with y != x is not a softmax's sum: kept in two passes (and still right)."""
    x = torch.randn(6, 700)
    y = torch.randn(6, 700)
    fn = lambda x, y: torch.exp(y - x.amax(-1, keepdim=True)).sum(-1)  # noqa: E731
    with override(persistent_rblock_max=256):
        res = aotfuse.build(Fn(fn), (x, y), targets=TARGETS)
    assert not any("online softmax" in w for w in _kernel_whys(res))
    torch.testing.assert_close(aotfuse.load(res.data, device="cpu")(x, y), fn(x, y), rtol=1e-5, atol=1e-5)


def test_welford_layernorm_looped_rows_match_eager_and_fp64():
    """A LayerNorm row longer than the persistent limit: mean and variance in one pass (Welford per lane,
    lanes combined by tree sums), as accurate as torch's fp32 kernel against fp64 even with a large mean."""
    torch.manual_seed(4)
    m = nn.LayerNorm(1500)
    nn.init.normal_(m.weight)
    nn.init.normal_(m.bias)
    with override(persistent_rblock_max=256):
        res = aotfuse.build(m, (torch.randn(9, 1500),), targets=TARGETS)
    assert any("Welford" in w for w in _kernel_whys(res)), _kernel_whys(res)
    art = aotfuse.load(res.data, device="cpu")
    m64 = copy.deepcopy(m).double()
    for mu, sd in ((0.0, 1.0), (100.0, 3.0), (10.0, 0.1)):
        x = torch.randn(9, 1500) * sd + mu
        ref = m64(x.double())
        ours_err = float((art(x).double() - ref).abs().max())
        torch_err = float((m(x).double() - ref).abs().max())
        assert ours_err <= 3 * torch_err + 1e-6, (mu, sd, ours_err, torch_err)


def test_welford_long_rows_step_by_welford_rblock():
    """Rows of 20000 (>= 16384): the Welford loop steps by welford_rblock with a per-trip reciprocal, and
    the last trip's partial block (20000 = 9 * 2048 + 1568) keeps the masked lanes' counts right."""
    torch.manual_seed(5)
    m = nn.LayerNorm(20000)
    nn.init.normal_(m.weight)
    nn.init.normal_(m.bias)
    x = torch.randn(3, 20000) * 2 + 5
    res = aotfuse.build(m, (x,), targets=TARGETS)
    whys = _kernel_whys(res)
    assert any("Welford" in w and "2048 per step" in w for w in whys), whys
    ref = copy.deepcopy(m).double()(x.double())
    ours_err = float((aotfuse.load(res.data, device="cpu")(x).double() - ref).abs().max())
    torch_err = float((m(x).double() - ref).abs().max())
    assert ours_err <= 3 * torch_err + 1e-6, (ours_err, torch_err)


def test_welford_layernorm_training_looped():
    torch.manual_seed(6)
    with override(persistent_rblock_max=256):
        res = _train_check(LayerNormLoss(1200), (torch.randn(16, 1200, requires_grad=True),), [0])
    assert any("Welford" in w for w in _kernel_whys(res)), _kernel_whys(res)


def test_looped_rows_with_pipelined_loops_match_eager():
    """loop_stages (opt-in): the looped rows' loops as tl.range(num_stages=3); softmax, a log-softmax
    loss and a long row sum still match eager, and the kernels say so."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 20000, generator=g)
    t = torch.randint(0, 20000, (6,), generator=g)
    fn = lambda x, t: (x.softmax(-1), F.cross_entropy(x, t), x.sum(-1))  # noqa: E731
    with override(loop_stages=3):
        res = aotfuse.build(Fn(fn), (x, t), targets=TARGETS)
    whys = [g.blocks["why"] for g in res.report.groups if g.blocks and g.blocks["kind"] == "looped_reduction"]
    assert whys and all("loads pipelined 3 stages" in w for w in whys)
    art = aotfuse.load(res.data, device="cpu")
    # a sum of 20000 values rounds differently in another order: absolute 1e-3 (the others are normalized)
    for got, want, atol in zip(art(x, t), fn(x, t), (1e-7, 1e-6, 1e-3)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)


def test_short_reduction_over_a_gather_is_split():
    """A cross-entropy's mean over 4096 tokens gathers each token's target logit: even below
    split_min_elems it is split (each loop step would wait on two dependent loads in one program),
    and the loss matches eager."""
    torch.manual_seed(3)
    logits = torch.randn(4096, 16)
    target = torch.randint(0, 16, (4096,))
    target[::7] = -100  # ignored tokens
    fn = lambda lg, t: F.cross_entropy(lg, t)  # noqa: E731
    res = aotfuse.build(Fn(fn), (logits, target), targets=TARGETS)
    split = [d for d in res.report.splits if d["split"]]
    assert split and all(d["x"] == 1 and d["r"] == 4096 for d in split), res.report.splits
    kept = [d for d in res.report.splits if not d["split"] and d["x"] == 1 and d["r"] == 4096]
    assert all("split_min_elems" in d["reason"] for d in kept)  # the count of kept tokens gathers nothing
    art = aotfuse.load(res.data, device="cpu")
    for seed in (4, 5):
        g = torch.Generator().manual_seed(seed)
        lg, t = torch.randn(4096, 16, generator=g), torch.randint(0, 16, (4096,), generator=g)
        t[::5] = -100
        assert torch.allclose(art(lg, t), fn(lg, t), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["col_any", "row_any", "col_amax_bool", "col_amin_bool", "argmax_len1",
                                  "argmin_len1_keepdim", "argmax_len1_with_max"])
def test_bool_loops_and_length_one_arg_reductions(name):
    """Looped reductions over bool values keep an int1 accumulator (an int 0 identity made Triton refuse
    the loop), and argmax / argmin over a dim of length 1 give position 0 (the group runs as a pointwise
    kernel, which stored the value); all match eager exactly."""
    fn, shape = {
        "col_any": (lambda x: (x > 1.5).any(0), (130, 64)),
        "row_any": (lambda x: (x > 3.0).any(1), (8, 5000)),
        "col_amax_bool": (lambda x: (x > 1.0).amax(0), (300, 64)),
        "col_amin_bool": (lambda x: (x > -1.0).amin(0), (300, 64)),
        "argmax_len1": (lambda x: x.argmax(0), (1, 257)),
        "argmin_len1_keepdim": (lambda x: x.argmin(1, keepdim=True), (33, 1)),
        "argmax_len1_with_max": (lambda x: (x.argmax(0), x.amax(0)), (1, 100)),
    }[name]
    torch.manual_seed(0)
    res = aotfuse.build(Fn(fn), (torch.randn(*shape),), targets=TARGETS)
    art = aotfuse.load(res.data, device="cpu")
    for seed in (1, 2):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        got, want = art(x), fn(x)
        got = got if isinstance(got, (tuple, list)) else (got,)
        want = want if isinstance(want, (tuple, list)) else (want,)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), (name, g, w)
