"""Dynamic dims in the joint (forward+backward) trace.

The inference capture hands dynamic dims to torch.export; the joint trace runs aot_autograd itself
(joint/trace.py), so here the requested axes (export/dynamic.DynamicDim, checked before anything is
traced) become symbols of a ShapeEnv directly: the fake mode gets a ShapeEnv, the user inputs
symbolic sizes on the requested axes (DimDynamic.DYNAMIC, each with its requested range), weights
stay static. After the trace the graph's sizes are expressions of those symbols, read back as our
dims (export/dynamic.read_dims: s0, s1, ... in input order).

A trace must not specialize a dim: every guard the ShapeEnv gained while tracing is a fact the
program would silently assume (`s0 == 8`). Two kinds are expected and handled:
- relations between inputs (tokens and targets of one batch: the loss compares their sizes). The
  first trace gives each request its own symbol; when it gains guards, requests of the same example
  size and range are merged into one symbol (torch.export's `Dim.DYNAMIC` finds such relations the
  same way) and the model traced again. A user's torch Dims that share a name are one symbol from
  the start.
- anything else (a model that needs `seq == 1024`, a `.item()`-free branch on a size): refused,
  naming the guard in the dims' labels, with the remedy.

Ranges: torch assumes a dynamic size is at least 2 while tracing (sizes 0 and 1 are specialized);
a range asked to start at 1 keeps 1 (the program is general; torch.export does the same for a Dim of
min 1), as the inference capture does.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from ..errors import BuildError
from ..export.dynamic import DynamicDim, _input_names, read_dims
from ..ir.sizes import foreign_symbols, sizes


@dataclasses.dataclass
class SymbolicInputs:
    """How one trace makes its fake inputs: the requests, and which requests share one symbol."""
    reqs: tuple[DynamicDim, ...]
    names: tuple[str, ...]  # the flat user inputs' names (forward parameters, then keywords)
    groups: dict  # (input, axis) -> group id: requests of one group share a symbol
    shape_env: object = None
    n_guards: int = 0  # guards the ShapeEnv held before the trace (the merges' own)
    symbols: dict = dataclasses.field(default_factory=dict)  # (input, axis) -> the symbol made for it

    def mode(self):
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        self.shape_env = ShapeEnv()
        return FakeTensorMode(shape_env=self.shape_env, static_shapes=True)

    def fake_inputs(self, mode, example_inputs: Sequence) -> tuple:
        from torch._dynamo.source import LocalSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext, \
            StrictMinMaxConstraint
        from torch.utils._sympy.value_ranges import ValueRanges

        asked = {(r.input, r.axis): r for r in self.reqs}
        out = []
        for name, t in zip(self.names, example_inputs):
            axes = {r.axis: r for (inp, _), r in asked.items() if inp == name}
            if not isinstance(t, torch.Tensor) or not axes:
                out.append(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t)
                continue
            ctx = StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC if i in axes else DimDynamic.STATIC for i in range(t.dim())],
                constraint_sizes=[StrictMinMaxConstraint(warn_only=False, vr=ValueRanges(axes[i].lo, axes[i].hi))
                                  if i in axes else None for i in range(t.dim())])
            out.append(mode.from_tensor(t, static_shapes=False, source=LocalSource(name), symbolic_context=ctx))
        # one symbol per group: the later members are made equal to the group's first (a replacement)
        first: dict = {}
        with mode:
            for name, ft in zip(self.names, out):
                for (inp, axis), r in asked.items():
                    if inp != name:
                        continue
                    g = self.groups[inp, axis]
                    self.symbols[inp, axis] = ft.shape[axis].node.expr
                    if g in first:
                        torch._check(ft.shape[axis] == first[g])
                    else:
                        first[g] = ft.shape[axis]
        self.n_guards = len(self.shape_env.guards)
        return tuple(out)

    def new_guards(self) -> list:
        return [g.expr for g in self.shape_env.guards[self.n_guards:]]


def _groups(reqs: Sequence[DynamicDim]) -> dict:
    """Requests -> group ids: torch Dims of one name share a group."""
    out, keys = {}, {}
    for r in reqs:
        key = ("name", r.name) if r.name else ("own", r.input, r.axis)
        out[r.input, r.axis] = keys.setdefault(key, len(keys))
    return out


def _merged(reqs, sizes: dict, by_axis: bool) -> dict:
    """Requests -> group ids: requests of one example size and range (and axis, with by_axis) share a group."""
    out, keys = {}, {}
    for r in reqs:
        key = (sizes[r.input, r.axis], r.lo, r.hi) + ((r.axis,) if by_axis else ())
        out[r.input, r.axis] = keys.setdefault(key, len(keys))
    return out


def _explains(groups: dict, symbols: dict, guards: list) -> bool:
    """Whether making each group's symbols one symbol makes every guard true (the guards were relations
    between those inputs, not a fixed size): `Eq(s0*s1, s2*s3)` with tokens.0~targets.0, tokens.1~targets.1."""
    import sympy

    sub = {}
    for key, gid in groups.items():
        first = next(k for k, g in groups.items() if g == gid)
        if key in symbols and first in symbols:
            sub[symbols[key]] = symbols[first]
    eqs = [g for g in guards if isinstance(g, sympy.Eq)]  # the relations; Ne / Mod guards follow from them
    return bool(eqs) and all(g.xreplace(sub) == sympy.true for g in eqs)


class _Range:
    __slots__ = ("lower", "upper")

    def __init__(self, lower, upper):
        self.lower, self.upper = lower, upper


def trace_symbolic(trace: Callable, model, example_inputs, example_kwargs, reqs: tuple[DynamicDim, ...]):
    """Run `trace(symbolic)` (joint/trace._trace_joint) with symbolic inputs; returns its JointGraph with
    dims, symmap and shape_env set. Raises BuildError if the trace fixed a dim."""
    from ..export.capture import split_example

    args, kw, _ = split_example(model, tuple(example_inputs), example_kwargs)
    names = tuple(_input_names(model, len(args), list(kw)))
    flat = list(args) + list(kw.values())
    tensors = dict(zip(names, flat))
    at_example = {(r.input, r.axis): int(tensors[r.input].shape[r.axis]) for r in reqs}
    own = _groups(reqs)
    sym = SymbolicInputs(tuple(reqs), names, own)
    joint = trace(sym)
    guards = sym.new_guards()
    if guards:
        # relations between inputs: the fewest merges that explain every guard (same axis first: tokens.0 with
        # targets.0, not with tokens.1 of the same size), traced again; anything else fixed a size
        merges = [_merged(reqs, at_example, True), _merged(reqs, at_example, False)]
        fit = next((m for m in merges if len(set(m.values())) < len(set(own.values()))
                    and _explains(m, sym.symbols, guards)), None)
        if fit is not None:
            sym = SymbolicInputs(tuple(reqs), names, fit)
            joint = trace(sym)
            guards = sym.new_guards()
        if guards:
            raise BuildError(_guard_message(guards, sym.shape_env),
                             remedy="drop --dynamic for the dim the model needs at one size, or change the model so "
                                    "that no size is compared with a constant; axes that must be equal need the "
                                    "same torch.export Dim (or the same range and example size)")
    env = sym.shape_env
    phs = {n.name: n for n in joint.gm.graph.nodes if n.op == "placeholder"}
    by_index = {ref: name for name, kind, ref in joint.placeholders if kind == "input"}
    placeholders = [phs[by_index[i]] for i in range(len(names))]
    ranges = {s: _Range(1, int(vr.upper)) for s, vr in env.var_to_range.items()}
    dims, symmap = read_dims(placeholders, flat, names, reqs, ranges)
    with foreign_symbols(symmap):  # the user inputs' specs: shapes as expressions of our dims
        specs = tuple(dataclasses.replace(sp, shape=sizes(ph.meta["val"].shape))
                      for sp, ph in zip(joint.inputs, placeholders))
    if any(sp.stride is not None and not all(isinstance(s, int) for s in sp.shape) for sp in specs):
        raise BuildError("a channels-last input with dynamic dims is not supported yet",
                         remedy="pass it contiguous, or keep its dims static")
    return dataclasses.replace(joint, inputs=specs, dims=dims, symmap=symmap, shape_env=env)


def _label(src) -> str:
    """`x.0` for a size symbol made from input x's axis 0 (a TensorPropertySource over our LocalSource)."""
    base, idx = getattr(src, "base", None), getattr(src, "idx", None)
    if base is not None and idx is not None and getattr(base, "local_name", None):
        return f"{base.local_name}.{idx}"
    name = getattr(src, "name", None)
    return str(name() if callable(name) else name or src)


def _guard_message(guards, env) -> str:
    """The first guards, spelled with the inputs' axes (`Eq(x.0, 2)`)."""
    import sympy

    labels = {sym: sympy.Symbol(_label(srcs[0])) for sym, srcs in getattr(env, "var_to_sources", {}).items() if srcs}
    text = [str(g.xreplace(labels)) for g in guards[:3]]
    return f"dynamic dims: the training trace fixed a dynamic size (the program would assume {'; '.join(text)})"
