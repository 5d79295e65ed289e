"""Load-time validation of the `kernels` part (and the CPU path's `sources` part): names, kinds, block
sizes, grids, arguments, the int32 size parameters of a kernel compiled for dynamic dims, the cubin
per target and the iteration space each kernel was generated for (artifacts/FORMAT.md, "Kernel ABI").
runtime/validate.py checks the programs against this table.

Pure: no torch, no triton.
"""
from __future__ import annotations

from .validate_fields import (GRID_X_MAX, GRID_YZ_MAX, INDEX_LIMIT, KINDS, MAX_BLOCK, MAX_NUMEL, MAX_SIZE_ARGS,
                              NUM_WARPS, _dict, _dtype, _fail, _ident, _int, _list, _short, _str, _ARCH)


def validate_kernels(kernels, empty_ok: bool = False) -> None:
    """empty_ok: a kernel's grid and iteration space may be empty (a specialized payload whose dims
    reach 0; its launches are skipped)."""
    _dict(kernels, "kernels part")
    if len(kernels) > 1 << 16:
        _fail("kernels part", f"{len(kernels)} kernels")
    for name, k in kernels.items():
        _kernel(_ident(name, "kernels part: kernel name"), k, empty_ok)


def _kernel(name: str, k, empty_ok: bool = False) -> None:
    where = f"kernel {name}"
    _dict(k, where, ("kind", "grid", "num_warps", "xblock", "rblock", "args", "binaries"))
    if k["kind"] not in KINDS:
        _fail(where, f"unknown kind {_short(k['kind'])}")
    grid = _grid(k["grid"], f"{where}: grid", 0 if empty_ok else 1)
    if grid[1:] != [1, 1]:  # kernels only read program_id(0): more y/z blocks would race on the same rows
        _fail(where, f"grid {grid} has y/z blocks; aotfuse kernels are 1-D")
    _int(k["num_warps"], f"{where}: num_warps", 1, 32)
    if k["num_warps"] not in NUM_WARPS:
        _fail(where, f"num_warps {k['num_warps']} is not a power of two")
    xb, rb = (_pow2(k[f], f"{where}: {f}") for f in ("xblock", "rblock"))
    if grid[0] > -(-INDEX_LIMIT // xb):
        _fail(where, f"grid {grid} x XBLOCK {xb} exceeds 32-bit indexing")
    _kernel_args(where, k["args"])
    if "size_args" in k:
        _size_args(where, k)
    if "persistent" in k:
        _int(k["persistent"], f"{where}: persistent", 1, 8)
        if k["kind"] != "template_mm":
            _fail(where, "persistent: only a matmul template's entry may be persistent")
    _binaries(where, k["binaries"], k["num_warps"] if k["kind"] == "template_mm" else None)
    if "xnumel" in k or "rnumel" in k:
        _kernel_sizes(where, k, xb, rb, grid, 0 if empty_ok else 1)


def _pow2(v, where: str) -> int:
    _int(v, where, 1, MAX_BLOCK)
    if v & (v - 1):
        _fail(where, f"{v} is not a power of two")
    return v


def _grid(v, where: str, lo: int = 1) -> list:
    _list(v, where, 3, 3)
    _int(v[0], f"{where} x", lo, GRID_X_MAX)
    _int(v[1], f"{where} y", 1, GRID_YZ_MAX)
    _int(v[2], f"{where} z", 1, GRID_YZ_MAX)
    return v


def _kernel_args(where: str, args) -> None:
    _list(args, f"{where}: args", 1, 1024)
    names = set()
    for i, a in enumerate(args):
        w = f"{where}: argument {i}"
        _dict(a, w, ("name", "dtype", "role"))
        names.add(_ident(a["name"], f"{w} name"))
        _dtype(a["dtype"], f"{w} dtype")
        if a["role"] not in ("in", "out"):
            _fail(w, f"role {_short(a['role'])} is not 'in' or 'out'")
        if "numel" in a:
            _int(a["numel"], f"{w} numel", 0, MAX_NUMEL)
    if len(names) != len(args):
        _fail(where, "two arguments have the same name")
    if not any(a["role"] == "out" for a in args):
        _fail(where, "no output argument")


def _size_args(where: str, k: dict) -> None:
    """The int32 parameters after the pointers (dynamic dims): identifiers, distinct from the pointers'."""
    names = _list(k["size_args"], f"{where}: size_args", 1, MAX_SIZE_ARGS)
    for i, n in enumerate(names):
        _ident(n, f"{where}: size_args[{i}]")
    taken = {a["name"] for a in k["args"]}
    if len(set(names)) != len(names) or taken & set(names):
        _fail(where, f"size_args {_short(names)} repeat a name or reuse an argument's")


def _binaries(where: str, bins, template_warps: int | None = None) -> None:
    """template_warps: a matmul template's entry warps (its binary may have 3x them: warp-specialized)."""
    _dict(bins, f"{where}: binaries")
    for arch, b in bins.items():
        if type(arch) is not str or not _ARCH.match(arch):
            _fail(where, f"binary arch {_short(arch)} is not like 'sm_90'")
        w = f"{where}: {arch} binary"
        _dict(b, w, ("cubin", "name", "num_warps", "shared", "global_scratch", "profile_scratch"))
        if type(b["cubin"]) is not bytes or not b["cubin"]:
            _fail(w, "cubin is not bytes")
        _str(b["name"], f"{w} name")
        # the compiled kernel's warps: the entry's, or 3 x them for a warp-specialized template (a producer
        # and two consumer warpgroups); the launch uses exactly this many
        _int(b["num_warps"], f"{w} num_warps", 1, 32)
        own = "grid" in b or "persistent" in b  # a template's binary with its target's own tiles (version 6)
        if own and template_warps is None:
            _fail(w, "grid / persistent: only a matmul template's binary may have its own tiles")
        if "grid" in b:
            g = _grid(b["grid"], f"{w} grid")
            if g[1:] != [1, 1]:
                _fail(w, f"grid {g} has y/z blocks; aotfuse kernels are 1-D")
        if "persistent" in b:
            _int(b["persistent"], f"{w} persistent", 0, 8)
        if "pdl" in b:  # compiled with the PDL wait (version 7): Hopper's griddepcontrol, so sm_90+ only
            if b["pdl"] is not True:
                _fail(w, f"pdl {_short(b['pdl'])} is not true (written only when set)")
            if int(arch[3:]) < 90:
                _fail(w, "pdl on a binary for a target before sm_90 (griddepcontrol is Hopper's)")
        # a warp-specialized template runs 3 x its warps (a producer and two consumer warpgroups): the entry's,
        # or, with its own tiles, its own
        ws = {3 * template_warps} if template_warps is not None else set()
        if own:
            ws |= {3 * x for x in NUM_WARPS if 3 * x <= 32}
        if b["num_warps"] not in NUM_WARPS and b["num_warps"] not in ws:
            _fail(w, f"num_warps {b['num_warps']} is not a power of two (nor 3 x a warp-specialized template's "
                     "warps)")
        _int(b["shared"], f"{w} shared", 0, 1 << 24)
        _int(b["global_scratch"], f"{w} global_scratch", 0, 1 << 40)
        _int(b["profile_scratch"], f"{w} profile_scratch", 0, 1 << 40)


def _kernel_sizes(where: str, k: dict, xb: int, rb: int, grid: list, lo: int = 1) -> None:
    x = _int(k.get("xnumel"), f"{where}: xnumel", lo, INDEX_LIMIT)
    r = _int(k.get("rnumel"), f"{where}: rnumel", lo, INDEX_LIMIT)
    if x * r > INDEX_LIMIT:
        _fail(where, f"iteration space {x} x {r} exceeds 32-bit indexing")
    if grid[0] != -(-x // xb):
        _fail(where, f"grid {grid} does not cover xnumel {x} in blocks of {xb} (expected {-(-x // xb)})")
    if k["kind"] == "pointwise" and (r != 1 or rb != 1):
        _fail(where, f"a pointwise kernel has rnumel {r}, RBLOCK {rb}")
    if k["kind"] == "persistent_reduction" and rb < r:
        _fail(where, f"persistent RBLOCK {rb} does not hold rnumel {r}")
    if any("numel" not in a for a in k["args"]):
        _fail(where, "records xnumel but not every argument's numel")


def validate_sources(sources, kernels: dict) -> None:
    """CPU path: one stored Triton source (text) per kernel; its content is checked by interpret.py."""
    _dict(sources, "sources part")
    for name in kernels:
        if type(sources.get(name)) is not str:
            _fail(f"kernel {name}", "has no stored source for the CPU path")


