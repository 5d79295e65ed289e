"""Load-time validation of an archive with dynamic dims (a manifest with `dims`, program version 5).

Validation works on numbers (a view inside its buffer, a kernel's grid covering its iteration space,
arena bounds, an extern's result shape on meta tensors), and a dynamic payload holds expressions.
So it runs in three steps:

1. Structure, at load (`validate_manifest_dims`, `read_dynamic`): the dims' declarations (symbols
   s0, s1, ... once each, labels, 0 <= lo <= hint <= hi < 2**31: kernels take dims as int32), input
   shapes of ints and declared symbols (each declared dim bound by some input: the guards bind it),
   output shapes, and every size expression in programs and kernels well-formed and over declared
   dims (`aotfuse.contract` parses each one against its whitelist). A malformed expression is an
   ArchiveError here, never an exception at call time.
2. Numbers at the range ends, at load (`read_dynamic`): the whole of validate.py's checks on the
   payload specialized at every dim's `lo`, at every dim's `hi` and at the hints. A build whose
   sizes are wrong fails at load, naming the dims' values.
3. Numbers at each shape, before its first launch (`validate_shape`, called by runtime/shapes.py
   when it specializes a program for a new shape): the specialized program and the kernels it
   launches, walked like a static program. Sizes are polynomials with floors and ceilings, and the
   range ends do not bound every check at every interior point (a `min`, a `%`), so no kernel is
   ever launched on a shape that was not checked. It costs one walk per new shape (a few ms for a
   GPT block; tests/test_dims_runtime.py measures it), beside one CUDA-graph capture.
"""
from __future__ import annotations

from typing import Mapping

import torch

from ..contract import Manifest, Program, kernels_from_dict, kernels_to_dict, specialize, specialize_kernel
from ..contract.kernels import KernelEntry, kernel_dims
from ..contract.program import Launch, program_dims
from ..contract.sizes import SYMBOL, check_size, evaluate, free_dims
from ..errors import ArchiveError
from .validate import validate_archive, validate_kernels, validate_program
from .validate_fields import (INDEX_LIMIT, MAX_DIMS, MAX_NAME, MAX_NUMEL, _REMEDY, _dict, _fail, _int, _list, _short,
                              _torch_dtype_name)

MAX_DYN_DIMS = 64


# ---------------------------------------------------------------- step 1: the manifest

def validate_manifest_dims(m: dict) -> None:
    """`dims`, and the input / output specs of a dynamic manifest (validate_manifest's part for them)."""
    syms = _declared(m["dims"])
    bound = set()
    for i, s in enumerate(_list(m["inputs"], "manifest.inputs", 0, 4096)):
        where = f"manifest.inputs[{i}]"
        _dict(s, where, ("name", "shape", "dtype"))
        if type(s["name"]) is not str or not 0 < len(s["name"]) <= MAX_NAME:
            _fail(f"{where}.name", f"expected a non-empty name, got {_short(s['name'])}")
        _torch_dtype_name(s["dtype"], f"{where}.dtype")
        for j, v in enumerate(_list(s["shape"], f"{where}.shape", 0, MAX_DIMS)):
            if type(v) is str:
                if v not in syms:
                    _fail(f"{where}.shape[{j}]", f"{_short(v)} is not a declared dim ({', '.join(sorted(syms))})")
                bound.add(v)
            else:
                _int(v, f"{where}.shape[{j}]", 0, MAX_NUMEL)
        if s.get("stride") is not None and any(type(v) is str for v in s["shape"]):
            raise ArchiveError(f"{where} ({s['name']!r}): dynamic dims with a non-contiguous layout (strides "
                               f"{_short(s['stride'])}) are not supported yet",
                               remedy="build with a contiguous example input, or keep that input's dims static")
    unbound = [x for x in syms if x not in bound]
    if unbound:
        _fail("manifest.dims", f"{', '.join(unbound)} appear in no input shape (a call could not bind them)")
    for i, s in enumerate(_list(m["outputs"], "manifest.outputs", 1, 4096)):
        where = f"manifest.outputs[{i}]"
        _dict(s, where, ("shape", "dtype"))
        _torch_dtype_name(s["dtype"], f"{where}.dtype")
        for j, v in enumerate(_list(s["shape"], f"{where}.shape", 0, MAX_DIMS)):
            _declared_size(v, f"{where}.shape[{j}]", syms)


def _declared(dims) -> dict[str, dict]:
    syms: dict[str, dict] = {}
    for i, d in enumerate(_list(dims, "manifest.dims", 1, MAX_DYN_DIMS)):
        where = f"manifest.dims[{i}]"
        _dict(d, where, ("sym", "name", "lo", "hi", "hint"))
        if set(d) - {"sym", "name", "lo", "hi", "hint"}:
            _fail(where, f"unknown field {sorted(set(d) - {'sym', 'name', 'lo', 'hi', 'hint'})[0]!r}")
        sym = d["sym"]
        if type(sym) is not str or not SYMBOL.match(sym) or len(sym) > 8:
            _fail(f"{where}.sym", f"expected a dim symbol like 's0', got {_short(sym)}")
        if sym in syms:
            _fail(f"{where}.sym", f"{sym} is declared twice")
        if type(d["name"]) is not str or not 0 < len(d["name"]) <= MAX_NAME:
            _fail(f"{where}.name", f"expected a non-empty label, got {_short(d['name'])}")
        lo = _int(d["lo"], f"{where}.lo", 0, INDEX_LIMIT)
        hi = _int(d["hi"], f"{where}.hi", lo, INDEX_LIMIT)
        _int(d["hint"], f"{where}.hint", lo, hi)
        syms[sym] = d
    return syms


