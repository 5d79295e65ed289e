"""Residual adds fused into the cuBLAS matmul that feeds them: `x + mm(a, b)` and `x + addmm(bias, a, b)`
(through reshapes) become one `aotfuse.mm_residual.out` extern (runtime/mm_residual.py), which cuBLASLt runs
as D = A @ B + C, C the residual with beta 1 and the bias in its BIAS epilogue.

Without it the matmul writes its product, and the add runs in the kernel that reads it next (a
transformer's residual add inside the following LayerNorm, which then reads two tensors and writes two:
the sum and the normalized value). With it the matmul reads the residual as it writes the sum, and that
kernel reads one tensor: one M x N round trip less per residual (the anchor GPT's attention output and MLP
projections, 12.6 MB each at 8 x 1024), where cuBLAS hides the read of C behind its main loop.

This pass only looks at the FX graph a program lowers from (inference, a training forward or backward) and
says which matmuls lower fused; lower/graph.py lowers each chosen matmul with its residual
(lower/extern.py `mm_residual`) and binds the add to the result, the reshapes in between lowering as
always. A site qualifies when
- the add is `aten.add.Tensor` with alpha 1 and no broadcast: the residual has the sum's shape;
- one operand is an mm / addmm result through reshapes only (view, _unsafe_view, reshape, alias,
  (un)squeeze: the row-major order of the M x N product is kept), read by nothing else (the product is then
  never written on its own: a saved tensor, an output or a second reader would need it);
- addmm's alpha and beta are 1 and its bias is one value per column (cuBLASLt's BIAS epilogue);
- every tensor is float32, float16 or bfloat16, one dtype (the sum's too);
- the residual is row-major (it is read as the product's M x N matrix in place) and computed before the
  matmul in the graph (lowering meets it first);
- AOTFUSE_MM_RESIDUAL is on, and the matmul stays a cuBLAS call: always with AOTFUSE_MM=extern, never
  with =template (the template adds the residual in its own epilogue), and with =auto when the cost model
  (schedule/templates.library_epilogue_choice) finds cuBLAS no slower than the template with the same
  epilogue.
Every add fed by a matmul gets a record (fused, or why not) in the lowering decisions `aotfuse explain`
prints.
"""
from __future__ import annotations

import dataclasses

import sympy
import torch
import torch.fx

from ..ir.sizes import sizes
from ..fxgraph import module_path, value
from ..knobs import knobs

aten = torch.ops.aten

# Views that keep the row-major order of their input's elements (a reshape by another name)
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default,
             aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default}
_MATMULS = (aten.mm.default, aten.addmm.default)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Site:
    """One fused residual: `add` == reshape(`mm`) + `residual`; `operand` is the add's argument that
    reshapes the matmul's result (the matmul itself when there is no reshape)."""
    mm: torch.fx.Node
    add: torch.fx.Node
    residual: torch.fx.Node
    operand: torch.fx.Node


def _feeding(x) -> torch.fx.Node | None:
    """The mm / addmm whose result x is through single-reader reshapes, or None."""
    n, depth = x, 0
    while isinstance(n, torch.fx.Node) and n.target in _RESHAPES and depth < 8:
        if len(n.users) != 1:
            return None
        n, depth = n.args[0], depth + 1
    if isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in _MATMULS:
        return n
    return None



def _same(a, b) -> bool:
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def _row_major(val) -> bool:
    shape, stride = sizes(val.shape), sizes(val.stride())
    want = 1
    for d, s in zip(reversed(shape), reversed(stride)):
        if not _same(d, 1) and not _same(s, want):
            return False
        want = sympy.sympify(want) * sympy.sympify(d)
    return True



