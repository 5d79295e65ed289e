"""Dynamic dims (issue 10): one archive, many shapes, checked against eager on the CPU path.

Kernels take the dims as int32 arguments, program sizes and the memory plan are expressions of them,
and the runtime specializes the program per shape (no compile). Shapes include the range ends and
sizes that are not multiples of any block size.
"""
from __future__ import annotations

import pytest
import torch

import aotfuse
from aotfuse.errors import BuildError, GuardError
from aotfuse.export.dynamic import DynamicDim, parse_cli


class NormSoftmax(torch.nn.Module):
    def __init__(self, d: int = 100):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)

    def forward(self, x, y):
        return torch.softmax(self.ln(x * 2 + y), dim=-1)


class RowSoftmax(torch.nn.Module):
    """A reduction whose length is the dynamic dim."""

    def forward(self, x):
        return torch.softmax(x * 1.5, dim=-1), x.sum(dim=-1)


def _load(model, inputs, dynamic, **kw):
    res = aotfuse.build(model, inputs, targets=["sm_90"], dynamic_shapes=dynamic, **kw)
    return aotfuse.load(res.data, device="cpu"), res


def test_rows_dynamic_match_eager_at_many_shapes():
    torch.manual_seed(0)
    m = NormSoftmax().eval()
    art, _ = _load(m, (torch.randn(3, 5, 100), torch.randn(100)), ["x.0=1..16", "x.1=1..40"])
    y = torch.randn(100)
    for b, t in [(3, 5), (1, 1), (16, 40), (7, 13), (2, 31), (16, 1)]:
        x = torch.randn(b, t, 100)
        torch.testing.assert_close(art(x, y), m(x, y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hi", [300, 5000])  # persistent (RBLOCK covers 512) and looped over r
def test_reduction_length_dynamic(hi):
    """One launch, kernel variants per sub-range of the row length: rows of at most 64, 256, ... held in
    registers with blocks for that length, the rest of the range by the range's own kernel (persistent
    up to 4096, looped beyond); each shape runs the variant of its length."""
    from aotfuse.contract.program import Launch, specialize

    torch.manual_seed(1)
    m = RowSoftmax()
    art, res = _load(m, (torch.randn(4, 50),), [f"x.1=1..{hi}"])
    (launch,) = [i for i in art.programs["forward"].instructions if isinstance(i, Launch)]
    bounds = [c.upto for c in launch.choose if not c.aligned]
    assert bounds == ([64, 256] if hi == 300 else [64, 256, 1024]) and launch.on == "s0"
    # each sub-range also has a twin for a length that is a multiple of 16 (aligned rows), listed first;
    # unaligned rows past 1024 run the range's own kernel
    assert [c.upto for c in launch.choose if c.aligned] == ([64, 256] if hi == 300 else [64, 256, 1024, 4096]) + [2**31 - 1]
    assert all(c.aligned == ("s0",) for c in launch.choose if c.aligned)
    assert art.kernels[launch.kernel].kind == ("looped_reduction" if hi > 4096 else "persistent_reduction")
    assert {art.kernels[c.kernel].rblock for c in launch.choose if c.upto < 2**31 - 1} == set(bounds) | ({4096} if hi > 300 else set())
    case = {(c.upto, bool(c.aligned)): c.kernel for c in launch.choose}
    picked = {n: next(i.kernel for i in specialize(art.programs["forward"], {"s0": n}).instructions
                      if isinstance(i, Launch)) for n in (1, 64, 65, 256, 257, 272)}
    big = 1024 if hi > 300 else 2**31 - 1
    assert picked == {1: case[64, False], 64: case[64, True], 65: case[256, False], 256: case[256, True],
                      257: case[1024, False] if hi > 300 else launch.kernel, 272: case[big, True]}
    for n in [50, 1, 2, 64, 65, 129, 700, 3000, hi, hi - 1]:
        if n > hi:
            continue
        x = torch.randn(4, n)
        got, want = art(x), m(x)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)


def test_gpt_one_archive_many_shapes():
    from aotfuse.examples.gpt import demo

    m, (tok,) = demo(batch=2)
    art, res = _load(m, (tok,), ["tokens.0=1..4", "tokens.1=1..64"])
    assert res.manifest.dims and [d.name for d in res.manifest.dims] == ["tokens.0", "tokens.1"]
    g = torch.Generator().manual_seed(3)
    for b, t in [(2, 64), (1, 1), (4, 64), (3, 17), (1, 63)]:
        x = torch.randint(0, 512, (b, t), generator=g)
        with torch.no_grad():
            want = m(x)
        torch.testing.assert_close(art(x), want, rtol=2e-4, atol=2e-4)


def test_guards_name_input_dim_and_range():
    m = NormSoftmax().eval()
    art, _ = _load(m, (torch.randn(3, 5, 100), torch.randn(100)), ["x.0=1..16", "x.1=2..40"])
    y = torch.randn(100)
    with pytest.raises(GuardError, match=r"x.*1.*41.*2\.\.40"):
        art(torch.randn(3, 41, 100), y)
    with pytest.raises(GuardError, match=r"1"):
        art(torch.randn(3, 1, 100), y)  # below the range's start
    with pytest.raises(GuardError):
        art(torch.randn(3, 5, 99), y)  # a static dim


def test_bad_requests_are_typed_errors_before_tracing():
    m = NormSoftmax()
    x, y = torch.randn(3, 5, 100), torch.randn(100)
    for spec, msg in [(["x.0=1.8"], "INPUT.DIM=LO..HI"), (["z.0=1..8"], "no tensor input 'z'"),
                      (["x.3=1..8"], "no axis 3"), (["x.0=4..8"], "outside 4..8"), (["x.0=5..2"], "empty"),
                      (["x.0=1..8", "x.0=1..9"], "twice")]:
        with pytest.raises(BuildError, match=msg):
            aotfuse.build(m, (x, y), targets=["sm_90"], dynamic_shapes=spec)
    with pytest.raises(BuildError, match="specializes"):
        aotfuse.build(m, (torch.randn(1, 5, 100), y), targets=["sm_90"], dynamic_shapes=["x.0=1..8"])


def test_torch_export_dims_are_accepted():
    from torch.export import Dim

    m = NormSoftmax().eval()
    b = Dim("batch", min=1, max=8)
    art, res = _load(m, (torch.randn(3, 5, 100), torch.randn(100)), {"x": {0: b}, "y": None})
    assert [d.name for d in res.manifest.dims] == ["batch"]
    x, y = torch.randn(6, 5, 100), torch.randn(100)
    torch.testing.assert_close(art(x, y), m(x, y), rtol=1e-5, atol=1e-5)


def test_cli_spelling():
    assert parse_cli(["tokens.1=1..64"]) == (DynamicDim("tokens", 1, 1, 64),)
    with pytest.raises(BuildError):
        parse_cli(["tokens=1..64"])


def test_memory_plan_is_an_expression_of_the_dims():
    """Offsets and the arena are polynomials of the dims (no max), 16-byte aligned at every size, and
    no two buffers alive at once overlap at the range ends."""
    from aotfuse.contract.sizes import evaluate
    from aotfuse.examples.gpt import demo

    m, (tok,) = demo(batch=2)
    res = aotfuse.build(m, (tok,), targets=["sm_90"], dynamic_shapes=["tokens.0=1..4", "tokens.1=1..64"])
    art = aotfuse.load(res.data, device="cpu")
    prog = art.programs["forward"]
    assert isinstance(prog.arena_bytes, str) and "max" not in prog.arena_bytes
    from aotfuse.contract.program import Alloc

    allocs = [i for i in prog.instructions if isinstance(i, Alloc) and i.offset != -1]
    for env in ({"s0": 1, "s1": 1}, {"s0": 4, "s1": 64}, {"s0": 3, "s1": 17}):
        arena = evaluate(prog.arena_bytes, env)
        for a in allocs:
            off = evaluate(a.offset, env)
            n = 1
            for d in a.shape:
                n *= evaluate(d, env)
            assert off % 16 == 0 and off + n * {"float32": 4}.get(a.dtype, 8) <= arena


def test_launch_variants_round_trip_and_are_checked_at_load():
    """Launch.choose/on survive the program encoding; a variant naming no kernel, or taking other
    arguments, is an ArchiveError at load."""
    import dataclasses

    from aotfuse.contract.program import Launch, LaunchCase, Program
    from aotfuse.errors import ArchiveError
    from aotfuse.runtime.validate_dims import _variants

    art, _ = _load(RowSoftmax(), (torch.randn(4, 50),), ["x.1=1..300"])
    prog = art.programs["forward"]
    assert Program.from_dict(prog.to_dict(), "forward") == prog
    (launch,) = [i for i in prog.instructions if isinstance(i, Launch)]
    _variants("here", launch, art.kernels)  # the archive's own: accepted
    bad = dataclasses.replace(launch, choose=(LaunchCase(64, "aotf_missing", launch.grid),))
    with pytest.raises(ArchiveError, match="no kernel"):
        _variants("here", bad, art.kernels)
    other = next(n for n, k in art.kernels.items() if n != launch.kernel)
    kernels = dict(art.kernels)
    kernels[other] = dataclasses.replace(kernels[other], size_args=())
    with pytest.raises(ArchiveError, match="other arguments"):
        _variants("here", launch, kernels)
    d = launch.to_dict()
    d["choose"] = list(reversed(d["choose"]))
    with pytest.raises(ArchiveError, match="increasing"):
        Launch.from_dict(d)


def test_cnn_dynamic_batch_matches_eager():
    """Convolutions (cuDNN externs), BatchNorm, max pool and the classifier with a dynamic batch."""
    from aotfuse.specs import load_spec

    m, ex = load_spec("aotfuse.examples.cnn:cnn")
    ex = tuple(x.contiguous() for x in ex)
    art, _ = _load(m, ex, ["x.0=1..16"])
    for b in (1, 3, 16):
        x = torch.randn(b, *ex[0].shape[1:])
        with torch.no_grad():
            want = m(x)
        torch.testing.assert_close(art(x), want, rtol=1e-4, atol=1e-4)


def test_a_lowering_that_would_fix_a_dim_is_refused(monkeypatch):
    """A rule that reads a dynamic size as a Python int would bake the example's size into the program
    (right at the example, wrong elsewhere): torch's shape environment records the guard, and the build
    refuses the op by name instead."""
    from aotfuse.errors import UnsupportedOpError
    from aotfuse.lower import pool
    from aotfuse.specs import load_spec

    monkeypatch.setattr(pool, "sizes", lambda shape: tuple(int(s) for s in shape))
    m, ex = load_spec("aotfuse.examples.cnn:cnn")
    with pytest.raises(UnsupportedOpError, match="max_pool2d.*fix a dynamic dim"):
        aotfuse.build(m, tuple(x.contiguous() for x in ex), targets=["sm_90"], dynamic_shapes=["x.0=1..16"])


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_transformers_causal_lm_dynamic_batch_and_sequence(name):
    """transformers' Llama (RoPE, GQA, RMSNorm, SwiGLU) and GPT-2 (tiny configs) with a dynamic batch and
    sequence length: one archive, logits vs eager at the range ends and between (the causal mask is
    classified at the example without fixing the length; GQA's expand+reshape, the mask's slices and
    RoPE's gathers take dim expressions)."""
    from aotfuse.testing.zoo import entry, have_transformers

    if not have_transformers():
        pytest.skip("needs transformers")
    ex = entry(name).tiny()
    res = aotfuse.build(ex.model, ex.args, example_kwargs=ex.kwargs, targets=["sm_90"],
                        dynamic_shapes=["input_ids.0=1..8", "input_ids.1=2..32"])
    art = aotfuse.load(res.data, device="cpu")
    g = torch.Generator().manual_seed(2)
    for b, t in ((1, 2), (3, 7), (8, 32), (2, 16)):
        ids = torch.randint(0, 100, (b, t), generator=g)
        with torch.no_grad():
            want = ex.model(input_ids=ids).logits
        torch.testing.assert_close(art(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)


class _Cat(torch.nn.Module):
    def forward(self, x, y):
        return torch.cat([x, y * 2], 1)


class _RowStats(torch.nn.Module):  # an fp32 [s0] intermediate: 4*s0 bytes in the memory plan
    def forward(self, x):
        r = x.sum(-1)
        return (r - r.amax(0)).exp() + x.mean(-1)


class _Shifted(torch.nn.Module):  # x[:, 1:] (s1 - 1 columns) and x[:, ::2] ((s1 + 1) // 2 columns)
    def forward(self, x):
        return (x[:, 1:] * 2).softmax(-1).sum(-1) + torch.softmax(x[:, ::2] * 2, -1).amax(-1)


@pytest.mark.parametrize("case", ["cat", "stats", "shifted"])
def test_review_cases_match_eager(case):
    """Found in review: a concatenation along dynamic dims (the CPU path), a per-row fp32 vector and a mean
    over a dynamic dim (the plan's room and load validation), slices whose sizes are s - 1 and (s + 1) // 2."""
    if case == "cat":
        m, ex, dyn = _Cat(), (torch.randn(3, 5), torch.randn(3, 4)), ["x.1=1..20", "y.1=1..20"]
        shapes = [((3, 7), (3, 2)), ((3, 1), (3, 20)), ((3, 20), (3, 1))]
    elif case == "stats":
        m, ex, dyn = _RowStats(), (torch.randn(5, 3),), ["x.0=2..300", "x.1=1..37"]
        shapes = [((7, 3),), ((300, 37),), ((2, 1),)]
    else:
        m, ex, dyn = _Shifted(), (torch.randn(3, 6),), ["x.1=2..64"]
        shapes = [((3, 7),), ((3, 64),), ((3, 2),)]
    art, _ = _load(m, ex, dyn)
    for sh in shapes:
        xs = [torch.randn(*s) for s in sh]
        torch.testing.assert_close(art(*xs), m(*xs), rtol=1e-5, atol=1e-5)
