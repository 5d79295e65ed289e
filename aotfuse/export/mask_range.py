"""An attention mask of dynamic size, known for every size in range from one evaluation at the range's end.

transformers builds its causal mask from positions (`arange`), their differences and running sums (packed
sequences), gathers and comparisons. With dynamic dims the mask's size is a dim, so export/masks.py cannot
classify it from its value at the example: a sliding window wider than the example looks causal there.

But when no op of the mask's subgraph lets a size change an element's value, the mask at any size is the
top-left corner of the mask at the largest size (it is *prefix-consistent*): `arange(S)[j] = j` for every S,
an `expand` or `unsqueeze` only repeats, a `cumsum` or `diff` along j reads positions <= j, a gather reads what
its index says, a pointwise op combines equal elements. Sizes may then only say how long things are (an
arange's end, an expand's sizes, a slice's end), never enter a value (`arange(S) - S`), and a slice may not
count from the end. The patterns masks.py turns into flags are prefix-consistent themselves (tril(ones(L, S))
restricted is tril; a window of W keys restricted is that window, or plain causal below W), so the
classification of the largest mask holds at every size in range.

`value_at_range_end(mask)` checks the subgraph op by op against that rule (`_consistent`), then evaluates it
with every dynamic dim at its upper end (the shape environment's ranges). Anything it does not know is refused
with the op named: the mask then stays, computed per call.
"""
from __future__ import annotations

import operator

import sympy
import torch
import torch.fx

from .fold import _map

aten = torch.ops.aten

# ops whose element at an index reads their inputs at index-determined places (besides the pointwise ones)
_STRUCTURAL = {
    aten.unsqueeze.default, aten.expand.default, aten.permute.default, aten.transpose.int, aten.squeeze.dim,
    aten.squeeze.dims, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default, aten.index.Tensor,
    aten.cumsum.default, aten.diff.default, aten.slice.Tensor, aten.select.int, aten.to.dtype_layout,
    aten.to.dtype, aten._to_copy.default, aten.cat.default, aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor,
    aten.view.default, aten.reshape.default, aten._unsafe_view.default,
}
_MAKERS = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.new_ones.default,
           aten.new_zeros.default, aten.new_full.default, aten.ones.default, aten.zeros.default, aten.full.default,
           aten.scalar_tensor.default}


def _is_size(n) -> bool:
    """A node whose value is a size (an int, a SymInt), not a tensor."""
    return isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), (int, torch.SymInt))


def _sizes_in(x) -> bool:
    if isinstance(x, (list, tuple)):
        return any(_sizes_in(a) for a in x)
    return _is_size(x)


def _unit_free(shape) -> list:
    return [d for d in shape if not (isinstance(d, int) and d == 1)]


def _consistent(n: torch.fx.Node) -> str | None:
    """Why `n` could make an element depend on a size (None: it cannot). See the module doc."""
    t = n.target
    args = list(n.args)
    if t is aten.sym_size.int:
        return None
    if t in (operator.add, operator.mul, operator.sub, operator.floordiv):  # sizes computed from sizes
        return None if all(_is_size(a) or isinstance(a, int) for a in args) else f"{t.__name__} of a tensor"
    if not isinstance(t, torch._ops.OpOverload) or t.namespace != "aten":
        return f"{t}: not an ATen op"
    if t in _MAKERS:
        if t is aten.arange.start or t is aten.arange.start_step:
            if _is_size(args[0]) or (t is aten.arange.start_step and _sizes_in(args[2:3])):
                return f"{t}: a size as its start or step"
        if t in (aten.new_full.default, aten.full.default) and _sizes_in(args[-1:]):
            return f"{t}: a size as its fill value"
        if t is aten.scalar_tensor.default and _sizes_in(args[:1]):
            return f"{t}: a size as its value"
        return None
    if t in _STRUCTURAL:
        if t is aten.slice.Tensor:
            start = args[2] if len(args) > 2 else 0
            step = args[4] if len(args) > 4 else 1
            if start is None:
                start = 0
            if not (isinstance(start, int) and start >= 0 and step == 1):
                return "slice counting from the end, by a size or with a step"
        elif t is aten.select.int:
            if not (isinstance(args[2], int) and args[2] >= 0):
                return "select counting from the end or at a size"
        elif t is aten.diff.default:  # diff(self, n, dim, prepend, append): an appended tensor moves with the end
            if (len(args) > 4 and args[4] is not None) or n.kwargs.get("append") is not None:
                return "diff with an appended tensor"
        elif t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            src, out = args[0].meta.get("val"), n.meta.get("val")
            if src is None or out is None or _unit_free(src.shape) != _unit_free(out.shape):
                return f"{t} that does more than add or drop dims of one"
            return None
        elif t is aten.expand.default:
            return None
        elif t is aten.cat.default:  # a part's elements move by the lengths of the parts before it: fixed ones
            dim = args[1] if len(args) > 1 else n.kwargs.get("dim", 0)
            parts = [a.meta.get("val") for a in args[0]]
            if any(p is None for p in parts) or any(not isinstance(p.shape[dim], int) for p in parts[:-1]
                                                    if p.dim()):
                return "cat after a part whose length is a size"
            return None
        elif _sizes_in(args[1:]) or _sizes_in(list(n.kwargs.values())):
            return f"{t} with a size among its arguments"
        return None
    if torch.Tag.pointwise in t.tags:
        if _sizes_in(args) or _sizes_in(list(n.kwargs.values())):
            return f"{t} with a size as a value"
        return None
    return f"{t} (its elements may depend on the sizes)"