def _declared_size(v, where: str, syms) -> None:
    check_size(v, where)
    undeclared = sorted(free_dims(v) - set(syms))
    if undeclared:
        _fail(where, f"size {_short(v)} names {', '.join(undeclared)}, which manifest.dims does not declare")
    if type(v) is int:
        _int(v, where, 0, MAX_NUMEL)


# ---------------------------------------------------------------- step 2: structure and range ends

def read_dynamic(m: dict, kernels: dict, programs: dict,
                 weights: dict[str, torch.Tensor]) -> tuple[Manifest, dict, dict]:
    """The typed manifest, kernels and programs of a dynamic archive, checked (steps 1 and 2 above).
    `m` must have passed validate_manifest; `programs` their version check."""
    manifest = Manifest.from_dict(m)
    typed_kernels = kernels_from_dict(kernels)
    typed_programs = {name: Program.from_dict(p, name) for name, p in programs.items()}
    declared = {d.sym for d in manifest.dims}
    for name, p in typed_programs.items():
        _only_declared(f"program {name!r}", program_dims(p), declared)
    for name, k in typed_kernels.items():
        _only_declared(f"kernel {name}", kernel_dims(k), declared)
    for name, p in typed_programs.items():
        for i, ins in enumerate(p.instructions):
            if isinstance(ins, Launch) and ins.choose:
                _variants(f"program {name!r}, instruction {i} (launch {ins.kernel})", ins, typed_kernels)
    for env in range_ends(manifest):
        try:
            progs = {n: specialize(p, env) for n, p in typed_programs.items()}
            # the kernels these shapes launch (a variant for another sub-range is checked at its shapes)
            used = {i.kernel for p in progs.values() for i in p.instructions if isinstance(i, Launch)}
            used |= set((m.get("train") or {}).get("scale_kernels", ()))  # a fused step's: the runtime launches them
            validate_archive(_specialize_manifest(m, env), kernels_to_dict(
                {n: specialize_kernel(k, env) for n, k in typed_kernels.items() if n in used}),
                {n: p.to_dict() for n, p in progs.items()}, weights, empty_ok=True)
        except ArchiveError as e:
            raise ArchiveError(f"at {dims_text(manifest, env)}: {e.message}", remedy=e.remedy) from None
    return manifest, typed_kernels, typed_programs


def _variants(where: str, ins: Launch, kernels: dict[str, KernelEntry]) -> None:
    """A launch's kernel variants (one per sub-range of its `on` size) exist and take what it passes:
    the same buffers (count and roles) and the same int32 sizes. Each runs only at the shapes whose `on`
    falls in its sub-range; validate_shape checks it, with its grid, before its first launch."""
    base = kernels.get(ins.kernel)
    if base is None:
        raise ArchiveError(f"{where}: no kernel {ins.kernel!r}", remedy=_REMEDY)
    for c in ins.choose:
        k = kernels.get(c.kernel)
        if k is None:
            raise ArchiveError(f"{where}: variant for {ins.on} <= {c.upto} names no kernel {c.kernel!r}", remedy=_REMEDY)
        if [(a.dtype, a.role) for a in k.args] != [(a.dtype, a.role) for a in base.args] or \
                tuple(k.size_args) != tuple(base.size_args) or not set(c.aligned) <= set(base.size_args):
            raise ArchiveError(f"{where}: variant {c.kernel} takes other arguments than {ins.kernel}", remedy=_REMEDY)


def _only_declared(where: str, used: frozenset, declared: set) -> None:
    extra = sorted(used - declared)
    if extra:
        raise ArchiveError(f"{where} uses dim {', '.join(extra)}, which manifest.dims does not declare "
                           f"(declared: {', '.join(sorted(declared)) or 'none'})", remedy=_REMEDY)


def range_ends(manifest: Manifest) -> list[dict[str, int]]:
    """The dim values load validates at: every dim at its lo, every dim at its hi, and the hints."""
    envs = []
    for field in ("lo", "hi", "hint"):
        env = {d.sym: getattr(d, field) for d in manifest.dims}
        if env not in envs:
            envs.append(env)
    return envs


def dims_text(manifest: Manifest, env: Mapping[str, int]) -> str:
    """'s0 = 2 (tokens.0), s1 = 64 (tokens.1)': dim values as messages name them."""
    return ", ".join(f"{d.sym} = {env[d.sym]} ({d.name})" for d in manifest.dims if d.sym in env)


def _specialize_manifest(m: dict, env: Mapping[str, int]) -> dict:
    """The manifest's dicts as a static archive at `env` would write them (input/output shapes evaluated)."""
    def spec(s: dict) -> dict:
        return {**s, "shape": [evaluate(v, env) for v in s["shape"]]}

    out = {k: v for k, v in m.items() if k != "dims"}
    out["inputs"] = [spec(s) for s in m["inputs"]]
    out["outputs"] = [spec(s) for s in m["outputs"]]
    if m.get("train") is not None and "user_inputs" in m["train"]:
        out["train"] = {**m["train"], "user_inputs": [spec(s) for s in m["train"]["user_inputs"]]}
    return out


# ---------------------------------------------------------------- step 3: one shape

def validate_shape(name: str, program: Program, kernels: Mapping[str, KernelEntry],
                   weights: dict[str, torch.Tensor], env: Mapping[str, int]) -> None:
    """A program specialized at `env` (and the kernels it launches, specialized alike): every check a
    static program gets, before its first launch."""
    used = {i.kernel for i in program.instructions if isinstance(i, Launch)}
    ks = kernels_to_dict({n: specialize_kernel(kernels[n], env) for n in sorted(used) if n in kernels})
    validate_kernels(ks, empty_ok=True)
    validate_program(name, program.to_dict(), ks, weights, empty_ok=True)
