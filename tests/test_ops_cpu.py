"""Op tier: each case of the op table (aotfuse/testing/opcases.py) built to an archive, run on the CPU path
(Triton interpreter) with fresh random inputs, and compared with eager. Plus: the table covers the
lowering registry, unsupported ops fail naming the op and the node, and docs/ops.md is current."""
from __future__ import annotations

import math

import importlib.util
import pathlib
import zlib

import pytest
import torch

import aotfuse
from aotfuse import pipeline
from aotfuse.testing import opcases
from aotfuse.export.decomp import decomposition_table
from aotfuse.knobs import override
from aotfuse.testing.opcases import CASES, UNTESTED, Fn
from aotfuse.lower import registry

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGETS = ("sm_90",)
# Relative-norm error (or allclose with rtol = atol = this) against eager, by dtype.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# Triton's interpreter evaluates masked-off lanes and both sides of a tl.where: numpy warns, harmlessly.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

PARAMS = [pytest.param(c, dt, id=f"{c.name}-{_short(dt)}",
                       marks=[pytest.mark.xfail(strict=True, reason=c.known_issue)] if c.known_issue else [])
          for c in CASES for dt in c.dtypes]


def _seed(name: str, k: int) -> int:
    return zlib.crc32(f"{name}/{k}".encode())


def _flat(x) -> list:
    return [t for v in x for t in _flat(v)] if isinstance(x, (tuple, list)) else [x]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _compare(out: torch.Tensor, ref: torch.Tensor, tol: float) -> str | None:
    """None when out matches ref, else what differs."""
    if out.dtype != ref.dtype or out.shape != ref.shape:
        return f"got {out.dtype} {tuple(out.shape)}, eager gives {ref.dtype} {tuple(ref.shape)}"
    if not ref.is_floating_point():
        bad = (out != ref).sum().item()
        return None if bad == 0 else f"{bad} of {ref.numel()} elements differ (exact match expected)"
    nan_out, nan_ref = out.isnan(), ref.isnan()
    if not torch.equal(nan_out, nan_ref):
        return f"NaN at {int((nan_out != nan_ref).sum())} positions where eager differs"
    out, ref = out[~nan_ref], ref[~nan_ref]
    if torch.allclose(out.double(), ref.double(), rtol=tol, atol=tol):
        return None
    err = rel_err(out, ref)
    if err <= tol:
        return None
    worst = (out.double() - ref.double()).abs().max().item()
    return f"relative-norm error {err:.2e} > {tol:.0e} (max abs diff {worst:.3e})"


@pytest.fixture
def exported_ops(monkeypatch):
    """The aten overloads in the graph each build exported (spies on the pipeline's export stage)."""
    seen: list[set[str]] = []
    real = pipeline.capture

    def spy(*args, **kwargs):
        cg = real(*args, **kwargs)
        seen.append({str(n.target) for n in cg.gm.graph.nodes if n.op == "call_function"})
        return cg
    monkeypatch.setattr(pipeline, "capture", spy)
    return seen


@pytest.mark.parametrize("case,dtype", PARAMS)
def test_op_matches_eager_on_cpu(case, dtype, exported_ops, request):
    repro = (f"repro: python -m pytest -q 'tests/test_ops_cpu.py::{request.node.name}' "
             f"(case {case.name!r} in aotfuse/testing/opcases.py)")
    torch.manual_seed(_seed(case.name, 0))
    model, example = case.make(dtype)
    with override(**dict(case.knobs)):
        res = aotfuse.build(model, example, targets=TARGETS)
    missing = set(case.aten_ops) - exported_ops[-1]
    assert not missing, f"the exported graph lacks {sorted(missing)} (has {sorted(exported_ops[-1])}); {repro}"

    art = aotfuse.load(res.data, device="cpu")
    for k in art.kernels.values():
        assert set(k.binaries) == set(TARGETS), repro
    if dict(case.knobs).get("persistent_rblock_max"):
        kinds = {k.kind for k in art.kernels.values()}
        assert "looped_reduction" in kinds, f"expected a looped reduction kernel, got {kinds}; {repro}"

    torch.manual_seed(_seed(case.name, 1))
    _, fresh = case.make(dtype)
    assert any(not torch.equal(x, e) for x, e in zip(fresh, example)), "fresh inputs equal the example ones"
    out = art(*fresh)
    with torch.no_grad():
        ref = model(*fresh)
    outs, refs = _flat(out), _flat(ref)
    assert len(outs) == len(refs), f"{len(outs)} outputs, eager gives {len(refs)}; {repro}"
    for i, (o, r) in enumerate(zip(outs, refs)):
        tol = max(TOL[dtype], TOL.get(r.dtype, 0.0))
        why = _compare(o, r, tol)
        assert why is None, f"{case.name} [{_short(dtype)}] output {i}: {why}; {repro}"


def test_rand_is_uniform_fresh_per_call_and_follows_torch_seed():
    """The op table can only check functions of rand that do not depend on its values; check those here."""
    res = aotfuse.build(Fn(lambda x: torch.rand_like(x) + x * 0), (torch.randn(40, 50),), targets=TARGETS)
    art = aotfuse.load(res.data, device="cpu")
    x = torch.randn(40, 50)
    a, b = art(x), art(x)
    assert ((a >= 0) & (a < 1)).all() and abs(a.mean().item() - 0.5) < 0.03 and abs(a.var().item() - 1 / 12) < 0.01
    assert not torch.equal(a, b), "two calls drew the same numbers"
    torch.manual_seed(7)
    c = art(x)
    torch.manual_seed(7)
    assert torch.equal(c, art(x)), "torch.manual_seed does not make the draws repeat"


