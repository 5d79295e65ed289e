"""The matmul template's loop-IR node: a Reduction that codegen emits as a tiled `tl.dot` kernel.

A MatMul is an ordinary sum Reduction to every pass that does not know templates (dependency
analysis, inlining, fusion, memory planning): outer ranges (M, N) or (B, M, N), one reduced range
(K,), and body `mul(lhs, rhs)` with lhs a function of (b, m, k) only and rhs of (b, k, n) only.
Loads carry their full index expressions, so views, transposes and casts of the operands are
prologues (index math and casts in the operand expressions), and pointwise consumers over the same
(M, N) space fuse as epilogues (schedule/templates.py decides what may join a template group;
emit/template_mm.py writes the kernel).
"""
from __future__ import annotations

import dataclasses

import sympy

from .loop import Cast, Expr, Op, Reduction


@dataclasses.dataclass(frozen=True)
class MatMul(Reduction):
    dot_dtype: str  # dtype the operand tiles enter tl.dot in ("bfloat16", "float16", "float32")
    origin: str  # the aten op it came from ("mm", "addmm", "bmm"), for reports
    # the epilogue lowering saw holds many ops (lower/epilogue.epilogue_region; a GELU backward): the tile
    # configuration is one whose epilogue runs in column halves (emit/mm_configs.choose_config)
    heavy_epilogue: bool = False

    @property
    def batched(self) -> bool:
        return len(self.ranges) == 3

    @property
    def mnk(self) -> tuple[int, int, int, int]:
        """(B, M, N, K); B = 1 when not batched."""
        b = int(self.ranges[0]) if self.batched else 1
        return b, int(self.ranges[-2]), int(self.ranges[-1]), int(self.rranges[0])


def _free(e: Expr) -> set:
    """The loop variables an expression's indices use (loads, gathers' base, index values)."""
    from .loop import Gather, IndexValue, Load, expr_leaves

    out: set = set()
    for x in expr_leaves(e):
        if isinstance(x, Load):
            out.update(sympy.sympify(x.index).free_symbols)
        elif isinstance(x, Gather):
            out.update(sympy.sympify(x.base).free_symbols)
        elif isinstance(x, IndexValue):
            out.update(sympy.sympify(x.expr).free_symbols)
    return out


def split_operands(node: MatMul) -> tuple[Expr, Expr] | None:
    """(lhs, rhs) of node's body: lhs reads only (b, m, k), rhs only (b, k, n). None when the body
    is no longer a product of two such operands (codegen then refuses the template)."""
    body = node.body
    while isinstance(body, Cast) and body.dtype == node.acc_dtype:
        body = body.arg
    if not (isinstance(body, Op) and body.op == "mul"):
        return None
    pv = node.pvars
    m, n = pv[-2], pv[-1]
    a, b = body.args
    fa, fb = _free(a), _free(b)
    if n in fa or m in fb:
        a, b, fa, fb = b, a, fb, fa
    if n in fa or m in fb:
        return None
    return a, b


def is_matmul(node) -> bool:
    return isinstance(node, MatMul)