def _upper(s) -> int | None:
    """A size at the upper end of its dims' ranges (the shape environment's), or None if one is unbounded."""
    if isinstance(s, int):
        return s
    node = getattr(s, "node", None)
    env = getattr(node, "shape_env", None)
    if env is None:
        return None
    expr = node.expr
    sub = {}
    for sym in expr.free_symbols:
        vr = env.var_to_range.get(sym)
        hi = getattr(vr, "upper", None)
        if hi is None or not getattr(hi, "is_finite", True) or hi in (sympy.oo, int(1e18)):
            return None
        try:
            sub[sym] = int(hi)
        except (TypeError, ValueError):
            return None
    try:
        return int(expr.subs(sub))
    except (TypeError, ValueError):
        return None


def shape_at_range_end(shape) -> tuple[int, ...] | None:
    out = []
    for d in shape:
        v = _upper(d)
        if v is None:
            return None
        out.append(v)
    return tuple(out)


def value_at_range_end(mask: torch.fx.Node, seeds: dict, limit: int) -> tuple[torch.Tensor | None, str]:
    """(the mask with every dynamic dim at its upper end, "") when its subgraph is prefix-consistent and depends
    only on sizes and `seeds` (fixed buffers: placeholder name -> tensor); else (None, why)."""
    mval = mask.meta.get("val")
    end = shape_at_range_end(mval.shape) if mval is not None else None
    if end is None:
        return None, "a dim of the mask has no upper end"
    numel = 1
    for d in end:
        numel *= d
    if numel > limit:
        return None, f"{numel} elements at the range's end: not evaluated at build time"
    order, stack, seen = [], [mask], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n.name not in seeds:
                return None, f"the mask reads input {n.name!r}"
            continue
        if n.op != "call_function":
            return None, f"{n.op} {n.name}"
        why = _consistent(n)
        if why:
            return None, f"{n.name}: {why}"
        order.append(n)
        if n.target is not aten.sym_size.int:  # a size of an input: its value is the range's end, not the input
            stack.extend(n.all_input_nodes)
    pos = {n: i for i, n in enumerate(mask.graph.nodes)}
    env: dict = {n: seeds[n.name].detach().cpu() for n in seen if n.op == "placeholder"}
    for n in sorted(order, key=pos.__getitem__):
        if n.target is aten.sym_size.int:
            v = _upper(n.meta.get("val"))
            if v is None:
                return None, f"{n.name}: a size with no upper end"
            env[n] = v
            continue
        kwargs = {k: (torch.device("cpu") if k == "device" and v is not None else v)
                  for k, v in _map(dict(n.kwargs), env).items()}
        args = _map(n.args, env)
        if n.target is aten.index.Tensor and any(isinstance(i, torch.Tensor) and i.numel() and int(i.min()) < 0
                                                 for i in args[1]):
            # a negative index counts from the end: the size enters the value (the index tensor is prefix-
            # consistent itself, so one non-negative at the range's end is non-negative at every size)
            return None, f"{n.name}: an index counting from the end"
        try:
            env[n] = n.target(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - an op that will not run on the CPU at build time: the mask stays
            return None, f"{n.name} could not be evaluated at the range's end ({type(exc).__name__})"
    val = env[mask]
    if not isinstance(val, torch.Tensor) or tuple(val.shape) != end:
        return None, "the evaluated mask does not have the range end's shape"
    return val, ""