def test_exponential_has_its_distribution_and_is_fresh_per_call():
    """exponential_(lambd) on an empty tensor: mean 1/lambd, variance 1/lambd^2, never negative or infinite; new
    draws each call, repeated under torch.manual_seed (the op table checks only functions of it that do not depend
    on the values)."""
    res = aotfuse.build(Fn(lambda x: torch.empty_like(x).exponential_(2.0) + x * 0), (torch.randn(100, 100),),
                        targets=TARGETS)
    art = aotfuse.load(res.data, device="cpu")
    x = torch.randn(100, 100)
    a, b = art(x), art(x)
    assert torch.isfinite(a).all() and (a >= 0).all()
    assert abs(a.mean().item() - 0.5) < 0.02 and abs(a.var().item() - 0.25) < 0.02
    assert abs((a > 1.0).float().mean().item() - math.exp(-2.0)) < 0.01  # the tail: P(e > 1) = exp(-lambd)
    assert not torch.equal(a, b)
    torch.manual_seed(3)
    c = art(x)
    torch.manual_seed(3)
    assert torch.equal(c, art(x))


def test_uniform_stays_below_its_upper_end_in_bf16():
    """uniform_(-1, 1) in bf16: a draw that rounds up to 1 in bf16 is -1 instead (torch's range is [from, to))."""
    res = aotfuse.build(Fn(lambda x: torch.empty_like(x).uniform_(-1.0, 1.0) + x * 0),
                        (torch.randn(256, 256, dtype=torch.bfloat16),), targets=TARGETS)
    art = aotfuse.load(res.data, device="cpu")
    a = art(torch.randn(256, 256, dtype=torch.bfloat16))
    assert a.dtype == torch.bfloat16 and bool((a >= -1).all()) and bool((a < 1).all())
    assert abs(a.float().mean().item()) < 0.02


# ---------------------------------------------------------------- the table covers the registry

def _registered() -> dict[str, object]:
    return {info.op: op for op, info in registry().items()}


def test_every_registered_op_is_covered_or_excused():
    registered = set(_registered())
    covered = set(opcases.covered_ops())
    assert not covered - registered, f"cases name ops that are not registered: {sorted(covered - registered)}"
    assert not set(UNTESTED) - registered, f"UNTESTED names unregistered ops: {sorted(set(UNTESTED) - registered)}"
    assert not set(UNTESTED) & covered, f"ops both covered and excused: {sorted(set(UNTESTED) & covered)}"
    missing = registered - covered - set(UNTESTED)
    assert not missing, (f"registered ops no case exercises: {sorted(missing)}; add a case to aotfuse/testing/opcases.py "
                         "or list it in UNTESTED with a reason")
    assert all(c.dtypes and c.dtypes[0] == torch.float32 for c in CASES), "every case runs in float32"


def test_untested_reasons_hold():
    """Each excuse is checked against torch: the op really never reaches lowering from a model."""
    table = decomposition_table()
    ops = _registered()
    for name, (kind, why) in UNTESTED.items():
        op = ops[name]
        if kind == opcases.DECOMPOSED:
            assert op in table, f"{name}: said to be decomposed ({why}) but the table keeps it"
        elif kind == opcases.IMPLICIT:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"), \
                f"{name}: said to be CompositeImplicitAutograd ({why}) but it is not"
        elif kind == opcases.REWRITTEN:
            from aotfuse.export.capture import capture

            cg = capture(Fn(lambda x: op(x) * 2), (torch.randn(3, 5),))
            targets = {n.target for n in cg.gm.graph.nodes}
            assert op not in targets, f"{name}: said to be rewritten by export ({why}) but the graph has it"
        elif kind == opcases.BACKWARD:
            assert op.name().endswith("_backward"), f"{name}: said to be a backward op ({why})"
        elif kind == opcases.TRAIN:
            assert any(name in c.aten_ops for c in opcases.TRAIN_CASES), f"{name}: no train case builds it ({why})"
        else:
            pytest.fail(f"{name}: unknown UNTESTED kind {kind!r}")


# ---------------------------------------------------------------- unsupported ops

@pytest.mark.parametrize("u", opcases.UNSUPPORTED + opcases.REFUSED, ids=lambda u: u.name)
def test_unsupported_op_raises_naming_op_and_node(u):
    registered = u.op in _registered()
    assert registered == (u in opcases.REFUSED), \
        f"{u.op} is {'now' if registered else 'not'} registered: move {u.name!r} between UNSUPPORTED and REFUSED"
    with pytest.raises(aotfuse.UnsupportedOpError) as ei:
        aotfuse.build(Fn(u.fn), (torch.randn(4, 6),), targets=TARGETS)
    err = ei.value
    assert (err.op, err.node) == (u.op, u.node), str(err)
    assert f"unsupported op {u.op} at node {u.node!r}" in str(err), str(err)
    assert err.remedy, str(err)


# ---------------------------------------------------------------- docs/ops.md

def _doc_generator():
    spec = importlib.util.spec_from_file_location("gen_ops_doc", ROOT / "scripts" / "gen_ops_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ops_doc_is_current():
    doc = (ROOT / "docs" / "ops.md").read_text()
    assert doc == _doc_generator().render(), "docs/ops.md is stale: run python scripts/gen_ops_doc.py"
