"""Load-time validation: an archive's manifest, kernel table and programs, before anything runs.

Checksums prove the bytes are the ones a writer signed, not that the writer was aotfuse or that it
was right. Everything `load` reads from an archive passes through here first, so a wrong program is
an `ArchiveError` naming the program and the instruction, never a `KeyError` / `TypeError` in the
middle of a call, a hang in the CPU interpreter, or (on the GPU) a kernel launched on a buffer
smaller than it reads or writes.

What is checked (see artifacts/FORMAT.md, "Payload"):
- manifest: inputs/outputs specs, program list, train info, and that they agree with the programs;
- kernels part (runtime/validate_kernels.py): names, block sizes, grid, argument dtypes (and, since
  program version 2, the element count each argument was generated for and the iteration space;
  since version 5, the names of the int32 size parameters after the pointers);
- each program, walked in order like the executor walks it: every buffer defined before use, never
  twice, not used after its free; arena allocations inside the arena; launches pass exactly the
  kernel's arguments with its dtypes and large enough buffers, on the kernel's grid; externs on the
  allow-list with arguments torch's meta kernels accept and a result the output view can hold;
  output views inside their buffers; exactly one `return`, at the end; weights with the dtype and
  shape the program says; the memory a program allocates bounded.

Dynamic dims (program version 5, a manifest with `dims`): the checks below compare numbers, so they
run on specialized payloads (every size expression evaluated): at load for the range ends and the
hint, and for each new shape before its first launch (runtime/validate_dims.py says how).

Pure: imports torch (meta tensors only) and the runtime's own tables; never triton.
"""
from __future__ import annotations

import dataclasses

import torch

from ..contract.manifest import backward_programs
from ..contract.program import DIMS_VERSION, PDL_VERSION, TILES_VERSION, check_program_version
from ..dtypes import ITEMSIZE, TORCH as DTYPES, name_of
from ..errors import ArchiveError
from .externs import ALLOWED
from .validate_extern import _Ref, _flat, _meta_check, _multi_check, _overlaps, returns_tuple
from .validate_hosts import _host_writes, _hosted
from .validate_kernels import _grid, validate_kernels
from .validate_fields import (ARENA_ALIGN, INDEX_LIMIT, INT32_MIN, KERNEL_PTR_ALIGN, MAX_BYTES,
                              MAX_EXTERN_ARG_DEPTH, MAX_INSTRUCTIONS, MAX_NUMEL, _align, _bool, _dict,
                              _dtype, _fail, _ident, _int, _list, _numel, _shape, _short, _str,
                              _torch_dtype_name, _ARCH, _IDENT)

# ---------------------------------------------------------------- manifest

def _spec(v, where: str, named: bool) -> tuple[str, tuple[int, ...]]:
    _dict(v, where, ("name", "shape", "dtype") if named else ("shape", "dtype"))
    if named:
        _str(v["name"], f"{where}.name")
    return _torch_dtype_name(v["dtype"], f"{where}.dtype"), _shape(v["shape"], f"{where}.shape")


def validate_manifest(manifest) -> None:
    """The manifest fields `load`, a call and `inspect` read: format, programs, inputs, outputs, targets, train
    (and dims: their declarations, and the symbols input and output shapes name)."""
    if type(manifest) is not dict or manifest.get("format") != "aotfuse":
        raise ArchiveError("archive manifest does not say format 'aotfuse'")
    m = _dict(manifest, "manifest", ("programs", "inputs", "outputs"))
    progs = _list(m["programs"], "manifest.programs", 1, 8)
    for i, p in enumerate(progs):
        _ident(p, f"manifest.programs[{i}]")
    if progs != ["forward"] and m.get("train") is None:
        _fail("manifest.programs", f"expected ['forward'] (no train info), got {_short(progs)}")
    if "dims" in m:
        from .validate_dims import validate_manifest_dims

        validate_manifest_dims(m)  # declarations, and input / output shapes over them
    else:
        for i, s in enumerate(_list(m["inputs"], "manifest.inputs", 0, 4096)):
            _spec(s, f"manifest.inputs[{i}]", named=True)
        for i, s in enumerate(_list(m["outputs"], "manifest.outputs", 1, 4096)):
            _spec(s, f"manifest.outputs[{i}]", named=False)
    if "single_output" in m:
        _bool(m["single_output"], "manifest.single_output")
    for i, t in enumerate(_list(m.get("targets", []), "manifest.targets", 0, 16)):  # shown by inspect
        if type(t) is not str or not _ARCH.match(t):
            _fail(f"manifest.targets[{i}]", f"is not an architecture like 'sm_90': {_short(t)}")
    if m.get("train") is not None:
        _train_info(m["train"], progs)
        if m["train"].get("user_inputs", m["inputs"]) != m["inputs"]:
            _fail("manifest.train.user_inputs", "differ from manifest.inputs")


