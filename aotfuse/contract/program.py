"""The execution program: a flat list of instructions, as plain data, never code.

One `Program` per packaged program (`program.forward`, `program.backward`). Instructions:

  Alloc  {buf, offset, shape, dtype}      a buffer: a view of the per-call arena (offset -1: its own allocation);
                                          version 8: [, host]: a view of that buffer's bytes instead
  Launch {kernel, grid, args: [buf...]}   one fused kernel (see kernels.py for its ABI); version 5: [, sizes]
  Extern {target, args, kwargs, out, out_view, out_variant, shape, dtype[, outs]}   an allow-listed ATen op
  Free   {bufs: [...]}                    drop references after their last use
  Return {outputs: [view...]}             the program's results, as views of buffers

Tensor arguments of externs and returned outputs are `TensorRef`s, strided views of a buffer
`{t, shape, stride, offset}` (in elements). Dtypes are program dtype names ("float32").

Sizes (version 5, dynamic dims): every shape, stride, offset, grid and arena size may be a size
expression over the manifest's dims (contract/sizes.py) instead of an int. `specialize(program, env)`
evaluates them all for one set of dim values, giving the plain static program the executor runs.

The version is written in every program and checked at load. PROGRAM_VERSION is what a program
without size expressions or launch sizes is written as (static archives keep their bytes);
one that has them is DIMS_VERSION, set by `Program` itself (`__post_init__`). Versions:
  1  (aotfuse 0.1.0)  first version (golden artifacts/golden/v1_model.aotf)
  2  (2026-11-23)     `weight_specs` {buf: {shape, dtype}}; the kernels part records `xnumel`,
                      `rnumel` and each argument's `numel`
  3  (2026-12)        multi-output externs: an extern's optional `outs` [{out, out_view, shape, dtype}]
                      binds the op's results after the first (training's fused attention,
                      `aotfuse.attention.default` / `aotfuse.attention_backward.default`)
  4  (2026-11-23)     train info's optional `mutated_buffers`: buffers the forward updates (train-mode
                      BatchNorm), forward program inputs after the parameters whose new values the
                      forward returns after the loss
  5  (2026-12)        dynamic dims: size fields may be size expressions (contract/sizes.py) over the
                      manifest's `dims`; a launch's optional `sizes`: int32 kernel arguments after its
                      buffers (the kernel's `size_args`). Written only by programs that use them
  6  (2026-11-27)     a kernel binary's optional `grid` and `persistent`: a matmul template compiled from
                      its target's own tile configuration launches with them (contract/kernels.Binary).
                      Written only by archives that have such a binary (TILES_VERSION; the build raises
                      every program's version)
  7  (2026-11-27)     a kernel binary's optional `pdl` (true): an sm_90+ cubin compiled with the PDL wait
                      (emit/pdl.py), which the runtime may launch with programmatic stream serialization.
                      Written only by archives that have such a binary (PDL_VERSION; the build raises
                      every program's version). An older reader refuses it rather than ignore the field
  8  (2026-11-28)     an alloc's optional `host`: the buffer lies in the bytes of that buffer from `offset`:
                      a program input after its last read (a training backward's saved tensor: the runtime
                      writes there only when autograd frees the saved tensors after this backward, and
                      allocates the buffer on its own otherwise), or a buffer allocated on its own (an
                      output) before the instruction that writes it. `Program` raises a program that has
                      one to this version; an older reader refuses it
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Iterator, Mapping, Union

from ..errors import ArchiveError
from ._codec import UPGRADE, decoding, fields, ints, put_optional, size_tuple, strs
from .sizes import SYMBOL, SizeExpr, check_size, evaluate, free_dims

PROGRAM_VERSION = 4  # what this aotfuse writes for a program without size expressions
DIMS_VERSION = 5  # ... and for one with size expressions or launch sizes (dynamic dims)
TILES_VERSION = 6  # ... and for any program of an archive with a binary that has its own tiles
PDL_VERSION = 7  # ... and for any program of an archive with a binary compiled with the PDL wait
DONOR_VERSION = 8  # ... and for a program with an alloc in another buffer's bytes (Alloc.host)
MIN_SUPPORTED_VERSION = 1  # the oldest it reads
MAX_SUPPORTED_VERSION = DONOR_VERSION  # the newest it reads


def check_program_version(v: Any, where: str = "program") -> int:
    """The version of a program this aotfuse can run, else the ArchiveError that says what to do."""
    span = f"{MIN_SUPPORTED_VERSION}..{MAX_SUPPORTED_VERSION}"
    if type(v) is not int or v < 0 or v >= 1 << 16:
        raise ArchiveError(f"{where}: program version {v!r} is not a version number (this aotfuse reads {span})",
                           remedy="the archive is damaged; rebuild it")
    if v > MAX_SUPPORTED_VERSION:
        raise ArchiveError(f"{where}: program version {v} is newer than this aotfuse supports ({span})",
                           remedy=UPGRADE.split(",")[0])
    if v < MIN_SUPPORTED_VERSION:
        raise ArchiveError(f"{where}: program version {v} is older than this aotfuse supports ({span})",
                           remedy="rebuild the archive with this aotfuse")
    return v


# ---------------------------------------------------------------- operands

@dataclasses.dataclass(frozen=True)
class TensorRef:
    """A strided view of buffer `t`: `shape`, `stride` and `offset` in elements."""

    t: str
    shape: tuple[SizeExpr, ...]
    stride: tuple[SizeExpr, ...]
    offset: SizeExpr

    def to_dict(self) -> dict:
        return {"t": self.t, "shape": list(self.shape), "stride": list(self.stride), "offset": self.offset}

    @classmethod
    def from_dict(cls, d: Any) -> "TensorRef":
        d = fields(d, "tensor view", ("t", "shape", "stride", "offset"))
        return cls(d["t"], size_tuple(d["shape"], "view shape"), size_tuple(d["stride"], "view stride"),
                   check_size(d["offset"], "view offset"))


# An extern argument: a scalar, a view, or a (nested) sequence of them (tuples here, lists on disk).
Arg = Union[None, bool, int, float, str, TensorRef, tuple]


def encode_arg(a: Arg):
    if isinstance(a, TensorRef):
        return a.to_dict()
    if isinstance(a, (list, tuple)):
        return [encode_arg(x) for x in a]
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise TypeError(f"extern argument of type {type(a).__name__} cannot be encoded")


def decode_arg(a: Any) -> Arg:
    if isinstance(a, dict):
        return TensorRef.from_dict(a)
    if isinstance(a, list):
        return tuple(decode_arg(x) for x in a)
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise TypeError(f"{type(a).__name__} is not an extern argument")


# ---------------------------------------------------------------- instructions

@dataclasses.dataclass(frozen=True)
class Alloc:
    op: ClassVar[str] = "alloc"
    buf: str
    offset: SizeExpr  # byte offset in the arena (or in the host's bytes), 16-byte aligned; -1: allocated on its own
    shape: tuple[SizeExpr, ...]
    dtype: str
    # version 8: the buffer whose bytes hold this one (from `offset`): a program input the program no longer
    # reads, which the caller may donate (Executor.run(donate=True)), or an output not yet written; written
    # only when set
    host: str | None = None

    def to_dict(self) -> dict:
        out = {"op": "alloc", "buf": self.buf, "offset": self.offset, "shape": list(self.shape), "dtype": self.dtype}
        if self.host is not None:
            out["host"] = self.host
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Alloc":
        d = fields(d, "alloc", ("op", "buf", "offset", "shape", "dtype"), ("host",))
        host = d.get("host")
        if host is not None and type(host) is not str:
            raise ArchiveError(f"alloc {d['buf']!r}: host {host!r} is not a buffer name",
                               remedy="the archive is damaged; rebuild it")
        return cls(d["buf"], check_size(d["offset"], "alloc offset"), size_tuple(d["shape"], "alloc shape"),
                   d["dtype"], host)


@dataclasses.dataclass(frozen=True)
class Launch:
    op: ClassVar[str] = "launch"
    kernel: str
    grid: tuple[SizeExpr, SizeExpr, SizeExpr]
    args: tuple[str, ...]  # buffers, in the kernel's argument order
    # version 5: int32 scalars passed after the buffers (the kernel's `size_args`, in order): the
    # dims or sizes a kernel compiled for a range reads at run time; written only when non-empty
    sizes: tuple[SizeExpr, ...] = ()
    # version 5: kernel variants per sub-range of a dynamic size `on` (a reduction's length): a shape whose
    # `on` is at most a case's bound runs the first such case's kernel and grid (same buffers and sizes);
    # larger values run `kernel` / `grid`. Chosen once per shape, when the program is specialized.
    choose: tuple["LaunchCase", ...] = ()
    on: SizeExpr | None = None

    def to_dict(self) -> dict:
        d = {"op": "launch", "kernel": self.kernel, "grid": list(self.grid), "args": list(self.args)}
        put_optional(d, "sizes", list(self.sizes), [])
        if self.choose:
            d["on"] = self.on
            d["choose"] = [c.to_dict() for c in self.choose]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Launch":
        d = fields(d, "launch", ("op", "kernel", "grid", "args"), ("sizes", "choose", "on"))
        choose = tuple(LaunchCase.from_dict(c) for c in (d.get("choose") or ()))
        if choose and d.get("on") is None:
            raise ArchiveError("launch: kernel variants (choose) without the size they are chosen by (on)",
                               remedy="the archive is damaged; rebuild it")
        if any(a.upto > b.upto for a, b in zip(choose, choose[1:])):
            raise ArchiveError("launch: kernel variants must be listed by increasing bound",
                               remedy="the archive is damaged; rebuild it")
        return cls(d["kernel"], size_tuple(d["grid"], "launch grid"), strs(d["args"]),
                   size_tuple(d.get("sizes", ()), "launch sizes"), choose,
                   None if d.get("on") is None else check_size(d["on"], "launch on"))

    def pick(self, value: int, env: Mapping[str, int]) -> tuple[str, tuple]:
        """(kernel, grid) of the first variant for this value of `on` whose aligned dims are multiples of
        ALIGNED_MULTIPLE in `env`; else the launch's own."""
        for c in self.choose:
            if value <= c.upto and all(env[d] % ALIGNED_MULTIPLE == 0 for d in c.aligned):
                return c.kernel, c.grid
        return self.kernel, self.grid