def refusal(add: torch.fx.Node, mm: torch.fx.Node, operand: torch.fx.Node, residual, order: dict) -> str | None:
    """Why this add cannot be fused into the matmul feeding `operand`, or None (the cost model aside)."""
    if add.kwargs.get("alpha", 1) != 1 or len(add.args) > 2:
        return "add with alpha other than 1"
    if len(mm.users) != 1:
        others = sorted("an output" if u.op == "output" else u.name for u in mm.users if u is not operand)
        return f"the matmul's result is also read by {', '.join(others[:3])}: it must be written anyway"
    if mm.target is aten.addmm.default and any(mm.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
        return "addmm with alpha or beta other than 1"
    if not isinstance(residual, torch.fx.Node):
        return "the other operand is a scalar"
    vals = [value(x) for x in (add, residual, mm, *mm.args[:3])]
    if any(v is None or not isinstance(v, torch.Tensor) for v in vals):
        return "an operand is not a tensor"
    dts = {v.dtype for v in vals}
    if len(dts) != 1 or next(iter(dts)) not in _DTYPES:
        names = sorted(str(d).removeprefix("torch.") for d in dts)
        return f"dtypes {names} (fused: one of float32, float16, bfloat16)"
    out, res, prod = vals[0], vals[1], vals[2]
    if len(res.shape) != len(out.shape) or not all(_same(a, b) for a, b in zip(sizes(res.shape), sizes(out.shape))):
        return f"the residual {list(res.shape)} broadcasts to the sum {list(out.shape)}"
    opv = value(operand)
    if opv is None or len(opv.shape) != len(out.shape) or \
            not all(_same(a, b) for a, b in zip(sizes(opv.shape), sizes(out.shape))):
        return (f"the product {list(opv.shape) if opv is not None else '?'} broadcasts to the sum {list(out.shape)} "
                "(the matmul would write one element per output)")
    if mm.target is aten.addmm.default:
        bias = vals[3]
        if len(bias.shape) != 1 or not _same(sizes(bias.shape)[0], sizes(prod.shape)[1]):
            return f"bias of shape {list(bias.shape)} is not one value per output column"
    if not _row_major(res):
        return "the residual is not row-major (read in place as the product's matrix)"
    if residual is mm or order[residual] > order[mm]:
        return "the residual is computed after the matmul"
    return None


def _auto_keeps_library(mm: torch.fx.Node) -> tuple[bool, str]:
    from ..schedule.templates import library_epilogue_choice

    prod, a = value(mm), value(mm.args[-2])
    dims = (a.shape[0], prod.shape[1], a.shape[1])
    if not all(type(d) is int for d in dims):
        return True, "dynamic sizes: cuBLAS chooses its kernel per shape at run time"
    m, n, k = (int(d) for d in dims)
    what = "the bias and the residual" if mm.target is aten.addmm.default else "the residual"
    return library_epilogue_choice(m, n, k, str(prod.dtype).removeprefix("torch."), what)


def sites(gm: torch.fx.GraphModule) -> tuple[dict[torch.fx.Node, Site], list[dict]]:
    """The matmuls that lower with their residual add (keyed by the mm node), and a record per add fed by
    a matmul."""
    from ..schedule.templates import mode

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    chosen: dict[torch.fx.Node, Site] = {}
    records: list[dict] = []
    md = mode()
    for add in gm.graph.nodes:
        if add.op != "call_function" or add.target is not aten.add.Tensor or len(add.args) < 2:
            continue
        cands = [(x, r, _feeding(x)) for x, r in ((add.args[0], add.args[1]), (add.args[1], add.args[0]))]
        cands = [(x, r, mm) for x, r, mm in cands if mm is not None and mm not in chosen]
        if not cands:
            continue
        why, site = None, None
        for x, r, mm in cands:
            why = refusal(add, mm, x, r, order)
            if why is None:
                site = Site(mm, add, r, x)
                break
        mm = site.mm if site is not None else cands[0][2]
        rec = {"mm_residual": add.name, "producer": module_path(mm) or mm.name, "fused": False}
        if site is not None:
            if not knobs.mm_residual:
                why = "AOTFUSE_MM_RESIDUAL=0"
            elif md == "template":
                why = f"AOTFUSE_MM={md}: a matmul template adds the residual in its own epilogue"
            elif md == "auto":
                keep, cost = _auto_keeps_library(mm)
                why = None if keep else cost
                if keep:
                    rec["cost"] = cost
        if site is None or why is not None:
            records.append({**rec, "why": why})
            continue
        chosen[mm] = site
        records.append({**rec, "fused": True, "why": "cuBLASLt reads the residual as C (beta 1) as it writes the sum"
                        + (", the bias in its epilogue" if mm.target is aten.addmm.default else "")
                        + ": the product is never written on its own"
                        + (f"; {rec.pop('cost')}" if "cost" in rec else "")})
    return chosen, records