def _train_info(t, progs: list) -> None:
    t = _dict(t, "manifest.train", ("params", "grads", "n_saved"))
    mode = t.get("mode", "split")
    if mode not in ("split", "step"):
        _fail("manifest.train.mode", f"is not 'split' or 'step': {_short(mode)}")
    stages = _list(t.get("stages", []), "manifest.train.stages", 0, 7)
    carries = _list(t.get("carries", []), "manifest.train.carries", 0, 7)
    want = ["step"] if mode == "step" else ["forward", *backward_programs(len(stages) or 1)]
    if progs != want:
        _fail("manifest.programs", f"a {mode} train archive has programs {want}, got {_short(progs)}")
    scales = _list(t.get("scale_kernels", []), "manifest.train.scale_kernels", 0, 1 << 16)
    for i, k in enumerate(scales):
        _str(k, f"manifest.train.scale_kernels[{i}]")
    if mode == "split" and scales:
        _fail("manifest.train.scale_kernels", "a split train archive has no scaling kernels")
    params = _list(t["params"], "manifest.train.params", 0, 1 << 16)
    for i, p in enumerate(params):
        _str(p, f"manifest.train.params[{i}]")
    if len(set(params)) != len(params):
        _fail("manifest.train.params", "names a parameter twice")
    strides = _list(t.get("param_strides", []), "manifest.train.param_strides", 0, 1 << 16)
    if strides and len(strides) != len(params):
        _fail("manifest.train.param_strides", f"{len(strides)} entries for {len(params)} parameters")
    for i, st in enumerate(strides):
        if st is not None:
            for j, v in enumerate(_list(st, f"manifest.train.param_strides[{i}]", 1, 8)):
                _int(v, f"manifest.train.param_strides[{i}][{j}]", 0, 1 << 40)
    mutated = _list(t.get("mutated_buffers", []), "manifest.train.mutated_buffers", 0, 1 << 16)
    for i, b in enumerate(mutated):
        _str(b, f"manifest.train.mutated_buffers[{i}]")
    if len(set(mutated)) != len(mutated) or set(mutated) & set(params):
        _fail("manifest.train.mutated_buffers", "names a buffer twice, or a parameter")
    _int(t["n_saved"], "manifest.train.n_saved", 0, 1 << 20)
    owners = set()
    for i, g in enumerate(_list(t["grads"], "manifest.train.grads", 0, 1 << 16)):
        where = f"manifest.train.grads[{i}]"
        _list(g, where, 2, 2)
        owner = (str(g[0]), str(g[1]))
        if owner in owners:  # two gradients for one owner: the runtime would hand over only one of them
            _fail(where, f"names {_short(g[0])} {_short(g[1])} a second time")
        owners.add(owner)
        if g[0] == "param":
            if g[1] not in params:
                _fail(where, f"names parameter {_short(g[1])}, which is not in manifest.train.params")
        elif g[0] == "input":
            if type(g[1]) is not int and not (type(g[1]) is str and g[1].isdigit() and len(g[1]) < 8):
                _fail(where, f"expected an input index, got {_short(g[1])}")
        else:
            _fail(where, f"expected kind 'param' or 'input', got {_short(g[0])}")
    if mode == "step" and len(scales) != len(t["grads"]):
        _fail("manifest.train.scale_kernels", f"{len(scales)} kernels for {len(t['grads'])} gradients")
    if stages and mode == "step":
        _fail("manifest.train.stages", "a fused step has no backward to stage")
    if len(carries) != len(stages):
        _fail("manifest.train.carries", f"{len(carries)} entries for {len(stages)} stages")
    seen = []
    for k, st in enumerate(stages):
        for i, g in enumerate(_list(st, f"manifest.train.stages[{k}]", 0, 1 << 16)):
            seen.append(_int(g, f"manifest.train.stages[{k}][{i}]", 0, len(t["grads"]) - 1))
        _int(carries[k], f"manifest.train.carries[{k}]", 0, 0 if k == len(stages) - 1 else 1 << 16)
    if stages and sorted(seen) != list(range(len(t["grads"]))):
        _fail("manifest.train.stages", "do not name each gradient exactly once")


# ---------------------------------------------------------------- programs

@dataclasses.dataclass
class _Buf:
    dtype: str
    shape: tuple[int, ...]
    kind: str  # "input" | "weight" | "rng" | "alloc" | "extern"
    numel: int = 0

    def __post_init__(self):
        self.numel = _numel(self.shape)