ALIGNED_MULTIPLE = 16  # a variant's `aligned` dims are multiples of this (its kernel is compiled knowing so)


@dataclasses.dataclass(frozen=True)
class LaunchCase:
    """One kernel variant of a launch: used when the launch's `on` size is at most `upto`."""

    upto: int
    kernel: str
    grid: tuple[SizeExpr, SizeExpr, SizeExpr]
    aligned: tuple[str, ...] = ()  # dims that must be multiples of ALIGNED_MULTIPLE for this variant

    def to_dict(self) -> dict:
        d = {"upto": self.upto, "kernel": self.kernel, "grid": list(self.grid)}
        return put_optional(d, "aligned", list(self.aligned), [])

    @classmethod
    def from_dict(cls, d: Any) -> "LaunchCase":
        d = fields(d, "launch variant", ("upto", "kernel", "grid"), ("aligned",))
        aligned = strs(d.get("aligned", ()))
        if any(not SYMBOL.match(x) for x in aligned):
            raise ArchiveError(f"launch variant: aligned dims {list(aligned)} are not dim symbols",
                               remedy="the archive is damaged; rebuild it")
        if type(d["upto"]) is not int or not 0 <= d["upto"] < 1 << 31:
            raise ArchiveError(f"launch variant: bound {d['upto']!r} is not an int32 size",
                               remedy="the archive is damaged; rebuild it")
        if not isinstance(d["kernel"], str):
            raise ArchiveError("launch variant: kernel is not a name", remedy="the archive is damaged; rebuild it")
        return cls(d["upto"], d["kernel"], size_tuple(d["grid"], "launch variant grid"), aligned)


