"""A mixture of experts run grouped (transformers' default `grouped_mm` experts): tokens sorted by expert, counted
per expert (aten.histc), the counts' cumulative sum as group offsets, and one grouped matmul per projection.

Every shape is the tokens' or the experts' (no data-dependent size), so the program keeps static buffers and a
CUDA graph: the histogram is torch's kernel, the grouped matmul aotfuse::grouped_mm (runtime/grouped_mm.py).
export/experts.py rewrites transformers' float32 fallback op and its backward into aotfuse::grouped_mm first.
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedOpError
from ..runtime.grouped_mm import grouped_mm
from .ctx import out_dtype, out_shape
from .extern import _targ
from .rules import collector

aten = torch.ops.aten
RULES: list = []
rule = collector(RULES)


@rule(aten.histc.default, category="extern",
      note="torch's kernel, its result bound as the buffer (tokens counted per expert: MoE group sizes)")
def _histc(ctx, node, args, kwargs):
    x = _targ(ctx, args[0], node, "self")
    bins = int(args[1] if len(args) > 1 else kwargs.get("bins", 100))
    lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
    hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
    if lo == hi:
        # torch then takes the range from the data (a host-side min and max): not a program's fixed call
        raise UnsupportedOpError(str(node.target), node.name, "histc with min == max (the range read from the "
                                 "data)", remedy="pass the range: torch.histc(x, bins, min=lo, max=hi)")
    return ctx.extern("aten.histc.default", (x, bins, lo, hi), {}, out_shape(node), out_dtype(node), False)


@rule(aten._grouped_mm.default, grouped_mm, category="extern",
      note="aotfuse::grouped_mm: [S, K] @ [E, K, N] by group offsets (MoE experts) and its weight gradient "
           "[M, S] @ [S, N] -> [E, M, N]; torch._grouped_mm on CUDA in bf16")
def _grouped(ctx, node, args, kwargs):
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    bias = args[3] if len(args) > 3 else kwargs.get("bias")
    out_dt = args[4] if len(args) > 4 else kwargs.get("out_dtype")
    dt = out_dtype(node)
    if bias is not None:
        raise UnsupportedOpError(str(node.target), node.name, "a grouped matmul with a bias",
                                 remedy="add the bias after the call (transformers does)")
    if out_dt is not None and getattr(a, "dtype", None) != dt:
        raise UnsupportedOpError(str(node.target), node.name, f"a grouped matmul with out_dtype {out_dt} "
                                 f"(operands {getattr(a, 'dtype', '?')})", remedy="cast the result instead")
    ta, tb = _targ(ctx, a, node, "mat_a"), _targ(ctx, b, node, "mat_b")
    if offs is None:
        if len(ta.shape) == 3 and len(tb.shape) == 3:  # one matmul per group, all groups alike: a bmm
            return ctx.extern("aten.bmm.out", (ta, tb), {}, out_shape(node), dt, True)
        raise UnsupportedOpError(str(node.target), node.name,
                                 f"a grouped matmul of {len(ta.shape)}-D by {len(tb.shape)}-D without offsets")
    if not (len(ta.shape) == 2 and len(tb.shape) in (2, 3)):
        raise UnsupportedOpError(str(node.target), node.name, f"a grouped matmul of {len(ta.shape)}-D by "
                                 f"{len(tb.shape)}-D operands with offsets (2-D by 3-D and 2-D by 2-D are)")
    to = _targ(ctx, offs, node, "offs")
    groups = int(to.shape[0])
    form = f"{list(ta.shape)} by {list(tb.shape)}" + (" (weight gradient)" if len(tb.shape) == 2 else "")
    ctx.decisions.append({"grouped_mm": node.name, "form": form, "groups": groups, "dtype": dt, "why": (
        "torch's grouped kernel on sm_90/sm_100 in bf16; elsewhere on CUDA one matmul per (chunk, group) pair of "
        f"the sorted rows cut into {groups} chunks (about twice a grouped kernel's arithmetic, no host sync); on the "
        "CPU one mm per group")})
    return ctx.extern("aotfuse.grouped_mm.default", (ta, tb, to), {}, out_shape(node), dt, False)


def register_all(register) -> None:
    """Files this module's rules in the registry (called once, by registry.build, in a fixed order)."""
    for r in RULES:
        register(*r.ops, category=r.category, note=r.note)(r.fn)
