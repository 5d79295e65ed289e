"""A tanh GELU fused into the matmul that feeds it (inference): addmm -> views -> gelu(approximate="tanh")
becomes `aten._addmm_activation(bias, mat1, mat2, use_gelu=True)` -> views, one extern whose GELU
cuBLASLt applies as it writes the result (the GELU_BIAS epilogue, runtime/cublaslt.py): the GELU
kernel and its read and write of the whole activation are gone (the anchor GPT's MLP: 48 MiB each way
per layer at 8 x 1024).

At export, because our decomposition table (export/decomp.py) turns gelu into a dozen pointwise ops:
`decompose` first looks at the exported graph; only when a tanh GELU there is fed (through views) by a
matmul with a bias does it decompose with gelu kept whole, rewrite each GELU that qualifies, and then
decompose the rest (the GELUs left, as always). When none qualifies it decomposes the exported graph
once, as before; a graph without such a GELU takes exactly the one decomposition it always took.

A GELU qualifies when
- its approximation is tanh: cuBLASLt's GELU epilogue computes that one (an erf GELU would change);
- its input is the addmm's result through views only, and nothing else reads the result or a view of it
  (the pre-activation is then never written: a saved tensor, an output or a residual would need it);
- the addmm is alpha = beta = 1 over float32 / float16 / bfloat16 operands of one dtype, with a bias of
  one value per output column (the row vector the epilogue adds);
- AOTFUSE_MM_GELU is on, and the matmul stays a cuBLAS call: always with AOTFUSE_MM=extern, never with
  =template (the template fuses its epilogue itself), and with =auto when the cost model
  (schedule/templates.gelu_epilogue_choice) finds cuBLASLt with the epilogue no slower than the template
  with the same epilogue (static shapes; a dynamic one keeps cuBLAS, which the template lowering would).
Every GELU fed by a biased matmul gets a record (fused, or why not) in the lowering decisions that
`aotfuse explain` prints. Training's joint graph never comes here (joint/trace.py): GELU's backward
reads the pre-activation, which the fused call does not write.
"""
from __future__ import annotations

import torch
import torch.fx

from ..fxgraph import module_path, value
from ..knobs import knobs
from .gelu_formula import recognize

aten = torch.ops.aten

# Views a GELU commutes with (it is elementwise): gelu(view(x)) == view(gelu(x)).
_VIEWS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default, aten.clone.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.permute.default,
    aten.transpose.int, aten.t.default,
}
_MATMULS = (aten.addmm.default, aten.linear.default)  # linear: the exported graph's, before decomposition
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ERF_WHY = "approximate='none': cuBLASLt's GELU epilogue is the tanh approximation, the erf GELU would change"


def _approximate(gelu: torch.fx.Node) -> str:
    return gelu.kwargs.get("approximate", gelu.args[1] if len(gelu.args) > 1 else "none")


def _feeding(gelu: torch.fx.Node) -> tuple[torch.fx.Node | None, list[torch.fx.Node]]:
    """The biased matmul whose result gelu reads through views, and those views (producer first)."""
    chain, n = [], gelu.args[0] if gelu.args else None
    while isinstance(n, torch.fx.Node) and n.target in _VIEWS and len(chain) < 8:
        chain.append(n)
        n = n.args[0]
    if not isinstance(n, torch.fx.Node) or n.target not in _MATMULS:
        return None, []
    if n.target is aten.linear.default and (len(n.args) < 3 or n.args[2] is None):
        return None, []  # no bias: lowers to mm
    return n, chain[::-1]