@dataclasses.dataclass(frozen=True)
class ProgramSig:
    """What a validated program takes and returns: (dtype name, shape) per input and output."""

    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    outputs: tuple[tuple[str, tuple[int, ...]], ...]


class _Walk:
    """One pass over a program's instructions in order, tracking which buffers are live."""

    def __init__(self, pname: str, prog: dict, kernels: dict, weights: dict[str, torch.Tensor],
                 empty_ok: bool = False):
        self.pname = pname
        self.grid_lo = 0 if empty_ok else 1
        self.prog = prog
        self.kernels = kernels
        self.live: dict[str, _Buf] = {}
        self.freed: dict[str, int] = {}  # buffer -> index of the instruction that freed it
        self.where = f"program {pname!r}"
        self.arena = _int(prog["arena_bytes"], f"{self.where}: arena_bytes", 0, MAX_BYTES)
        self.arena_end = 0  # furthest byte an arena alloc reaches
        self.arena_sum = 0  # every arena alloc's bytes, aligned: the arena of a plan that reused nothing
        # a program specialized from dims: its arena is a plan for the whole range (schedule/memplan.py
        # _symbolic_plan), at least this shape's reach and at most the allocations stacked
        self.dynamic = prog.get("version", 0) >= 5
        self.arena_live: dict[str, tuple[int, int]] = {}  # live arena buffers: name -> [start, end) bytes
        self.donated: dict[str, int] = {}  # inputs whose bytes allocs took (version 8) -> their bytes
        self.host_bytes: dict[str, int] = {}  # buffers whose bytes allocs took (inputs and own allocs) -> bytes
        self.hosted_live: dict[str, tuple[str, int, int]] = {}  # live buffers in them: name -> (host, start, end)
        self.pending: set[str] = set()  # donated inputs the next launch or extern may still read
        self.own: set[str] = set()  # buffers allocated on their own (offset -1): outputs may host others
        self.written: dict[str, int] = {}  # hosts an instruction wrote -> its index
        self.must_free: set[str] = set()  # buffers in a host just written: the next instruction frees them
        self.own_bytes = 0  # allocations outside the arena (offset -1) and extern results
        self.outputs: tuple = ()
        self.inputs = self._bind_inputs(prog["inputs"])
        self._bind_weights(prog, weights)
        self._bind_rng(prog.get("rng"))

    # -- bindings before the first instruction
    def _define(self, name, buf: _Buf, where: str) -> None:
        _str(name, where)
        if name in self.live or name in self.freed or name in self.donated:
            _fail(where, f"buffer {name!r} is defined twice")
        self.live[name] = buf

    def _bind_inputs(self, inputs) -> tuple:
        sig = []
        for i, s in enumerate(_list(inputs, f"{self.where}: inputs", 0, 1 << 16)):
            w = f"{self.where}: input {i}"
            _dict(s, w, ("buf", "shape", "dtype"))
            buf = _Buf(_dtype(s["dtype"], f"{w} dtype"), _shape(s["shape"], f"{w} shape"), "input")
            self._define(s["buf"], buf, w)
            sig.append((buf.dtype, buf.shape))
        return tuple(sig)

    def _bind_weights(self, prog: dict, weights: dict) -> None:
        table = _dict(prog["weights"], f"{self.where}: weights")
        specs = prog.get("weight_specs")
        if prog["version"] >= 2:
            specs = _dict(specs, f"{self.where}: weight_specs")
            if set(specs) != set(table):
                _fail(f"{self.where}: weight_specs", "do not name the same buffers as weights")
        for buf, fqn in table.items():
            w = f"{self.where}: weight buffer {_short(buf)}"
            t = weights.get(_str(fqn, w)) if type(fqn) is str else None
            if t is None:
                _fail(w, f"names weight {_short(fqn)}, which the archive does not contain")
            have = name_of(t.dtype)
            if have not in DTYPES:
                _fail(w, f"weight {fqn!r} has dtype {have}, which programs cannot use")
            if specs is not None:  # version 1 archives record no specs: the tensor defines the buffer
                sw = f"{w} spec"
                s = _dict(specs[buf], sw, ("shape", "dtype"))
                want = (_dtype(s["dtype"], f"{sw} dtype"), _shape(s["shape"], f"{sw} shape"))
                if want != (have, tuple(t.shape)):
                    _fail(w, f"weight {fqn!r} is {have}{list(t.shape)}, the program expects "
                             f"{want[0]}{list(want[1])}")
            self._define(buf, _Buf(have, tuple(t.shape), "weight"), w)

    def _bind_rng(self, rng) -> None:
        if rng is not None:  # the executor binds a fresh int64 [1] Philox seed here
            self._define(rng, _Buf("int64", (1,), "rng"), f"{self.where}: rng")

    # -- the instruction walk
    def run(self) -> ProgramSig:
        instrs = _list(self.prog["instructions"], f"{self.where}: instructions", 1, MAX_INSTRUCTIONS)
        for i, ins in enumerate(instrs):
            if type(ins) is not dict or type(ins.get("op")) is not str:
                _fail(f"{self.where}, instruction {i}", f"expected a map with an 'op', got {_short(ins)}")
            op = ins["op"]
            handler = _HANDLERS.get(op)
            where = f"{self.where}, instruction {i} ({op}{self._label(ins)})"
            if handler is None:
                _fail(where, f"unknown program instruction {op!r}")
            if op == "return" and i != len(instrs) - 1:
                _fail(where, "return is not the last instruction")
            if self.must_free and (op != "free" or type(ins.get("bufs")) is not list
                                   or not self.must_free <= set(map(str, ins["bufs"]))):
                _fail(where, f"buffer {sorted(self.must_free)[0]!r} lay in a host the previous instruction wrote "
                             "and is not freed here")
            handler(self, i, ins, where)
            self.must_free = set()
            if op in ("launch", "extern"):
                if self.host_bytes:
                    _host_writes(self, i, ins, where)
                for d in self.pending:
                    del self.live[d]
                self.pending.clear()
        if instrs[-1].get("op") != "return":
            _fail(self.where, "program has no return instruction at the end")
        self._check_totals()
        return ProgramSig(self.inputs, self.outputs)

    @staticmethod
    def _label(ins: dict) -> str:
        for key in ("kernel", "target", "buf"):
            if type(ins.get(key)) is str:
                return " " + _short(ins[key]).strip("'")
        return ""

    def _use(self, name, where: str) -> _Buf:
        buf = self.live.get(name) if type(name) is str else None
        if buf is not None:
            return buf
        if type(name) is str and name in self.freed:
            _fail(where, f"buffer {name!r} is used after its free at instruction {self.freed[name]}")
        if type(name) is str and name in self.donated:
            _fail(where, f"input {name!r} is used after an alloc took its bytes (a donated input is never read again)")
        _fail(where, f"buffer {_short(name)} is not defined")

    def _view(self, v, where: str) -> tuple[_Buf, dict]:
        """A strided view {t, shape, stride, offset}: its furthest element inside its base buffer."""
        _dict(v, where, ("t", "shape", "stride", "offset"))
        base = self._use(v["t"], where)
        shape = _shape(v["shape"], f"{where} shape")
        stride = _list(v["stride"], f"{where} stride", len(shape), len(shape))
        for j, s in enumerate(stride):
            _int(s, f"{where} stride[{j}]", 0, MAX_NUMEL)
        off = _int(v["offset"], f"{where} offset", 0, MAX_NUMEL)
        if 0 in shape:
            last = off - 1  # an empty view touches nothing, but its offset must still be in range
        else:
            last = off + sum((d - 1) * s for d, s in zip(shape, stride))
        if last >= base.numel or off > base.numel:
            _fail(where, f"view of {v['t']!r} reaches element {max(last, off)}, the buffer has {base.numel}")
        return base, v

    def _check_totals(self) -> None:
        if self.arena > _align(self.arena_end, ARENA_ALIGN) and not (
                self.dynamic and self.arena <= _align(self.arena_sum, ARENA_ALIGN)):
            _fail(self.where, f"arena_bytes {self.arena} is more than its allocations reach "
                              f"({self.arena_end} bytes, {_align(self.arena_end, ARENA_ALIGN)} aligned)")
        if self.arena + self.own_bytes > MAX_BYTES:
            _fail(self.where, f"allocates {self.arena + self.own_bytes} bytes, more than {MAX_BYTES}")


