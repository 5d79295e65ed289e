"""The archive's manifest (in the container's table of contents) and the train info inside it.

Adding a field (keyword inputs, structured outputs, buffer mutations, ...): give it a default that
means "as before" and write it only when set (`put_optional`), add it to `from_dict`'s optional
keys, to `runtime/validate.py` and to artifacts/FORMAT.md, and bump `PROGRAM_VERSION` (program.py)
so that an older runtime refuses the archive with "upgrade aotfuse" instead of misreading it.
Archives that do not use the field keep their bytes apart from the version.

Dynamic dims (program version 5): `Manifest.dims` declares each dim symbol (`DimSpec`: its label,
inclusive range and the example's size); an input's shape names a dynamic axis by its symbol
("s0"), and an output's shape may be a size expression over the symbols (contract/sizes.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ArchiveError
from ._codec import DAMAGED, decoding, fields, ints, put_optional, size_tuple, strs
from .sizes import SYMBOL, SizeExpr


@dataclasses.dataclass(frozen=True)
class DimSpec:
    """A dynamic dim: its symbol in programs and input shapes ("s0"), a label for messages (INPUT.AXIS,
    e.g. "tokens.1", or the torch Dim's name), the inclusive range the archive serves and the
    example's size (`hint`: what the build tuned for)."""

    sym: str
    name: str
    lo: int
    hi: int
    hint: int

    def __post_init__(self):
        where = f"dim {self.sym!r}"
        if type(self.sym) is not str or not SYMBOL.match(self.sym):
            raise ArchiveError(f"{where}: a dim symbol is s0, s1, ...", remedy=DAMAGED)
        if type(self.name) is not str or not self.name:
            raise ArchiveError(f"{where}: its name must be a non-empty string, got {self.name!r:.60}", remedy=DAMAGED)
        if not all(type(v) is int for v in (self.lo, self.hi, self.hint)):
            raise ArchiveError(f"{where} ({self.name}): lo, hi and hint must be integers", remedy=DAMAGED)
        if not 0 <= self.lo <= self.hint <= self.hi:
            raise ArchiveError(f"{where} ({self.name}): range {self.lo}..{self.hi} with hint {self.hint} is not "
                               "0 <= lo <= hint <= hi",
                               remedy="give a range that holds the example's size")

    def to_dict(self) -> dict:
        return {"sym": self.sym, "name": self.name, "lo": self.lo, "hi": self.hi, "hint": self.hint}

    @classmethod
    def from_dict(cls, d: Any) -> "DimSpec":
        d = fields(d, "manifest dim", ("sym", "name", "lo", "hi", "hint"))
        return cls(d["sym"], d["name"], d["lo"], d["hi"], d["hint"])


def input_axis(v) -> int | str:
    """An input spec's axis: an int, or a plain dim symbol (never an expression: a guard binds it)."""
    if type(v) is int or (type(v) is str and SYMBOL.match(v)):
        return v
    raise TypeError(f"{v!r} is not an integer or a dim symbol (s0, s1, ...)")


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """A user input's guard: name, shape (ints; a dynamic axis is its dim symbol, "s0"), dtype (torch's
    spelling, "torch.float32"), and how valid values are drawn: kind "float" | "int" | "bool", ints in
    [low, high) when known."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str
    kind: str
    low: int | None = None
    high: int | None = None
    # The memory layout the input must have when it is not row-major: strides of a dense,
    # non-overlapping tensor (channels-last images). None: contiguous. Kernels read it in place.
    stride: tuple[int, ...] | None = None

    def to_dict(self) -> dict:
        d = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "kind": self.kind,
             "low": self.low, "high": self.high}
        if self.stride is not None:  # absent for row-major inputs: those archives stay byte-identical
            d["stride"] = list(self.stride)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "InputSpec":
        d = fields(d, "input spec", ("name", "shape", "dtype"), ("kind", "low", "high", "stride"))
        kind = d.get("kind") or _kind(d["dtype"])
        shape = tuple(input_axis(v) for v in d["shape"])
        stride = None if d.get("stride") is None else ints(d["stride"])
        if stride is not None and any(type(v) is str for v in shape):
            raise ArchiveError(f"input spec {d['name']!r}: dynamic dims with a non-contiguous layout (strides "
                               f"{stride}) are not supported yet",
                               remedy="build with a contiguous example input, or keep that input's dims static")
        if stride is not None and not dense_strides(shape, stride):
            raise ArchiveError(f"input spec {d['name']!r}: strides {stride} do not lay out shape {shape} densely "
                               "without overlap", remedy=DAMAGED)
        return cls(d["name"], shape, d["dtype"], kind, d.get("low"), d.get("high"), stride)


def dense_strides(shape, stride) -> bool:
    """Whether `stride` lays `shape` out densely without overlap (a permutation of row-major strides;
    size-1 dims may have any stride)."""
    if len(shape) != len(stride):
        return False
    expect = 1
    for n, st in sorted(((n, st) for n, st in zip(shape, stride) if n != 1), key=lambda p: p[1]):
        if st != expect:
            return False
        expect *= n
    return True


def same_layout(shape, stride, want) -> bool:
    """Whether a tensor of `shape` with `stride` has the layout `want` (strides of size-1 dims ignored)."""
    return all(n == 1 or a == b for n, a, b in zip(shape, stride, want))


def _kind(dtype: str) -> str:
    if dtype == "torch.bool":
        return "bool"
    return "float" if dtype.startswith(("torch.float", "torch.bfloat", "torch.complex")) else "int"


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """An output of the forward program: shape (sizes: ints, or size expressions over the dims) and
    dtype ("torch.float32")."""

    shape: tuple[SizeExpr, ...]
    dtype: str

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: Any) -> "OutputSpec":
        d = fields(d, "output spec", ("shape", "dtype"))
        return cls(size_tuple(d["shape"], "output shape"), d["dtype"])


def backward_programs(n: int) -> tuple[str, ...]:
    """The backward's program names: "backward", then "backward_1" ... for a staged backward."""
    return ("backward",) + tuple(f"backward_{k}" for k in range(1, n))


@dataclasses.dataclass(frozen=True)
class TrainInfo:
    """What a train archive's programs mean (aotfuse/partition/programs.py, aotfuse/partition/step.py).

    mode "split": two programs. The forward program takes `params` (archive weights, in order), then `mutated_buffers` (archive
    weights holding their initial values), then the user inputs, and returns the loss, then the new
    value of each mutated buffer (same order, same shape and dtype; the runtime copies it into the
    module's buffer), then `n_saved` tensors for the backward; the backward takes those and the
    loss's gradient and returns one gradient per `grads` entry: ("param", name) or ("input", index).

    mode "step" (a scalar loss): one program, "step", takes the forward's inputs and returns the loss, the
    buffer updates, then one gradient per `grads` entry computed for a loss gradient of 1; the runtime's
    backward multiplies each gradient in place by the actual loss gradient with kernel `scale_kernels[i]`
    (args: the gradient, written; the loss gradient, read), which does nothing when it is 1. n_saved is 0.

    A staged backward (mode "split", `stages` non-empty; partition/stages.py): programs "backward",
    "backward_1", ... run in order; stage k takes the saved tensors and the loss's gradient, then the
    `carries[k-1]` values stage k-1 returned after its gradients; it returns the gradients `stages[k]`
    (indices into `grads`, in order), then `carries[k]` values for stage k+1."""

    params: tuple[str, ...]
    buffers: tuple[str, ...]  # buffers the forward only reads, baked in as weights
    user_inputs: tuple[InputSpec, ...]
    grads: tuple[tuple[str, Any], ...]
    n_saved: int
    saved_bytes: int
    # buffers the forward updates (train-mode BatchNorm's running statistics and num_batches_tracked);
    # program version 4, written only when there are some
    mutated_buffers: tuple[str, ...] = ()
    mode: str = "split"  # "split" | "step"; written only when "step"
    scale_kernels: tuple[str, ...] = ()  # mode "step": per gradient, the kernel that scales it in place
    stages: tuple[tuple[int, ...], ...] = ()  # a staged backward: per stage, its gradients (indices into grads)
    carries: tuple[int, ...] = ()  # ... and the values it carries on to the next stage
    # per param, the strides of its layout when not row-major (a channels-last conv filter: the programs
    # read it and write its gradient in that order; the runtime makes the Parameter so); empty: all
    # row-major (not written)
    param_strides: tuple[tuple[int, ...] | None, ...] = ()

    @property
    def programs(self) -> tuple[str, ...]:
        if self.mode == "step":
            return ("step",)
        return ("forward",) + backward_programs(len(self.stages) or 1)

    @property
    def state_inputs(self) -> tuple[str, ...]:
        """The archive weights the forward program takes before the user inputs, in order."""
        return self.params + self.mutated_buffers

    def to_dict(self) -> dict:
        out = {"params": list(self.params), "buffers": list(self.buffers),
               "user_inputs": [s.to_dict() for s in self.user_inputs], "grads": [list(g) for g in self.grads],
               "n_saved": self.n_saved, "saved_bytes": self.saved_bytes}
        out = put_optional(out, "mutated_buffers", list(self.mutated_buffers), [])
        out = put_optional(out, "mode", self.mode, "split")
        out = put_optional(out, "stages", [list(st) for st in self.stages], [])
        out = put_optional(out, "carries", list(self.carries), [])
        out = put_optional(out, "param_strides", [None if st is None else list(st) for st in self.param_strides], [])
        return put_optional(out, "scale_kernels", list(self.scale_kernels), [])

    @classmethod
    def from_dict(cls, d: Any) -> "TrainInfo":
        d = fields(d, "manifest.train", ("params", "grads", "n_saved"),
                   ("buffers", "user_inputs", "saved_bytes", "mutated_buffers", "mode", "scale_kernels", "stages",
                    "carries", "param_strides"))
        strides = tuple(None if st is None else ints(st) for st in d.get("param_strides", ()))  # checked: runtime/validate
        return cls(strs(d["params"]), strs(d.get("buffers", ())),
                   tuple(InputSpec.from_dict(s) for s in d.get("user_inputs", ())),
                   tuple((g[0], g[1]) for g in d["grads"]), d["n_saved"], d.get("saved_bytes", 0),
                   strs(d.get("mutated_buffers", ())), d.get("mode", "split"), strs(d.get("scale_kernels", ())),
                   tuple(tuple(int(i) for i in st) for st in d.get("stages", ())),
                   tuple(int(c) for c in d.get("carries", ())), strides)


@dataclasses.dataclass(frozen=True)
class Manifest:
    format: str  # "aotfuse"
    aotfuse_version: str
    torch_version: str
    targets: tuple[str, ...]  # cubin architectures ("sm_90")
    programs: tuple[str, ...]  # ("forward",); train: ("forward", "backward") or ("step",)
    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]  # a train archive: the loss only
    single_output: bool  # the model returned one tensor (not a tuple)
    kernels: tuple[str, ...]  # names in the kernels part, sorted
    train: TrainInfo | None = None
    # How the program's flat inputs and outputs map to the model's call (plain data, see FORMAT.md):
    # {"inputs": {"positional": n, "keywords": [name, ...]}, "outputs": tree, "loss_leaf"?: int};
    # None in archives written before it was recorded (positional tensors in, a tensor or tuple out).
    call: dict | None = None
    # dynamic dims (program version 5), in symbol order; empty (and not written) for static archives
    dims: tuple[DimSpec, ...] = ()

    def __post_init__(self):
        syms = [d.sym for d in self.dims]
        if len(set(syms)) != len(syms):
            raise ArchiveError(f"manifest dims declare a symbol twice: {syms}", remedy=DAMAGED)

    def to_dict(self) -> dict:
        out = {"format": self.format, "aotfuse_version": self.aotfuse_version, "torch_version": self.torch_version,
               "targets": list(self.targets), "programs": list(self.programs),
               "inputs": [s.to_dict() for s in self.inputs], "outputs": [s.to_dict() for s in self.outputs],
               "single_output": self.single_output, "kernels": list(self.kernels)}
        if self.train is not None:
            out["train"] = self.train.to_dict()
        if self.call is not None:
            out["call"] = self.call
        if self.dims:  # absent in static archives: their manifests keep their bytes
            out["dims"] = [d.to_dict() for d in self.dims]
        return out

    @classmethod
    def from_dict(cls, d: Any) -> "Manifest":
        with decoding("manifest"):
            d = fields(d, "manifest", ("format", "programs", "inputs", "outputs"),
                       ("aotfuse_version", "torch_version", "targets", "single_output", "kernels", "train", "call",
                        "dims"))
            train = d.get("train")
            dims = d.get("dims", [])
            if type(dims) is not list:
                raise TypeError("dims is not a list")
            return cls(d["format"], d.get("aotfuse_version", "?"), d.get("torch_version", "?"),
                       strs(d.get("targets", ())), strs(d["programs"]),
                       tuple(InputSpec.from_dict(s) for s in d["inputs"]),
                       tuple(OutputSpec.from_dict(s) for s in d["outputs"]), d.get("single_output", True),
                       strs(d.get("kernels", ())), None if train is None else TrainInfo.from_dict(train),
                       _call(d.get("call")), tuple(DimSpec.from_dict(x) for x in dims))

    def dim(self, sym: str) -> DimSpec | None:
        """The declared dim named `sym`, if any."""
        return next((d for d in self.dims if d.sym == sym), None)


def _call(c: Any) -> dict | None:
    """The manifest's call map, checked for shape (its tree is plain data the runtime walks)."""
    if c is None:
        return None
    c = fields(c, "manifest call", ("inputs", "outputs"), ("loss_leaf",))
    ins = fields(c["inputs"], "manifest call inputs", ("positional", "keywords"), ("constants",))
    if type(ins["positional"]) is not int or ins["positional"] < 0:
        raise ArchiveError("manifest call inputs: 'positional' must be a non-negative int", remedy=DAMAGED)
    strs(ins["keywords"])
    consts = ins.get("constants", {})
    if type(consts) is not dict or any(type(k) is not str or not (v is None or type(v) in (bool, int, float, str))
                                       for k, v in consts.items()) or set(consts) & set(ins["keywords"]):
        raise ArchiveError("manifest call inputs: 'constants' must map names (not keyword tensors') to None, bool, "
                           "int, float or str", remedy=DAMAGED)
    return c