def _sites(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, torch.fx.Node, list[torch.fx.Node]]]:
    """(gelu, matmul, views) for each GELU fed by a biased matmul, in graph order."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.gelu.default:
            mm, chain = _feeding(n)
            if mm is not None:
                out.append((n, mm, chain))
    return out



def _record(gelu, mm, fused: bool, why: str) -> dict:
    # "producer", not "matmul": that key marks schedule/templates.py's records, which tests and tools count
    return {"mm_gelu": gelu.name, "producer": module_path(mm) or mm.name, "approximate": _approximate(gelu),
            "fused": fused, "why": why}



def refusal(gelu: torch.fx.Node, mm: torch.fx.Node, chain: list[torch.fx.Node]) -> str | None:
    """Why this GELU (of a decomposed graph: mm is an addmm) cannot be fused, or None."""
    if _approximate(gelu) != "tanh":
        return ERF_WHY
    others = sorted({"an output" if u.op == "output" else u.name
                     for n, nxt in zip([mm] + chain, chain + [gelu]) for u in n.users if u is not nxt})
    if others:
        return (f"the matmul's result is also read by {', '.join(others[:3])}: the pre-activation must be "
                "written anyway")
    if any(mm.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
        return "addmm with alpha or beta other than 1"
    bias, a, b = mm.args[:3]
    vals = [value(x) for x in (bias, a, b, mm, gelu)]
    if any(v is None or not hasattr(v, "dtype") for v in vals):
        return "an operand is not a tensor"
    dts = {v.dtype for v in vals}
    if len(dts) != 1 or next(iter(dts)) not in _DTYPES:
        names = sorted(str(d).removeprefix("torch.") for d in dts)
        return f"dtypes {names} (fused: one of float32, float16, bfloat16)"
    if len(vals[0].shape) != 1 or vals[0].shape[0] != vals[3].shape[1]:
        return (f"bias of shape {list(vals[0].shape)} is not one value per output column (the epilogue adds a "
                "row vector)")
    return None


def _mode() -> str:
    from ..schedule.templates import mode

    return mode()


def _auto_choice(mm: torch.fx.Node) -> tuple[bool, str]:
    """AOTFUSE_MM=auto: keep this matmul on cuBLAS with the GELU epilogue? (the cost model's answer, why)."""
    from ..schedule.templates import gelu_epilogue_choice

    a, out = value(mm.args[1]), value(mm)
    dims = (a.shape[0], out.shape[1], a.shape[1]) if a is not None and out is not None else ()
    if not dims or not all(type(d) is int for d in dims):
        return True, "dynamic sizes: cuBLAS chooses its kernel per shape at run time"
    m, n, k = (int(d) for d in dims)
    return gelu_epilogue_choice(m, n, k, str(out.dtype).removeprefix("torch."))


def fuse(gm: torch.fx.GraphModule) -> tuple[int, list[dict]]:
    """Rewrite each qualifying GELU of a graph decomposed with gelu kept whole; (how many, the records)."""
    records, n = [], 0
    g = gm.graph
    for gelu, mm, chain in _sites(gm):
        why = refusal(gelu, mm, chain)
        if why is not None:
            records.append(_record(gelu, mm, False, why))
            continue
        cost = ""
        if _mode() == "auto":
            keep, cost = _auto_choice(mm)
            if not keep:
                records.append(_record(gelu, mm, False, cost))
                continue
            cost = f"; {cost}"
        records.append(_record(gelu, mm, True, "cuBLASLt adds the bias and applies the GELU as it writes the "
                                               "result (GELU_BIAS epilogue): no GELU kernel, no pre-activation"
                                + cost))
        with g.inserting_before(mm):
            fused = g.call_function(aten._addmm_activation.default, tuple(mm.args[:3]), {"use_gelu": True})
        fused.meta.update(mm.meta)  # same shape, dtype and strides as the addmm's result
        mm.replace_all_uses_with(fused)
        g.erase_node(mm)
        gelu.replace_all_uses_with(gelu.args[0])
        g.erase_node(gelu)
        n += 1
    if n:
        g.lint()
        gm.recompile()
    return n, records


def decompose(ep, table: dict):
    """`ep.run_decompositions(table)` with qualifying tanh GELUs fused into their matmuls:
    (the decomposed program, the decision records). First, a tanh GELU written as its formula becomes a gelu
    (export/gelu_formula.py: GPT-2's gelu_new)."""
    formula = recognize(ep.graph_module) if knobs.gelu_formula else []  # in place: ep's own graph module
    sites = _sites(ep.graph_module)
    tanh = [s for s in sites if _approximate(s[0]) == "tanh"]
    why = None
    if not knobs.mm_gelu:
        why = "AOTFUSE_MM_GELU=0"
    elif _mode() == "template":
        why = f"AOTFUSE_MM={knobs.mm}: a matmul template fuses its epilogue itself"
    if not tanh or why is not None:
        records = [_record(gelu, mm, False, ERF_WHY if _approximate(gelu) != "tanh" else why)
                   for gelu, mm, _ in sites]
        return ep.run_decompositions(table), formula + records
    kept = {op: fn for op, fn in table.items() if op is not aten.gelu.default}
    first = ep.run_decompositions(kept)
    n, records = fuse(first.graph_module)
    if not n:  # nothing qualified: the one decomposition of the exported graph, as without this pass
        return ep.run_decompositions(table), formula + records
    return first.run_decompositions(table), formula + records
