"""The `kernels` part: kernel name -> how to launch it (arguments, grid) and its cubin per target.

Kernel ABI (artifacts/FORMAT.md, "Kernel ABI"): a cubin is loaded with `cuModuleLoadData` and its
function `Binary.name` launched with `cuLaunchKernel`: parameters are one device pointer per
`KernelEntry.args` entry, in order, then two trailing pointers (global scratch: `grid programs x
Binary.global_scratch` bytes owned by the launch site, or null when that is 0; profile scratch: null,
the runtime refuses kernels that need it); grid `KernelEntry.grid`; block
`32 * Binary.num_warps` threads; `Binary.shared` bytes of dynamic shared memory.

A kernel compiled for dynamic dims (program version 5) takes int32 scalars after its pointers, one
per `KernelEntry.size_args` name; each launch passes their values (`Launch.sizes`). Its sizes
(`grid`, `xnumel`, `rnumel`, an argument's `numel`) may be size expressions (contract/sizes.py);
`specialize_kernel` evaluates them for one set of dim values.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..errors import ArchiveError
from ._codec import DAMAGED, decoding, fields, put_optional, size_tuple, strs
from .sizes import SizeExpr, check_size, evaluate, free_dims

# A kernel source's last parameter, `AOTF_PDL: tl.constexpr = False` (emit/pdl.py): compiled True into an sm_90+
# binary that waits for its predecessor (Binary.pdl); not a launch argument.
PDL_PARAM = "AOTF_PDL"


@dataclasses.dataclass(frozen=True)
class KernelArg:
    name: str  # the parameter's name in the kernel's source
    dtype: str  # element dtype the kernel reads or writes ("float32")
    role: str  # "in" | "out"
    numel: SizeExpr | None = None  # elements the kernel touches (program version 2+; None in version 1)

    def to_dict(self) -> dict:
        return put_optional({"name": self.name, "dtype": self.dtype, "role": self.role}, "numel", self.numel)

    @classmethod
    def from_dict(cls, d: Any) -> "KernelArg":
        d = fields(d, "kernel argument", ("name", "dtype", "role"), ("numel",))
        numel = d.get("numel")
        return cls(d["name"], d["dtype"], d["role"], None if numel is None else check_size(numel, "argument numel"))


@dataclasses.dataclass(frozen=True)
class Binary:
    """One compiled cubin of a kernel for one target ("sm_90")."""

    cubin: bytes
    name: str  # the function's name in the cubin
    num_warps: int
    shared: int  # dynamic shared memory, bytes
    global_scratch: int  # bytes per program the kernel needs (TMA descriptors; the runtime allocates them)
    profile_scratch: int
    # program version 6: a matmul template compiled from its target's own tile configuration launches with
    # this grid and this many programs per SM instead of the entry's (and the launch's); None: the entry's.
    # Written only when set.
    grid: tuple[int, int, int] | None = None
    persistent: int | None = None
    # program version 7: compiled with the PDL wait (emit/pdl.py; sm_90+), so the runtime may launch it with
    # programmatic stream serialization. Written only when true.
    pdl: bool = False

    @property
    def own_tiles(self) -> bool:
        return self.grid is not None or self.persistent is not None

    def to_dict(self) -> dict:
        out = {"cubin": self.cubin, "name": self.name, "num_warps": self.num_warps, "shared": self.shared,
               "global_scratch": self.global_scratch, "profile_scratch": self.profile_scratch}
        put_optional(out, "grid", None if self.grid is None else list(self.grid))
        put_optional(out, "persistent", self.persistent)
        return put_optional(out, "pdl", True if self.pdl else None)

    @classmethod
    def from_dict(cls, d: Any) -> "Binary":
        d = fields(d, "binary", ("cubin", "name", "num_warps", "shared", "global_scratch", "profile_scratch"),
                   ("grid", "persistent", "pdl"))
        grid = d.get("grid")
        pdl = d.get("pdl", False)
        if type(pdl) is not bool:
            raise ArchiveError(f"binary {d['name']!r}: pdl must be a boolean, got {pdl!r}", remedy=DAMAGED)
        return cls(d["cubin"], d["name"], d["num_warps"], d["shared"], d["global_scratch"], d["profile_scratch"],
                   None if grid is None else size_tuple(grid, "binary grid"), d.get("persistent"), pdl)


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    kind: str  # "pointwise" | "persistent_reduction" | "looped_reduction"
    nodes: tuple[str, ...]  # the loop-IR nodes fused into it (informational)
    grid: tuple[SizeExpr, SizeExpr, SizeExpr]
    num_warps: int
    xblock: int
    rblock: int
    xnumel: SizeExpr | None  # iteration space (version 2+; None in version 1)
    rnumel: SizeExpr | None
    args: tuple[KernelArg, ...]
    binaries: dict  # target ("sm_90") -> Binary (read-only)
    launches: int = 1  # launches of it across the archive's programs (informational)
    # names of the int32 parameters after the pointers (dynamic dims; each launch passes their values
    # as `Launch.sizes`); written only when non-empty
    size_args: tuple[str, ...] = ()
    # a persistent kernel (a matmul template): its programs loop over `grid[0]` tiles, striding by
    # tl.num_programs(0), so any grid up to grid[0] computes the same; the runtime launches this many
    # programs per SM of the device (min(grid[0], persistent x SMs)). 0: not persistent (written only
    # when not 0).
    persistent: int = 0

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "nodes": list(self.nodes), "grid": list(self.grid), "num_warps": self.num_warps,
               "xblock": self.xblock, "rblock": self.rblock}
        put_optional(out, "xnumel", self.xnumel)
        put_optional(out, "rnumel", self.rnumel)
        out["args"] = [a.to_dict() for a in self.args]
        out["binaries"] = {arch: b.to_dict() for arch, b in self.binaries.items()}
        out["launches"] = self.launches
        put_optional(out, "size_args", list(self.size_args), [])
        return put_optional(out, "persistent", self.persistent, 0)

    @classmethod
    def from_dict(cls, d: Any, name: str = "?") -> "KernelEntry":
        with decoding(f"kernel {name}"):
            d = fields(d, f"kernel {name}", ("kind", "nodes", "grid", "num_warps", "xblock", "rblock", "args",
                                             "binaries"), ("xnumel", "rnumel", "launches", "size_args",
                                                                            "persistent"))
            x, r = d.get("xnumel"), d.get("rnumel")
            return cls(d["kind"], strs(d["nodes"]), size_tuple(d["grid"], f"kernel {name} grid"), d["num_warps"],
                       d["xblock"], d["rblock"], None if x is None else check_size(x, f"kernel {name} xnumel"),
                       None if r is None else check_size(r, f"kernel {name} rnumel"),
                       tuple(KernelArg.from_dict(a) for a in d["args"]),
                       {arch: Binary.from_dict(b) for arch, b in d["binaries"].items()}, d.get("launches", 1),
                       strs(d.get("size_args", ())), d.get("persistent", 0))


def kernel_dims(k: KernelEntry) -> frozenset[str]:
    """The dim symbols a kernel entry's sizes name."""
    out: set[str] = set()
    for v in (*k.grid, k.xnumel, k.rnumel, *(a.numel for a in k.args)):
        if type(v) is str:
            out |= free_dims(v)
    return frozenset(out)


