"""Guards of an archive with dynamic dims: the call's input shapes bind the dims, within their ranges.

An input spec names a dynamic axis by its dim symbol ("s0"). The first axis (in input order, then
axis order) that names a symbol binds it; every later one must have the same size (the build
traced the model with those axes equal: a relation between dims, e.g. a mask's length and the
tokens'), and the value must lie in the dim's range (what the kernels were built and checked
for). Static axes must match exactly, as in a static archive. Every violation is a GuardError
naming the input, the axis, the dim and the values, with what to do.
"""
from __future__ import annotations

from typing import Sequence

from ..contract.manifest import DimSpec, InputSpec
from ..errors import GuardError


def bind_dims(specs: Sequence[InputSpec], dims: Sequence[DimSpec], tensors: Sequence) -> dict[str, int]:
    """The dims' values for this call (symbol -> size), or the GuardError of the first violation.
    `tensors` are the call's inputs, one per spec (anything with a `.shape`)."""
    by_sym = {d.sym: d for d in dims}
    env: dict[str, int] = {}
    first: dict[str, tuple[int, int]] = {}  # symbol -> (input index, axis) that bound it
    for i, (spec, x) in enumerate(zip(specs, tensors)):
        shape = tuple(x.shape)
        if len(shape) != len(spec.shape):
            raise GuardError(f"{_where(spec, i)}: expected {len(spec.shape)} dims {_fmt(spec.shape)}, got shape "
                             f"{shape} ({len(shape)} dims)", remedy="pass a tensor of the rank the model was built for")
        for axis, (want, got) in enumerate(zip(spec.shape, shape)):
            if type(want) is int:
                if got != want:
                    raise GuardError(f"{_where(spec, i)}: expected shape {_fmt(spec.shape)}, got {shape}: "
                                     f"dim {axis} is static ({want})",
                                     remedy=f"rebuild with that dim dynamic: --dynamic {spec.name}.{axis}=LO..HI")
                continue
            have = env.get(want)
            if have is None:
                d = by_sym[want]
                if not d.lo <= got <= d.hi:
                    raise GuardError(f"{_where(spec, i)} dim {axis} = {got} is outside {want} ({d.name}) range "
                                     f"{d.lo}..{d.hi}",
                                     remedy=f"rebuild with a wider range: --dynamic {spec.name}.{axis}=LO..HI")
                env[want] = got
                first[want] = (i, axis)
            elif got != have:
                j, a = first[want]
                raise GuardError(f"{_where(spec, i)} dim {axis} = {got} differs from {_where(specs[j], j)} dim {a} = "
                                 f"{have}: both are {want} ({by_sym[want].name}), the model was built with them equal",
                                 remedy="pass inputs whose sizes agree as they did in the build's example")
    return env


def dims_env(dims: Sequence[DimSpec], field: str = "hint") -> dict[str, int]:
    """The dims at their hints (or "lo" / "hi"): e.g. to draw example inputs for a dynamic archive."""
    return {d.sym: getattr(d, field) for d in dims}


def shape_at(shape, env: dict[str, int]) -> tuple[int, ...]:
    """An input spec's shape with each dim symbol replaced by its value in `env`."""
    return tuple(v if type(v) is int else env[v] for v in shape)


def _where(spec: InputSpec, i: int) -> str:
    return f"input {spec.name!r} (#{i})"


def _fmt(shape) -> str:
    """(s0, 4, s1): a spec's shape as messages and `inspect` print it."""
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"
