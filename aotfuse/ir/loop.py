"""Loop IR: buffers, and nodes whose bodies are small expression DAGs (never closures).

Every node writes one buffer. A Pointwise node over `ranges` computes `body` at each point of the
iteration space, with loop variables p0..p{n-1}. A Reduction node has outer `ranges` (p-vars) and
`rranges` (r-vars) and reduces `body` over the r-vars. A Scan node computes `body` over `ranges` like a
Pointwise node and writes its inclusive prefix sum/product along dimension `dim`. Loads name a buffer and a flat offset
expression into it (buffers are contiguous; views are index math, see views.py). An Extern node
calls an allow-listed aten op on views of buffers.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Union

import sympy

from ..dtypes import FLOATS, ITEMSIZE, NAMES as DTYPES, compute_dtype  # noqa: F401 (re-exported)
from .indexing import syms


@dataclasses.dataclass(frozen=True)
class Load:
    buf: str
    index: sympy.Expr
    dtype: str  # storage dtype of buf; codegen upcasts half types on load


@dataclasses.dataclass(frozen=True)
class Const:
    value: Any  # int | float | bool
    dtype: str


@dataclasses.dataclass(frozen=True)
class IndexValue:
    """The integer value of an index expression (arange, iota, masks built from positions)."""

    expr: sympy.Expr
    dtype: str


@dataclasses.dataclass(frozen=True)
class Op:
    op: str
    args: tuple["Expr", ...]
    dtype: str

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"unknown loop-IR op {self.op!r}")


@dataclasses.dataclass(frozen=True)
class Cast:
    arg: "Expr"
    dtype: str


@dataclasses.dataclass(frozen=True)
class Gather:
    """An indirect load: buf[base + offset], where `offset` is an integer expression of loaded values
    (the index tensor of index_select / gather / index.Tensor) and `base` an index in loop variables.
    The lowering bounds `offset` (wraps negatives, clamps to the indexed extent), so the read never
    leaves the buffer. For dependency analysis it reads `buf` at the opaque index INDIRECT: never a
    'point' read, so its producer is neither fused with it nor inlined into it."""

    buf: str
    base: sympy.Expr
    offset: "Expr"
    dtype: str


INDIRECT = sympy.Symbol("indirect", integer=True, nonnegative=True)

Expr = Union[Load, Const, IndexValue, Op, Cast, Gather]

# op name -> arity. Codegen has one line per op (emit/triton_ops.py).
OPS = {
    "add": 2, "sub": 2, "mul": 2, "div": 2, "floordiv": 2, "truncdiv": 2, "mod": 2, "fmod": 2, "maximum": 2, "minimum": 2,
    "pow": 2, "eq": 2, "ne": 2, "lt": 2, "le": 2, "gt": 2, "ge": 2, "and": 2, "or": 2, "xor": 2,
    "neg": 1, "exp": 1, "log": 1, "sqrt": 1, "rsqrt": 1, "erf": 1, "tanh": 1, "sigmoid": 1, "abs": 1,
    "sin": 1, "cos": 1, "log1p": 1, "expm1": 1, "floor": 1, "ceil": 1, "not": 1, "reciprocal": 1,
    "relu": 1, "sign": 1, "isnan": 1, "round": 1,
    "shr": 2, "shl": 2, "bitand": 2, "bitor": 2,
    "rand": 2,  # rand(seed, offset): Philox uniform [0, 1) at this offset of this seed's stream
    "where": 3,
}


@dataclasses.dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str  # "input" | "weight" | "node" | "extern"

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


class _OuterLoops:
    """What Pointwise and Reduction share: the outer (kept) loops over `ranges`, variables p0.."""

    @property
    def pvars(self):
        return syms("p", len(self.ranges))

    @property
    def numel(self) -> int:
        return prod(self.ranges)


@dataclasses.dataclass(frozen=True)
class Pointwise(_OuterLoops):
    name: str  # also the name of the buffer it writes
    ranges: tuple[int, ...]
    body: Expr


REDUCTIONS = ("sum", "max", "min", "prod", "any", "argmax", "argmin")
# argmax / argmin: the (int64) position along the reduced space, flattened row-major, of the first
# maximum / minimum of the body (NaN counts as the extreme, as torch's max.dim / argmax); acc_dtype is
# the body's (the values compared), the node's buffer is int64.
ARG_REDUCTIONS = ("argmax", "argmin")


@dataclasses.dataclass(frozen=True)
class Reduction(_OuterLoops):
    name: str
    ranges: tuple[int, ...]  # outer (kept) ranges: p-vars
    rranges: tuple[int, ...]  # reduced ranges: r-vars
    body: Expr
    rtype: str
    acc_dtype: str

    def __post_init__(self):
        if self.rtype not in REDUCTIONS:
            raise ValueError(f"unknown reduction {self.rtype!r}")

    @property
    def rvars(self):
        return syms("r", len(self.rranges))

    @property
    def rnumel(self) -> int:
        return prod(self.rranges)


SCANS = ("sum", "prod", "logsumexp")


@dataclasses.dataclass(frozen=True)
class Scan(_OuterLoops):
    """out[p] = combine(body[q] for q == p except q[dim] <= p[dim]): an inclusive scan along `dim`.

    `ranges` is the output's shape (p-vars, as for Pointwise); the kernel runs one program row per
    element of the other dims and walks `dim` as its r-axis (emit/kernel_src.py)."""

    name: str
    ranges: tuple[int, ...]
    dim: int
    body: Expr
    stype: str  # "sum" | "prod" | "logsumexp" (log(cumsum(exp(x))), combined pairwise as logaddexp)
    acc_dtype: str

    def __post_init__(self):
        if self.stype not in SCANS:
            raise ValueError(f"unknown scan {self.stype!r}")

    @property
    def rnumel(self) -> int:
        n = self.ranges[self.dim]
        return int(n) if isinstance(n, int) or n.is_Integer else n  # a dynamic scan length: its expression

    @property
    def rows(self) -> int:
        return prod(r for i, r in enumerate(self.ranges) if i != self.dim)


@dataclasses.dataclass(frozen=True)
class TensorArg:
    """A strided view of a buffer handed to an extern: as_strided(buf, shape, stride, offset)."""

    buf: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclasses.dataclass(frozen=True)
class Extern:
    name: str  # the buffer it writes
    target: str  # allow-listed aten overload, e.g. "aten.mm.out" or "aten.scaled_dot_product_attention.default"
    args: tuple  # TensorArg | int | float | bool | None | str | tuple of those
    kwargs: tuple[tuple[str, Any], ...]
    out_variant: bool  # True: the runtime passes the planned buffer as out=; False: op returns a new tensor
    out: "TensorArg"  # the op's result as a strided view of this node's buffer
    # A multi-output extern (it returns a tuple; never out_variant) is one node per result: the call,
    # which writes result 0, then one node per further result i with result=(the call's name, i),
    # the call's target, args=(the call's `out`,) (a whole-buffer read: ordered after the call), no
    # kwargs. Scheduling treats each as an extern; the program emits one call that defines them all.
    result: tuple[str, int] | None = None


Node = Union[Pointwise, Reduction, Scan, Extern]


@dataclasses.dataclass(frozen=True)
class OutputRef:
    """A graph output: a strided view of a buffer (or of an input/weight)."""

    view: TensorArg


@dataclasses.dataclass(frozen=True)
class LoopGraph:
    buffers: tuple[Buffer, ...]
    nodes: tuple[Node, ...]  # topological order
    inputs: tuple[str, ...]  # buffer names of the user inputs, in call order
    weights: tuple[tuple[str, str], ...]  # (buffer name, weight fqn)
    outputs: tuple[OutputRef, ...]
    rng: str | None = None  # buffer holding this call's Philox seed (int64[1]) when the graph draws randoms

    def buffer(self, name: str) -> Buffer:
        return self.buffer_map[name]

    @property
    def buffer_map(self) -> dict[str, Buffer]:
        return {b.name: b for b in self.buffers}


def prod(xs) -> int:
    """Element count of a shape (ints or sympy integers; with dynamic dims, an expression); 1 for a scalar."""
    n = 1
    for x in xs:
        if isinstance(x, int) or (isinstance(x, sympy.Basic) and x.is_Integer):
            n = n * int(x)
        else:
            n = n * x
    return n if isinstance(n, int) else (int(n) if n.is_Integer else sympy.expand(n))


def expr_leaves(e: Expr, _seen: set | None = None):
    """The leaves of an expression DAG, depth first in argument order: Load, Gather (then the leaves
    of its offset), IndexValue and Const; Op and Cast are walked through. Each shared sub-DAG (the same
    object) is walked once: a max pool's 4 x 4 window with its index nests `where`s sharing their operands,
    and walked as a tree it took minutes (2**16 paths)."""
    seen = set() if _seen is None else _seen
    if id(e) in seen:
        return
    seen.add(id(e))
    if isinstance(e, Op):
        for a in e.args:
            yield from expr_leaves(a, seen)
    elif isinstance(e, Cast):
        yield from expr_leaves(e.arg, seen)
    else:
        yield e
        if isinstance(e, Gather):
            yield from expr_leaves(e.offset, seen)


def expr_loads(e: Expr) -> list[Load]:
    """All loads in an expression DAG (with repeats removed, order of first appearance); a Gather
    reads its buffer at the opaque index INDIRECT."""
    seen: dict[Load, None] = {}
    for x in expr_leaves(e):  # each shared sub-DAG once
        if isinstance(x, Load):
            seen.setdefault(x, None)
        elif isinstance(x, Gather):
            seen.setdefault(Load(x.buf, INDIRECT, x.dtype), None)
    return list(seen)


def expr_op_count(e: Expr) -> int:
    """Ops in e counted as a tree (a shared sub-DAG counts once per use), each sub-DAG walked once."""
    memo: dict[int, int] = {}

    def count(x) -> int:
        key = id(x)
        if key not in memo:
            if isinstance(x, Op):
                memo[key] = 1 + sum(count(a) for a in x.args)
            elif isinstance(x, Cast):
                memo[key] = count(x.arg)
            elif isinstance(x, Gather):
                memo[key] = 1 + count(x.offset)
            else:
                memo[key] = 0
        return memo[key]

    return count(e)


def rewrite_expr(e: Expr, load=None, index=None, buf=None) -> Expr:
    """Rebuild e bottom-up: `load(Load) -> Expr` replaces loads, `index(sympy) -> sympy` maps every
    index expression (of loads and IndexValues), `buf(name) -> name` renames the buffers of loads and
    gathers. Shared sub-DAGs are rewritten once."""
    memo: dict[int, Expr] = {}

    def walk(x):
        key = id(x)
        if key in memo:
            return memo[key]
        if isinstance(x, Load):
            out = Load(buf(x.buf) if buf else x.buf, index(x.index) if index else x.index, x.dtype) \
                if (index or buf) else x
            out = load(out) if load else out
        elif isinstance(x, IndexValue):
            out = IndexValue(index(x.expr), x.dtype) if index else x
        elif isinstance(x, Gather):
            out = Gather(buf(x.buf) if buf else x.buf, index(x.base) if index else x.base, walk(x.offset), x.dtype)
        elif isinstance(x, Op):
            out = Op(x.op, tuple(walk(a) for a in x.args), x.dtype)
        elif isinstance(x, Cast):
            out = Cast(walk(x.arg), x.dtype)
        else:
            out = x
        memo[key] = out
        return out

    return walk(e)


def map_loads(e: Expr, fn) -> Expr:
    """Rebuild e with each Load replaced by fn(load) (an Expr)."""
    return rewrite_expr(e, load=fn)


def subs_expr(e: Expr, mapping: dict) -> Expr:
    """Substitute loop variables in every index of e."""
    if not mapping:
        return e
    return rewrite_expr(e, index=lambda ix: sympy.sympify(ix).xreplace(mapping))


def format_expr(e: Expr) -> str:
    if isinstance(e, Load):
        return f"{e.buf}[{e.index}]"
    if isinstance(e, Const):
        return repr(e.value)
    if isinstance(e, IndexValue):
        return f"index({e.expr})"
    if isinstance(e, Cast):
        return f"{e.dtype}({format_expr(e.arg)})"
    if isinstance(e, Gather):
        return f"{e.buf}[{e.base} + {format_expr(e.offset)}]"
    return f"{e.op}(" + ", ".join(format_expr(a) for a in e.args) + ")"


def format_node(n: Node) -> str:
    if isinstance(n, Pointwise):
        return f"{n.name} = pointwise{list(n.ranges)}: {format_expr(n.body)}"
    if isinstance(n, Reduction):
        return f"{n.name} = {n.rtype}{list(n.ranges)}x{list(n.rranges)}: {format_expr(n.body)}"
    if isinstance(n, Scan):
        return f"{n.name} = cum{n.stype}{list(n.ranges)} dim {n.dim}: {format_expr(n.body)}"
    return f"{n.name} = extern {n.target}({', '.join(map(str, n.args))})"
