"""Views as index math: a View maps its logical index (v0..v{n-1}) to an offset in a base buffer."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import sympy

from .indexing import FloorDiv, ModIdx, flat_index, linear_strides, simplify, syms, unravel
from ..contract.manifest import dense_strides  # torch-free, shared with the guard
from .loop import TensorArg, prod
from .sizes import norm, size, sizes, static


@dataclasses.dataclass(frozen=True)
class View:
    buf: str
    shape: tuple[int, ...]
    index: sympy.Expr  # offset into buf, in terms of v0..v{n-1}
    dtype: str

    @staticmethod
    def of_buffer(buf: str, shape: Sequence[int], dtype: str) -> "View":
        shape = sizes(shape)
        return View(buf, shape, flat_index(syms("v", len(shape)), shape), dtype)

    @staticmethod
    def strided(buf: str, shape: Sequence[int], stride: Sequence[int], dtype: str) -> "View":
        """A buffer laid out with `stride` (dense, e.g. channels-last) seen in logical index order."""
        shape = sizes(shape)
        v = syms("v", len(shape))
        return View(buf, shape, sympy.Add(*[x * int(st) for x, n, st in zip(v, shape, stride) if n != 1], 0), dtype)

    @property
    def vars(self):
        return syms("v", len(self.shape))

    def at(self, idx: Sequence[sympy.Expr]) -> sympy.Expr:
        """Offset of the element at logical index idx (unsimplified)."""
        return sympy.sympify(self.index).xreplace(dict(zip(self.vars, idx)))

    def _remap(self, new_shape: Sequence[int], idx_of_old: Sequence[sympy.Expr]) -> "View":
        new_shape = sizes(new_shape)
        ranges = dict(zip(syms("v", len(new_shape)), new_shape))
        # Old var names and new var names overlap (both v*): xreplace is simultaneous, so this is safe.
        expr = simplify(self.at(idx_of_old), ranges)
        return View(self.buf, new_shape, expr, self.dtype)

    def reshape(self, new_shape: Sequence[int]) -> "View":
        new_shape = _resolve_shape(new_shape, self.numel)
        if tuple(new_shape) == self.shape:
            return self
        nv = syms("v", len(new_shape))
        old_idx = unravel(flat_index(nv, new_shape), self.shape)
        return self._remap(new_shape, old_idx)

    def permute(self, dims: Sequence[int]) -> "View":
        dims = [d % len(self.shape) for d in dims]
        nv = syms("v", len(dims))
        old_idx = [None] * len(dims)
        for new_pos, old_pos in enumerate(dims):
            old_idx[old_pos] = nv[new_pos]
        return self._remap([self.shape[d] for d in dims], old_idx)

    def expand(self, sizes: Sequence[int]) -> "View":
        sizes = list(sizes)
        lead = len(sizes) - len(self.shape)
        nv = syms("v", len(sizes))
        old_idx = []
        new_shape = []
        for i, s in enumerate(sizes):
            if i < lead:
                new_shape.append(size(s))
                continue
            old = self.shape[i - lead]
            s = old if isinstance(s, int) and s == -1 else size(s)
            new_shape.append(s)
            old_idx.append(sympy.Integer(0) if old == 1 else nv[i])
        return self._remap(new_shape, old_idx)

    def repeat(self, repeats: Sequence[int]) -> "View":
        """torch's x.repeat(*repeats): len(repeats) - len(shape) new leading dims (any index reads the same
        element), and each dim i of size n_i tiled repeats[i] times, read at v_i mod n_i (v_i itself where
        the dim is not tiled, 0 where n_i is 1)."""
        repeats = list(repeats)
        lead = len(repeats) - len(self.shape)
        if lead < 0:
            raise ValueError(f"repeat{tuple(repeats)} of a {len(self.shape)}-d view: fewer repeats than dims")
        nv = syms("v", len(repeats))
        new_shape = [size(r) for r in repeats[:lead]]
        old_idx = []
        for i, (n, r) in enumerate(zip(self.shape, repeats[lead:])):
            new_shape.append(norm(sympy.expand(n * size(r))))
            v = nv[lead + i]
            tiled = not (static(r) and int(r) == 1)
            old_idx.append(sympy.Integer(0) if static(n) and int(n) == 1 else ModIdx(v, n) if tiled else v)
        return self._remap(new_shape, old_idx)

    def unsqueeze(self, dim: int) -> "View":
        dim = dim % (len(self.shape) + 1)
        shape = list(self.shape)
        shape.insert(dim, 1)
        nv = syms("v", len(shape))
        old_idx = [nv[i] for i in range(len(shape)) if i != dim]
        return self._remap(shape, old_idx)

    def squeeze(self, dims: Sequence[int] | None = None) -> "View":
        nd = len(self.shape)
        if dims is None:
            dims = [i for i, s in enumerate(self.shape) if s == 1]
        dims = {d % nd for d in dims if self.shape[d % nd] == 1}
        keep = [i for i in range(nd) if i not in dims]
        nv = syms("v", len(keep))
        pos = {old: new for new, old in enumerate(keep)}
        old_idx = [nv[pos[i]] if i in pos else sympy.Integer(0) for i in range(nd)]
        return self._remap([self.shape[i] for i in keep], old_idx)

    def slice(self, dim: int, start: int | None, end: int | None, step: int = 1) -> "View":
        dim = dim % len(self.shape)
        n = self.shape[dim]
        if static(n) and all(v is None or static(v) for v in (start, end)):
            start, end, step = slice(None if start is None else int(start), None if end is None else int(end),
                                     step).indices(int(n))
            length = max(0, (end - start + step - 1) // step)
        else:
            start, length = _dynamic_slice(n, start, end, step)
        nv = syms("v", len(self.shape))
        old_idx = list(nv)
        old_idx[dim] = start + step * nv[dim]
        shape = list(self.shape)
        shape[dim] = length
        return self._remap(shape, old_idx)

    def unfold(self, dim: int, size: int, step: int) -> "View":
        """Tensor.unfold: windows of `size` every `step` along dim; dim becomes the window count and a last dim
        of `size` is appended (element j of window w reads dim index w * step + j)."""
        nd = len(self.shape)
        dim = dim % nd if nd else 0
        n = self.shape[dim] if nd else 1
        windows = (int(n) - size) // step + 1
        nv = syms("v", nd + 1)
        old_idx = list(nv[:nd])
        if nd:
            old_idx[dim] = step * nv[dim] + nv[nd]
        shape = list(self.shape)
        if nd:
            shape[dim] = windows
        return self._remap(shape + [size], old_idx)

    def flip(self, dims: Sequence[int]) -> "View":
        nd = len(self.shape)
        flipped = {d % nd for d in dims}
        nv = syms("v", nd)
        return self._remap(self.shape, [self.shape[i] - 1 - nv[i] if i in flipped else nv[i] for i in range(nd)])

    def select(self, dim: int, i: int) -> "View":
        dim = dim % len(self.shape)
        i = i % self.shape[dim]
        nv = syms("v", len(self.shape) - 1)
        old_idx = list(nv[:dim]) + [sympy.Integer(i)] + list(nv[dim:])
        return self._remap(self.shape[:dim] + self.shape[dim + 1:], old_idx)

    def restride(self, layout: tuple[Sequence[int], int], size: Sequence[int], stride: Sequence[int],
                 offset: int) -> "View | None":
        """torch's as_strided(x, size, stride, offset) on this view, whose storage layout (strides, storage
        offset) is `layout`: each output element's storage offset is mapped back to the logical index of
        x that lives there. None when x's storage is not dense and non-overlapping (an offset could name
        no element or two) or when the result reads outside x's elements."""
        src_stride, src_off = tuple(int(s) for s in layout[0]), int(layout[1])
        if not dense_strides(self.shape, src_stride):
            return None
        order = sorted((d for d in range(len(self.shape)) if self.shape[d] != 1), key=lambda d: src_stride[d])
        expect = self.numel
        size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
        if any(st < 0 for st in stride):
            return None
        rel = int(offset) - src_off
        hi = rel + sum((n - 1) * st for n, st in zip(size, stride) if n > 0)
        if prod(size) and (rel < 0 or hi >= self.numel):
            return None
        nv = syms("v", len(size))
        flat = sympy.Integer(rel) + sympy.Add(*[v * st for v, n, st in zip(nv, size, stride) if n != 1], 0)
        old_idx = [sympy.Integer(0)] * len(self.shape)
        for d in order:
            q = FloorDiv(flat, sympy.Integer(src_stride[d])) if src_stride[d] != 1 else flat
            old_idx[d] = q if src_stride[d] * self.shape[d] >= expect else ModIdx(q, sympy.Integer(self.shape[d]))
        return self._remap(size, old_idx)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def as_strided(self) -> TensorArg | None:
        """The view as (shape, stride, offset) if it is affine in its index, else None."""
        lin = linear_strides(self.index, self.vars)
        if lin is None:
            return None
        off, strides = lin
        if any(static(st) and st < 0 for st in strides):
            return None  # torch's as_strided has no negative strides (a flip): the lowering copies
        strides = tuple(0 if static(s) and s == 1 and static(st) and st == 0 else st for s, st in zip(self.shape, strides))
        return TensorArg(self.buf, self.shape, strides, off)

    def is_contiguous_whole(self, buf_numel: int) -> bool:
        return self.numel == buf_numel and sympy.expand(self.index - flat_index(self.vars, self.shape)) == 0