@dataclasses.dataclass(frozen=True)
class ExternOut:
    """A further result of a multi-output extern (version 3+): the op's result i+1 defines `out`."""

    out: str
    out_view: TensorRef  # where the result goes: a view of `out`
    shape: tuple[SizeExpr, ...]  # of `out`
    dtype: str

    def to_dict(self) -> dict:
        return {"out": self.out, "out_view": self.out_view.to_dict(), "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: Any) -> "ExternOut":
        d = fields(d, "extern result", ("out", "out_view", "shape", "dtype"))
        return cls(d["out"], TensorRef.from_dict(d["out_view"]), size_tuple(d["shape"], "extern result shape"),
                   d["dtype"])


@dataclasses.dataclass(frozen=True)
class Extern:
    op: ClassVar[str] = "extern"
    target: str  # "aten.<op>.<overload>" (or "aotfuse.<op>.<overload>"), on the runtime's allow-list (runtime/externs.py)
    args: tuple  # of Arg
    kwargs: dict  # name -> Arg (read-only)
    out: str  # the result buffer (of a multi-output op: its first result)
    out_view: TensorRef  # where the result goes: a view of `out`
    out_variant: bool  # True: an `.out` op writing into `out` (allocated before); False: the op allocates it
    shape: tuple[SizeExpr, ...]  # of `out`
    dtype: str
    outs: tuple[ExternOut, ...] = ()  # version 3+: the op returns a tuple; its results after the first

    def to_dict(self) -> dict:
        d = {"op": "extern", "target": self.target, "args": encode_arg(self.args),
             "kwargs": {k: encode_arg(v) for k, v in self.kwargs.items()}, "out": self.out,
             "out_view": self.out_view.to_dict(), "out_variant": self.out_variant,
             "shape": list(self.shape), "dtype": self.dtype}
        return put_optional(d, "outs", [o.to_dict() for o in self.outs], [])

    @classmethod
    def from_dict(cls, d: dict) -> "Extern":
        d = fields(d, "extern", ("op", "target", "args", "kwargs", "out", "out_view", "out_variant", "shape", "dtype"),
                   ("outs",))
        if type(d["kwargs"]) is not dict:
            raise TypeError("kwargs is not a map")
        outs = d.get("outs", [])
        if type(outs) is not list:
            raise TypeError("outs is not a list")
        return cls(d["target"], tuple(decode_arg(a) for a in d["args"]),
                   {k: decode_arg(v) for k, v in d["kwargs"].items()}, d["out"], TensorRef.from_dict(d["out_view"]),
                   d["out_variant"], size_tuple(d["shape"], "extern shape"), d["dtype"],
                   tuple(ExternOut.from_dict(o) for o in outs))


@dataclasses.dataclass(frozen=True)
class Free:
    op: ClassVar[str] = "free"
    bufs: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"op": "free", "bufs": list(self.bufs)}

    @classmethod
    def from_dict(cls, d: dict) -> "Free":
        return cls(strs(fields(d, "free", ("op", "bufs"))["bufs"]))


