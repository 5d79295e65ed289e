"""Dynamic dims: what the user asks for (torch.export `Dim`s or `--dynamic INPUT.DIM=LO..HI`), checked
before anything runs, handed to torch.export, and read back as our dim symbols s0, s1, ...

`DynamicDim` is one request: input `input` (its forward parameter name, as `inspect` names inputs),
axis `axis`, inclusive range [lo, hi], an optional name (a torch Dim's). `requests` normalizes both
spellings; `export_spec` turns them into torch.export's `dynamic_shapes`; after the export,
`read_dims` maps torch's symbols to ours (s<i>, numbered in input order), with the ranges torch
proved (they may be narrower than asked: a model that reshapes by 2 needs an even size) and relations
(two inputs whose dims must agree share one symbol).
"""
from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, Mapping, Sequence

import sympy
import torch

from ..errors import BuildError
from ..ir.sizes import Dim, dim_symbol

_CLI = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\.(\d+)\s*=\s*(\d+)\s*\.\.\s*(\d+)\s*$")
# torch.export treats sizes 0 and 1 as special (it specializes them); a dynamic dim's range may still
# start at 1: the program is general, the example just must not sit there.
MIN_HINT = 2


@dataclasses.dataclass(frozen=True)
class DynamicDim:
    input: str
    axis: int
    lo: int
    hi: int
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or f"{self.input}.{self.axis}"


def parse_cli(items: Sequence[str]) -> tuple[DynamicDim, ...]:
    """`--dynamic INPUT.DIM=LO..HI` values."""
    out = []
    for it in items:
        m = _CLI.match(it)
        if m is None:
            raise BuildError(f"--dynamic {it!r}: expected INPUT.DIM=LO..HI (e.g. tokens.1=1..64)",
                             remedy="name the input as the model's forward does, the axis by number, the range inclusive")
        out.append(DynamicDim(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))))
    return tuple(out)


def _input_names(model, n_pos: int, kw_names: Sequence[str]) -> list[str]:
    """The forward's parameter names of the positional inputs, then the keyword inputs' names."""
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    pos = [params[i].name if i < len(params) else f"arg{i}" for i in range(n_pos)]
    return pos + list(kw_names)


def requests(model, dynamic_shapes, args: Sequence[torch.Tensor], kwargs: Mapping[str, torch.Tensor]
             ) -> tuple[DynamicDim, ...]:
    """Normalize `dynamic_shapes` (DynamicDim records, `--dynamic` strings, or torch.export's form: a dict
    by input name or a tuple by position of {axis: Dim} / [Dim or None, ...]) and check every request
    against the example inputs. Raises BuildError before anything is traced."""
    if not dynamic_shapes:
        return ()
    names = _input_names(model, len(args), list(kwargs))
    tensors = dict(zip(names, list(args) + list(kwargs.values())))
    if isinstance(dynamic_shapes, (list, tuple)) and all(isinstance(d, (str, DynamicDim)) for d in dynamic_shapes):
        reqs = [d if isinstance(d, DynamicDim) else parse_cli([d])[0] for d in dynamic_shapes]
    else:
        reqs = _from_torch(dynamic_shapes, names)
    seen = {}
    for r in reqs:
        if r.input not in tensors:
            raise BuildError(f"dynamic dim {r.label}: the model has no tensor input {r.input!r}",
                             remedy=f"its tensor inputs are {', '.join(names) or '(none)'}")
        t = tensors[r.input]
        if not 0 <= r.axis < t.dim():
            raise BuildError(f"dynamic dim {r.label}: input {r.input!r} has {t.dim()} dims, no axis {r.axis}")
        if (r.input, r.axis) in seen:
            raise BuildError(f"dynamic dim {r.input}.{r.axis} is given twice")
        seen[r.input, r.axis] = r
        if not 1 <= r.lo <= r.hi:
            raise BuildError(f"dynamic dim {r.label}: range {r.lo}..{r.hi} is empty or starts below 1",
                             remedy="give LO..HI with 1 <= LO <= HI")
        n = int(t.shape[r.axis])
        if not r.lo <= n <= r.hi:
            raise BuildError(f"dynamic dim {r.label}: the example's size {n} is outside {r.lo}..{r.hi}",
                             remedy="build with an example inside the range")
        if n < MIN_HINT:
            raise BuildError(f"dynamic dim {r.label}: the example's size is {n}; torch.export specializes sizes "
                             f"0 and 1", remedy=f"build with an example of size >= {MIN_HINT} on that axis "
                                                f"(the range may still start at {r.lo})")
    return tuple(reqs)