# ---------------------------------------------------------------- instructions

def _alloc(w: _Walk, i: int, ins: dict, where: str) -> None:
    _dict(ins, where, ("buf", "offset", "shape", "dtype"))
    buf = _Buf(_dtype(ins["dtype"], f"{where}: dtype"), _shape(ins["shape"], f"{where}: shape"), "alloc")
    nbytes = buf.numel * ITEMSIZE[buf.dtype]
    off = _int(ins["offset"], f"{where}: offset", -1, MAX_BYTES)
    if "host" in ins:
        _hosted(w, ins, buf, off, nbytes, where)
        return
    if off < 0:
        w.own_bytes += nbytes
    else:
        if off % KERNEL_PTR_ALIGN:
            _fail(where, f"arena offset {off} is not a multiple of {KERNEL_PTR_ALIGN}")
        if off + nbytes > w.arena:
            _fail(where, f"bytes {off}..{off + nbytes} lie outside the arena of {w.arena} bytes")
        w.arena_end = max(w.arena_end, off + nbytes)
        w.arena_sum += _align(nbytes, ARENA_ALIGN)
        for other, (lo, hi) in w.arena_live.items():
            if off < hi and lo < off + nbytes:  # two live buffers in the same bytes: silent wrong results
                _fail(where, f"bytes {off}..{off + nbytes} overlap live buffer {other!r} at {lo}..{hi}")
    w._define(ins["buf"], buf, where)
    if off >= 0:
        w.arena_live[ins["buf"]] = (off, off + nbytes)
    else:
        w.own.add(ins["buf"])