def _resolve_shape(shape: Sequence[int], numel: int) -> tuple[int, ...]:
    shape = list(sizes(shape))
    holes = [i for i, s in enumerate(shape) if isinstance(s, int) and s == -1]
    if holes:
        known = prod(s for i, s in enumerate(shape) if i != holes[0])
        if static(known) and static(numel):
            shape[holes[0]] = int(numel) // int(known) if known else 0
        else:
            q = sympy.cancel(sympy.sympify(numel) / known)
            if not (q.is_Integer or sympy.fraction(q)[1] == 1):
                raise ValueError(f"reshape to {shape}: {numel} elements do not divide into {known}")
            shape[holes[0]] = norm(sympy.expand(q))
    return tuple(shape)


def _dynamic_slice(n, start, end, step: int):
    """(start, length) of x[start:end:step] along a dim of dynamic size n (or with dynamic bounds), for the
    forms that hold at every size in range: a start in [0, lo(n)], an end that is n itself (None, torch's
    INT64_MAX sentinel, at least hi(n), or an expression equal to n) or an int at most lo(n). Anything else
    is a ValueError (the op is refused by name)."""
    from .sizes import hi, lo, same, size as as_size

    start = 0 if start is None else as_size(start)
    if not static(start) or not 0 <= int(start) <= lo(n) or step < 1:
        raise ValueError(f"slice start {start} (step {step}) of a dim of dynamic size {n}")
    if end is None or (static(end) and int(end) >= hi(n)) or same(as_size(end), n):
        end = n
    elif static(end) and 0 <= int(end) <= lo(n):
        end = int(end)
    elif not static(as_size(end)) and lo(sympy.expand(n - as_size(end))) >= 0 and lo(as_size(end)) >= int(start):
        end = as_size(end)  # an expression of the dims inside the dim at every size (x[:, :s] of s + 1 rows)
    else:
        raise ValueError(f"slice end {end} of a dim of dynamic size {n} (not known to lie inside it at every size)")
    if static(end):
        return int(start), max(0, (int(end) - int(start) + step - 1) // step)
    length = sympy.expand(end - start) if step == 1 else FloorDiv(sympy.expand(end - start + step - 1), step)
    return int(start), norm(length)