def _from_torch(spec, names: list[str]) -> list[DynamicDim]:
    if isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, (list, tuple)):
        items = [(names[i] if i < len(names) else f"arg{i}", s) for i, s in enumerate(spec)]
    else:
        raise BuildError(f"dynamic_shapes must be a dict by input name or a tuple by position, got "
                         f"{type(spec).__name__}")
    out = []
    for name, axes in items:
        if axes is None:
            continue
        pairs = axes.items() if isinstance(axes, Mapping) else enumerate(axes)
        for axis, d in pairs:
            if d is None:
                continue
            lo, hi = getattr(d, "min", None), getattr(d, "max", None)
            if lo is None or hi is None or not hasattr(d, "__name__"):
                raise BuildError(f"dynamic_shapes[{name!r}][{axis}]: expected a torch.export.Dim, got {d!r}")
            if hi > 1 << 30:
                raise BuildError(f"dynamic dim {d.__name__} ({name}.{axis}) has no upper bound",
                                 remedy="give Dim(..., max=N): the archive's memory and kernels are sized by it")
            out.append(DynamicDim(str(name), int(axis), max(int(lo), 1), int(hi), d.__name__))
    return out


def export_spec(model, reqs: Sequence[DynamicDim], n_pos: int, kw_names: Sequence[str],
                hints: bool = False) -> dict | None:
    """torch.export's `dynamic_shapes` for the requests: by forward parameter name, one named Dim each
    (the range is kept as asked, 1 included). hints=True: `Dim.DYNAMIC(min=, max=)` instead, which lets
    torch find which requested axes must be equal (two inputs' batch) where named Dims would need the user
    to say so; torch then starts a range at 2 at the least (the manifest and guards say so)."""
    if not reqs:
        return None
    names = _input_names(model, n_pos, kw_names)
    spec: dict[str, Any] = {n: None for n in names}
    for r in reqs:
        spec[r.input] = {**(spec[r.input] or {}), r.axis: _dim(r, hints)}
    return spec


def _dim(r: DynamicDim, hints: bool):
    if hints:
        try:
            return torch.export.Dim.DYNAMIC(min=r.lo, max=r.hi)
        except (AttributeError, TypeError):
            pass
    ident = re.sub(r"\W", "_", r.label)
    return torch.export.Dim(ident if ident.isidentifier() else f"d_{ident}", min=r.lo, max=r.hi)


def read_dims(placeholders: Sequence[torch.fx.Node], examples: Sequence[torch.Tensor], names: Sequence[str],
              reqs: Sequence[DynamicDim], range_constraints: Mapping) -> tuple[tuple[Dim, ...], dict]:
    """Our dims from an exported graph: (Dim records, {torch symbol: our symbol}). Every requested axis
    must have stayed symbolic; an axis torch made an expression of another dim (a derived dim) is refused."""
    asked = {(r.input, r.axis): r for r in reqs}
    dims: list[Dim] = []
    symmap: dict = {}
    for ph, ex, name in zip(placeholders, examples, names):
        val = ph.meta.get("val")
        for axis, s in enumerate(getattr(val, "shape", ())):
            r = asked.get((name, axis))
            if not isinstance(s, torch.SymInt):
                if r is not None:
                    raise BuildError(f"dynamic dim {r.label}: torch.export specialized it to {int(s)} (the model "
                                     f"needs that size)", remedy="drop --dynamic for it, or change the model")
                continue
            e = s.node.expr
            if e.is_Integer:
                raise BuildError(f"dynamic dim {r.label if r else f'{name}.{axis}'}: torch.export fixed it to {int(e)}: "
                                 f"the model needs that size, or another input's axis must equal it",
                                 remedy="mark that input's axis dynamic too (e.g. attention_mask.1 with input_ids.1)")
            if not isinstance(e, sympy.Symbol):
                raise BuildError(f"input {name}.{axis}: torch.export made its size {e}, an expression of other dims",
                                 remedy="mark the dims it depends on dynamic instead")
            if e not in symmap:
                vr = range_constraints.get(e)
                lo_, hi_ = (int(vr.lower), int(vr.upper)) if vr is not None else (r.lo, r.hi) if r else (1, 1 << 30)
                if r is not None:
                    lo_, hi_ = max(lo_, r.lo), min(hi_, r.hi)
                label = r.label if r is not None else f"{name}.{axis}"
                sym = dim_symbol(len(dims))
                symmap[e] = sym
                dims.append(Dim(sym, label, lo_, hi_, int(ex.shape[axis])))
    missing = [r.label for r in reqs if not any(d.name == r.label for d in dims)
               and not _shared(r, placeholders, names, symmap)]
    if missing:
        raise BuildError(f"dynamic dims {', '.join(missing)} did not stay dynamic in the export")
    return tuple(dims), symmap


def _shared(r: DynamicDim, placeholders, names, symmap) -> bool:
    """A request whose axis got the symbol of an earlier one (torch proved them equal)."""
    for ph, name in zip(placeholders, names):
        if name == r.input:
            s = ph.meta["val"].shape[r.axis]
            return isinstance(s, torch.SymInt) and s.node.expr in symmap
    return False