@dataclasses.dataclass(frozen=True)
class Return:
    op: ClassVar[str] = "return"
    outputs: tuple[TensorRef, ...]

    def to_dict(self) -> dict:
        return {"op": "return", "outputs": [o.to_dict() for o in self.outputs]}

    @classmethod
    def from_dict(cls, d: dict) -> "Return":
        return cls(tuple(TensorRef.from_dict(o) for o in fields(d, "return", ("op", "outputs"))["outputs"]))


Instruction = Union[Alloc, Launch, Extern, Free, Return]
INSTRUCTIONS: dict[str, type] = {c.op: c for c in (Alloc, Launch, Extern, Free, Return)}


def instruction_from_dict(d: Any) -> Instruction:
    op = d.get("op") if type(d) is dict else None
    cls = INSTRUCTIONS.get(op) if type(op) is str else None
    if cls is None:
        raise ArchiveError(f"unknown program instruction {op!r}", remedy=UPGRADE)
    return cls.from_dict(d)


# ---------------------------------------------------------------- the program

@dataclasses.dataclass(frozen=True)
class ProgramInput:
    buf: str
    shape: tuple[SizeExpr, ...]
    dtype: str

    def to_dict(self) -> dict:
        return {"buf": self.buf, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: Any) -> "ProgramInput":
        d = fields(d, "program input", ("buf", "shape", "dtype"))
        return cls(d["buf"], size_tuple(d["shape"], "program input shape"), d["dtype"])


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: Any) -> "WeightSpec":
        d = fields(d, "weight spec", ("shape", "dtype"))
        return cls(ints(d["shape"]), d["dtype"])