def specialize_kernel(k: KernelEntry, env: Mapping[str, int]) -> KernelEntry:
    """The entry with every size evaluated for the dims in `env` (see program.specialize)."""
    def ev(v):
        return v if v is None or type(v) is int else evaluate(v, env)

    return dataclasses.replace(k, grid=tuple(ev(g) for g in k.grid), xnumel=ev(k.xnumel), rnumel=ev(k.rnumel),
                               args=tuple(dataclasses.replace(a, numel=ev(a.numel)) for a in k.args))


def has_target_tiles(kernels: dict) -> bool:
    """Does a binary launch with its own tiles (program version 6, TILES_VERSION)?"""
    return any(b.own_tiles for k in kernels.values() for b in k.binaries.values())


def has_pdl(kernels: dict) -> bool:
    """Was a binary compiled with the PDL wait (program version 7, PDL_VERSION)?"""
    return any(b.pdl for k in kernels.values() for b in k.binaries.values())


def kernels_to_dict(kernels: dict) -> dict:
    """The `kernels` part: name -> KernelEntry.to_dict(), in the given order."""
    return {name: k.to_dict() for name, k in kernels.items()}


def kernels_from_dict(d: Any) -> dict:
    with decoding("kernels part"):
        return {name: KernelEntry.from_dict(k, name) for name, k in d.items()}