def _launch(w: _Walk, i: int, ins: dict, where: str) -> None:
    _dict(ins, where, ("kernel", "grid", "args"))
    name = ins["kernel"]
    k = w.kernels.get(name) if type(name) is str else None
    if k is None:
        _fail(where, f"program launches kernel {_short(name)} that the archive does not contain")
    grid = _grid(ins["grid"], f"{where}: grid", w.grid_lo)
    if grid != k["grid"]:
        _fail(where, f"grid {grid} is not the kernel's grid {k['grid']}")
    _launch_sizes(w, ins, k, where)
    specs = k["args"]
    args = _list(ins["args"], f"{where}: args", 0, 1024)
    if len(args) != len(specs):
        _fail(where, f"passes {len(args)} arguments, the kernel takes {len(specs)} "
                     f"({', '.join(a['name'] for a in specs)})")
    if len(set(map(repr, args))) != len(args):
        _fail(where, "passes the same buffer twice")
    out_numels = []
    for j, (b, spec) in enumerate(zip(args, specs)):
        arg = f"argument {j} {_short(b)}"
        buf = w._use(b, f"{where}: {arg}")
        if buf.dtype != spec["dtype"]:
            _fail(where, f"{arg} is {buf.dtype}, the kernel's {spec['name']} is {spec['dtype']}")
        if "numel" in spec and buf.numel < spec["numel"]:
            verb = "writes" if spec["role"] == "out" else "reads"
            _fail(where, f"{arg} has {buf.numel} elements, the kernel {verb} {spec['numel']}")
        if "numel" in spec and spec["role"] == "out" and buf.numel != spec["numel"]:
            # a kernel writes every element of its outputs (their sizes are literals in its source)
            _fail(where, f"{arg} has {buf.numel} elements, the kernel writes exactly {spec['numel']}")
        if spec["role"] == "out":
            if buf.kind != "alloc":  # never write into the caller's inputs or the archive's weights
                _fail(where, f"{arg} is a {buf.kind} buffer, but the kernel writes its {spec['name']}")
            out_numels.append(buf.numel)
    if "xnumel" not in k:
        # Version 1 kernels record no sizes: a kernel stores at least one element per row, so each
        # output holds at least xnumel elements and the grid can be no larger than that implies.
        most = max(1, -(-min(out_numels) // k["xblock"]))
        if grid[0] > most:
            _fail(where, f"grid {grid} is larger than its outputs ({min(out_numels)} elements) imply")


def _launch_sizes(w: _Walk, ins: dict, k: dict, where: str) -> None:
    """A launch's int32 scalars (version 5): one per kernel size argument, each an int32."""
    sizes = ins.get("sizes", [])
    if "sizes" in ins and w.prog["version"] < DIMS_VERSION:
        _fail(where, f"a version {w.prog['version']} program has no launch sizes (version {DIMS_VERSION}+)")
    names = k.get("size_args", [])
    _list(sizes, f"{where}: sizes", len(names), len(names))
    for j, v in enumerate(sizes):
        _int(v, f"{where}: size {j} ({names[j]})", INT32_MIN, INDEX_LIMIT)


def _extern(w: _Walk, i: int, ins: dict, where: str) -> None:
    _dict(ins, where, ("target", "args", "kwargs", "out", "out_view", "out_variant", "shape", "dtype"))
    if "outs" in ins:
        _extern_results(w, ins, where)
        return
    target = ins["target"]
    fn = ALLOWED.get(target) if type(target) is str else None
    if fn is None:
        _fail(where, f"calls {_short(target)}, which is not on the runtime's extern allow-list")
    out_variant = _bool(ins["out_variant"], f"{where}: out_variant")
    if out_variant != target.endswith(".out"):
        _fail(where, f"out_variant is {out_variant} for {target}")
    dtype = _dtype(ins["dtype"], f"{where}: dtype")
    shape = _shape(ins["shape"], f"{where}: shape")
    out = _str(ins["out"], f"{where}: out")
    args, kwargs = _call_args(w, ins, where)
    if any(isinstance(a, _Ref) and a.name == out for a in _flat(args + list(kwargs.values()))):
        _fail(where, f"reads its own output {out!r}")
    if out_variant:
        buf = w._use(out, f"{where}: out")
        if buf.kind != "alloc" or (buf.dtype, buf.shape) != (dtype, shape):
            _fail(where, f"output {out!r} is a {buf.kind} {buf.dtype}{list(buf.shape)}, "
                         f"the instruction says {dtype}{list(shape)}")
    else:
        buf = _Buf(dtype, shape, "extern")
        w._define(out, buf, f"{where}: out")
        w.own_bytes += buf.numel * ITEMSIZE[dtype]
    _, ov = w._view(ins["out_view"], f"{where}: out_view")
    if ov["t"] != out:
        _fail(where, f"out_view is a view of {ov['t']!r}, not of the output {out!r}")
    if _overlaps(ov["shape"], ov["stride"]):  # torch refuses to write through such a view
        _fail(where, f"out_view strides {ov['stride']} make elements overlap")
    if _numel(ov["shape"]) != buf.numel:  # the writer makes every output a (permuted) view of all of it
        _fail(where, f"out_view holds {_numel(ov['shape'])} of the output's {buf.numel} elements")
    if returns_tuple(fn):  # a tuple-returning op binding one result (its output_mask asks for one)
        _multi_check(fn, args, kwargs, [(dtype, tuple(ov["shape"]))], where)
    else:
        _meta_check(fn, args, kwargs, ov, dtype, where)


def _call_args(w: _Walk, ins: dict, where: str) -> tuple[list, dict]:
    """An extern's positional and keyword arguments, each checked (keywords: identifiers, never `out`)."""
    args = [_arg(w, a, f"{where}: argument {j}", 1) for j, a in enumerate(_list(ins["args"], f"{where}: args", 0, 32))]
    kwargs = _dict(ins["kwargs"], f"{where}: kwargs")
    for key in kwargs:
        if type(key) is not str or not _IDENT.match(key) or key == "out":
            _fail(where, f"keyword argument {_short(key)} is not allowed")
    return args, {key: _arg(w, v, f"{where}: keyword {key}", 1) for key, v in kwargs.items()}


def _extern_results(w: _Walk, ins: dict, where: str) -> None:
    """A multi-output extern (version 3+): a non-out op returning a tuple, whose results define `out`
    then each of `outs`; its arguments and every result are checked by the op's written-out rule."""
    if w.prog["version"] < 3:
        _fail(where, f"a version {w.prog['version']} program has no multi-output externs ('outs' is version 3+)")
    target = ins["target"]
    fn = ALLOWED.get(target) if type(target) is str else None
    if fn is None:
        _fail(where, f"calls {_short(target)}, which is not on the runtime's extern allow-list")
    if _bool(ins["out_variant"], f"{where}: out_variant"):
        _fail(where, "a multi-output extern is never an out variant")
    extra = _list(ins["outs"], f"{where}: outs", 1, 8)
    results = [{"out": ins["out"], "out_view": ins["out_view"], "shape": ins["shape"], "dtype": ins["dtype"]}]
    for j, r in enumerate(extra):
        results.append(_dict(r, f"{where}: outs[{j}]", ("out", "out_view", "shape", "dtype")))
    args, kwargs = _call_args(w, ins, where)
    names = [r["out"] for r in results]
    if any(isinstance(a, _Ref) and a.name in names for a in _flat(args + list(kwargs.values()))):
        _fail(where, "reads one of its own outputs")
    declared = []
    for j, r in enumerate(results):
        rw = f"{where}: result {j}"
        dtype, shape = _dtype(r["dtype"], f"{rw} dtype"), _shape(r["shape"], f"{rw} shape")
        out = _str(r["out"], f"{rw} out")
        buf = _Buf(dtype, shape, "extern")
        w._define(out, buf, rw)
        w.own_bytes += buf.numel * ITEMSIZE[dtype]
        _, ov = w._view(r["out_view"], f"{rw} out_view")
        if ov["t"] != out:
            _fail(rw, f"out_view is a view of {ov['t']!r}, not of the output {out!r}")
        if _overlaps(ov["shape"], ov["stride"]):
            _fail(rw, f"out_view strides {ov['stride']} make elements overlap")
        if _numel(ov["shape"]) != buf.numel:
            _fail(rw, f"out_view holds {_numel(ov['shape'])} of the output's {buf.numel} elements")
        declared.append((dtype, tuple(ov["shape"])))
    _multi_check(fn, args, kwargs, declared, where)


def _arg(w: _Walk, a, where: str, depth: int):
    """A decoded extern argument: scalars as they are, views as _Ref, lists recursively (bounded)."""
    if a is None or type(a) in (bool, int, float):
        return a
    if type(a) is str:
        return _str(a, where)
    if type(a) is dict:
        base, v = w._view(a, where)
        return _Ref(v["t"], base.dtype, tuple(v["shape"]), tuple(v["stride"]))
    if type(a) is list and depth < MAX_EXTERN_ARG_DEPTH:
        _list(a, where, 0, 64)
        return [_arg(w, x, f"{where}[{j}]", depth + 1) for j, x in enumerate(a)]
    _fail(where, f"is not an extern argument (scalar, tensor view or short list): {_short(a)}")


def _free(w: _Walk, i: int, ins: dict, where: str) -> None:
    _dict(ins, where, ("bufs",))
    for b in _list(ins["bufs"], f"{where}: bufs", 1, 1 << 16):
        w._use(b, where)
        del w.live[b]
        w.arena_live.pop(b, None)
        w.hosted_live.pop(b, None)
        w.freed[b] = i


def _return(w: _Walk, i: int, ins: dict, where: str) -> None:
    _dict(ins, where, ("outputs",))
    outs = []
    for j, o in enumerate(_list(ins["outputs"], f"{where}: outputs", 1, 1 << 16)):
        base, v = w._view(o, f"{where}: output {j}")
        outs.append((base.dtype, tuple(v["shape"])))
    w.outputs = tuple(outs)


_HANDLERS = {"alloc": _alloc, "launch": _launch, "extern": _extern, "free": _free, "return": _return}


def validate_program(name: str, program, kernels: dict, weights: dict[str, torch.Tensor],
                     empty_ok: bool = False) -> ProgramSig:
    """Check one program against the (validated) kernels part and the archive's weights; empty_ok:
    see validate_kernels."""
    where = f"program {name!r}"
    p = _dict(program, where, ("version", "inputs", "weights", "arena_bytes", "instructions"))
    v = check_program_version(p["version"], where)
    if v >= 2 and any("xnumel" not in k for k in kernels.values()):
        _fail(where, f"version {v} program but the kernels part lacks per-argument sizes")
    if v < TILES_VERSION and any("grid" in b or "persistent" in b for k in kernels.values()
                                 for b in k["binaries"].values()):
        _fail(where, f"version {v} program but a kernel's binary has its own tiles (version {TILES_VERSION}+)")
    if v < PDL_VERSION and any("pdl" in b for k in kernels.values() for b in k["binaries"].values()):
        _fail(where, f"version {v} program but a kernel's binary has the PDL wait (version {PDL_VERSION}+)")
    return _Walk(name, p, kernels, weights, empty_ok).run()


# ---------------------------------------------------------------- the whole archive

def validate_archive(manifest: dict, kernels, programs: dict, weights: dict[str, torch.Tensor],
                     empty_ok: bool = False) -> None:
    """Everything `load` binds: kernels, programs, and the manifest's promises about them.
    `manifest` must have passed validate_manifest (it says which programs to read); with dims, all
    of them specialized (validate_dims.py)."""
    validate_kernels(kernels, empty_ok)
    sigs = {name: validate_program(name, p, kernels, weights, empty_ok) for name, p in programs.items()}
    train = manifest.get("train")
    fwd = sigs["step" if train and train.get("mode") == "step" else "forward"]
    ins = [_spec(s, "", True) for s in manifest["inputs"]]
    outs = [_spec(s, "", False) for s in manifest["outputs"]]
    if train:
        _check_train(train, sigs, weights, ins, outs, kernels)
    else:
        _same("manifest.inputs", "the forward program's inputs", ins, fwd.inputs)
        _same("manifest.outputs", "the forward program's outputs", outs, fwd.outputs)


def _same(what: str, other: str, want: list, got) -> None:
    want, got = [tuple(x) for x in want], [tuple(x) for x in got]
    if want != got:
        fmt = lambda xs: ", ".join(f"{d}{list(s)}" for d, s in xs) or "none"  # noqa: E731
        _fail(what, f"{fmt(want)} do not match {other}: {fmt(got)}")


def _state_specs(names, weights: dict, where: str, what: str) -> list:
    specs = []
    for p in names:
        t = weights.get(p)
        if t is None or name_of(t.dtype) not in DTYPES:
            _fail(where, f"{what} {p!r} is not a usable weight of the archive")
        specs.append((name_of(t.dtype), tuple(t.shape)))
    return specs


def _check_train(train: dict, sigs: dict, weights: dict, ins: list, outs: list, kernels: dict) -> None:
    params = _state_specs(train["params"], weights, "manifest.train.params", "parameter")
    mutated = train.get("mutated_buffers", [])
    bufs = _state_specs(mutated, weights, "manifest.train.mutated_buffers", "buffer")
    step = train.get("mode") == "step"  # a fused step (partition/step.py): one program, nothing saved
    first = "step" if step else "forward"
    fwd = sigs[first]
    _same(f"the {first} program's inputs", "train params + mutated buffers + manifest.inputs", params + bufs + ins,
          fwd.inputs)
    n_saved, n_mut = train["n_saved"], len(mutated)
    if step and n_saved != 0:
        _fail("manifest.train.n_saved", f"a step archive saves nothing between programs, got {n_saved}")
    if not step and len(fwd.outputs) != 1 + n_mut + n_saved:
        _fail("manifest.train.n_saved", f"the loss, {n_mut} buffer updates and {n_saved} saved tensors, "
                                        f"the forward returns {len(fwd.outputs)} outputs")
    _same("manifest.outputs", f"the {first} program's loss", outs, fwd.outputs[:1])
    # each buffer update has its buffer's dtype and shape (the runtime copies it into the buffer)
    _same("manifest.train.mutated_buffers", f"the {first} program's buffer updates", bufs, fwd.outputs[1:1 + n_mut])
    if step:
        _check_grads(train, params, ins, fwd.outputs[1 + n_mut:], "the step")
        _check_scale_kernels(train.get("scale_kernels", []), fwd.outputs[1 + n_mut:], kernels, outs[0][0])
        return
    # the backward takes the saved tensors, then the loss's gradient (a tensor like the loss); a staged
    # backward's stage k also what stage k-1 carried on, and returns its gradients, then what it carries on
    base = list(fwd.outputs[1 + n_mut:]) + [fwd.outputs[0]]
    stages, carries = train.get("stages", []), train.get("carries", [])
    if not stages:
        bwd = sigs["backward"]
        _same("the backward program's inputs", "the forward's saved tensors + the loss", base, bwd.inputs)
        _check_grads(train, params, ins, bwd.outputs, "the backward")
        return
    got = [None] * len(train["grads"])
    carried = []
    for k, name in enumerate(backward_programs(len(stages))):
        sig = sigs[name]
        _same(f"the {name} program's inputs", "the forward's saved tensors + the loss + the values carried "
              "into it", base + carried, sig.inputs)
        n = len(stages[k])
        if len(sig.outputs) != n + carries[k]:
            _fail("manifest.train.carries", f"program {name} returns {len(sig.outputs)} outputs, not "
                                            f"{n} gradients + {carries[k]} carried values")
        for i, out in zip(stages[k], sig.outputs[:n]):
            got[i] = out
        carried = list(sig.outputs[n:])
    _check_grads(train, params, ins, got, "the staged backward")


def _check_scale_kernels(names: list, grads: list, kernels: dict, loss_dtype: str) -> None:
    """Per gradient of a fused step, the kernel that scales it in place writes exactly that gradient and
    reads one loss-like value."""
    for i, (name, (dtype, shape)) in enumerate(zip(names, grads)):
        where = f"manifest.train.scale_kernels[{i}]"
        k = kernels.get(name)
        if k is None:
            _fail(where, f"names kernel {_short(name)}, which the archive does not contain")
        args = k["args"]
        if (len(args) != 2 or args[0]["role"] != "out" or args[0]["dtype"] != dtype
                or args[0].get("numel") != _numel(shape)
                or args[1]["role"] != "in" or args[1]["dtype"] != loss_dtype or args[1].get("numel") != 1):
            _fail(where, f"kernel {name} does not scale a {dtype}{list(shape)} gradient by a {loss_dtype} value")


def _check_grads(train: dict, params: list, ins: list, got_outputs, program: str) -> None:
    grads = train["grads"]
    if len(grads) != len(got_outputs):
        _fail("manifest.train.grads", f"{len(grads)} gradients, {program} returns {len(got_outputs)}")
    for (kind, ref), got in zip(grads, got_outputs):
        if kind == "param":
            want = params[train["params"].index(ref)]
        elif 0 <= int(ref) < len(ins):
            want = ins[int(ref)]
        else:
            _fail("manifest.train.grads", f"input {ref} does not exist ({len(ins)} inputs)")
        if tuple(want) != tuple(got):
            _fail("manifest.train.grads", f"gradient of {kind} {ref!r} is {got[0]}{list(got[1])}, "
                                          f"the {kind} is {want[0]}{list(want[1])}")