@dataclasses.dataclass(frozen=True)
class Program:
    """One program. `weights` maps a weight buffer to the archive weight it binds (its FQN);
    `weight_specs` (version 2+, None in version 1) the shape and dtype that weight had at build.

    A program with a size expression or a launch's `sizes` is a version 5 program whatever version it
    was made with (`__post_init__` raises it), so the build passes PROGRAM_VERSION and static
    programs keep version 4 and their bytes."""

    version: int
    inputs: tuple[ProgramInput, ...]
    weights: dict  # buf -> weight name (read-only)
    weight_specs: dict | None  # buf -> WeightSpec (read-only); None: a version 1 program
    arena_bytes: SizeExpr
    rng: str | None  # the buffer bound to a fresh Philox seed (int64 [1]) per call, if any
    instructions: tuple[Instruction, ...]

    def __post_init__(self):
        if self.version < DIMS_VERSION and uses_dims(self):
            object.__setattr__(self, "version", DIMS_VERSION)
        if self.version < DONOR_VERSION and any(isinstance(i, Alloc) and i.host is not None for i in self.instructions):
            object.__setattr__(self, "version", DONOR_VERSION)

    @property
    def returned(self) -> tuple[TensorRef, ...]:
        """The views the final Return hands back (validated programs end with exactly one)."""
        last = self.instructions[-1] if self.instructions else None
        return last.outputs if isinstance(last, Return) else ()

    def to_dict(self) -> dict:
        out: dict = {"version": self.version, "inputs": [i.to_dict() for i in self.inputs], "weights": dict(self.weights)}
        if self.weight_specs is not None:
            out["weight_specs"] = {b: s.to_dict() for b, s in self.weight_specs.items()}
        out.update({"arena_bytes": self.arena_bytes, "rng": self.rng,
                    "instructions": [i.to_dict() for i in self.instructions]})
        return out

    @classmethod
    def from_dict(cls, d: Any, name: str = "program") -> "Program":
        """Check the version first (a newer program is refused as such, whatever else changed)."""
        where = f"program {name!r}"
        version = check_program_version(d.get("version") if type(d) is dict else None, where)
        with decoding(where):
            d = fields(d, where, ("version", "inputs", "weights", "arena_bytes", "instructions"),
                       ("weight_specs", "rng"))
            specs = d.get("weight_specs")
            p = cls(version, tuple(ProgramInput.from_dict(i) for i in d["inputs"]), dict(d["weights"]),
                    None if specs is None else {b: WeightSpec.from_dict(s) for b, s in specs.items()},
                    check_size(d["arena_bytes"], f"{where}: arena_bytes"), d.get("rng"),
                    tuple(instruction_from_dict(i) for i in d["instructions"]))
        if p.version != version:
            what = (f"an alloc in another buffer's bytes (version {DONOR_VERSION}+)" if p.version == DONOR_VERSION
                    else f"size expressions or launch sizes (version {DIMS_VERSION}+)")
            raise ArchiveError(f"{where}: a version {version} program has {what}",
                               remedy="the archive is damaged; rebuild it")
        return p


# ---------------------------------------------------------------- dynamic dims

def sizes_of(program: Program) -> Iterator[SizeExpr]:
    """Every size field of a program (shapes, strides, offsets, grids, launch sizes, arena bytes)."""
    yield program.arena_bytes
    for i in program.inputs:
        yield from i.shape
    for ins in program.instructions:
        if isinstance(ins, Alloc):
            yield ins.offset
            yield from ins.shape
        elif isinstance(ins, Launch):
            yield from ins.grid
            yield from ins.sizes
            if ins.choose:
                yield ins.on
                for c in ins.choose:
                    yield from c.grid
        elif isinstance(ins, Extern):
            yield from ins.shape
            yield from _ref_sizes(ins.out_view)
            for a in _refs((ins.args, tuple(ins.kwargs.values()))):
                yield from _ref_sizes(a)
            for o in ins.outs:
                yield from o.shape
                yield from _ref_sizes(o.out_view)
        elif isinstance(ins, Return):
            for o in ins.outputs:
                yield from _ref_sizes(o)


def _ref_sizes(r: TensorRef) -> Iterator[SizeExpr]:
    yield from r.shape
    yield from r.stride
    yield r.offset


def _refs(a) -> Iterator[TensorRef]:
    if isinstance(a, TensorRef):
        yield a
    elif isinstance(a, tuple):
        for x in a:
            yield from _refs(x)


def uses_dims(program: Program) -> bool:
    """Whether the program needs version 5: a size expression anywhere, or a launch with sizes."""
    return any(type(v) is str for v in sizes_of(program)) or any(
        isinstance(i, Launch) and i.sizes for i in program.instructions)


def program_dims(program: Program) -> frozenset[str]:
    """The dim symbols the program's sizes name."""
    out: set[str] = set()
    for v in sizes_of(program):
        if type(v) is str:
            out |= free_dims(v)
    return frozenset(out)


def specialize(program: Program, env: Mapping[str, int]) -> Program:
    """The program for one set of dim values: every size evaluated to an int (launch sizes too), a
    plain static program the executor links and runs. Evaluation errors (a dim missing from `env`,
    a division by zero) are ArchiveErrors."""
    def ev(v):
        return v if type(v) is int else evaluate(v, env)

    def evs(xs):
        return tuple(v if type(v) is int else evaluate(v, env) for v in xs)

    def ref(r: TensorRef) -> TensorRef:
        return TensorRef(r.t, evs(r.shape), evs(r.stride), ev(r.offset))

    def arg(a):
        if isinstance(a, TensorRef):
            return ref(a)
        if isinstance(a, tuple):
            return tuple(arg(x) for x in a)
        return a

    def ins(i):
        if isinstance(i, Alloc):
            return Alloc(i.buf, ev(i.offset), evs(i.shape), i.dtype, i.host)
        if isinstance(i, Launch):
            kernel, grid = i.pick(ev(i.on), env) if i.choose else (i.kernel, i.grid)
            return Launch(kernel, evs(grid), i.args, evs(i.sizes))
        if isinstance(i, Extern):
            return Extern(i.target, arg(i.args), {k: arg(v) for k, v in i.kwargs.items()}, i.out, ref(i.out_view),
                          i.out_variant, evs(i.shape), i.dtype,
                          tuple(ExternOut(o.out, ref(o.out_view), evs(o.shape), o.dtype) for o in i.outs))
        if isinstance(i, Return):
            return Return(tuple(ref(o) for o in i.outputs))
        return i

    return Program(program.version, tuple(ProgramInput(i.buf, evs(i.shape), i.dtype) for i in program.inputs),
                   program.weights, program.weight_specs, ev(program.arena_bytes), program.rng,
                   tuple(ins(i) for i in program.instructions))
