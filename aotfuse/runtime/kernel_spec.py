"""What the build side records of a compiled Triton kernel (`KernelSpec`), and its scratch sizes.

The launch ABI read off `triton.compile`'s result (see cuda_driver.py's module docstring), kept
apart from the driver wrapper: this half runs where kernels are compiled, that half where they run.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from aotfuse.errors import AotfuseError

from .cuda_driver import ARG_TYPES, CudaFunction, CudaModule

def _meta_get(meta: Any, key: str, default: Any = None) -> Any:
    if isinstance(meta, Mapping):
        return meta.get(key, default)
    return getattr(meta, key, default)


def scratch_bytes(meta: Any, grid: Sequence[int]) -> tuple[int, int]:
    """Bytes of (global, profile) scratch one launch needs; 0 means pass a null pointer.

    ``meta`` is ``compiled.metadata`` (or a dict / KernelSpec with the same fields). Triton 3.6 allocates
    ``size * gx * gy * gz * num_ctas`` bytes aligned to ``*_align`` per launch. A torch CUDA allocation
    (``torch.empty(n, dtype=torch.uint8, device=...)``) is 512-byte aligned, which covers any
    alignment up to 512; larger ones are refused here. The buffer must stay alive until the kernel
    finishes (for CUDA graphs: as long as the graph).
    """
    gx, gy, gz = (tuple(grid) + (1, 1))[:3]
    programs = gx * gy * gz * int(_meta_get(meta, "num_ctas", 1) or 1)
    out = []
    for kind in ("global", "profile"):
        size = int(_meta_get(meta, f"{kind}_scratch_size", 0) or 0)
        align = int(_meta_get(meta, f"{kind}_scratch_align", 1) or 1)
        if size and align > 512:
            raise AotfuseError(f"{kind} scratch needs {align}-byte alignment; torch allocations give 512",
                               remedy="allocate the scratch buffer with explicit alignment")
        out.append(size * programs if size else 0)
    return out[0], out[1]


def _arg_type_of(triton_type: str) -> str | None:
    """Triton signature type -> ARG_TYPES key; None for constexpr (not a parameter)."""
    if triton_type == "constexpr":
        return None
    if triton_type.startswith("*"):
        return "ptr"
    if triton_type == "f32":
        return "fp32"
    if triton_type in ARG_TYPES and triton_type != "ptr":
        return triton_type
    raise AotfuseError(f"triton argument type {triton_type!r} is not supported by the launcher",
                       remedy=f"use pointers or one of {sorted(k for k in ARG_TYPES if k != 'ptr')}")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Everything needed to load and launch one compiled triton kernel without triton."""

    name: str
    cubin: bytes
    arch: int
    num_warps: int
    shared: int
    arg_names: tuple[str, ...]
    arg_types: tuple[str, ...]
    num_ctas: int = 1
    global_scratch_size: int = 0
    global_scratch_align: int = 1
    profile_scratch_size: int = 0
    profile_scratch_align: int = 1

    @classmethod
    def from_compiled(cls, compiled: Any, signature: Mapping[str, str] | None = None) -> "KernelSpec":
        """Read a ``triton.compile(ASTSource(...))`` result (duck-typed; triton is not imported)."""
        meta = compiled.metadata
        if signature is None:
            signature = compiled.src.signature
        arg_names = getattr(getattr(getattr(compiled, "src", None), "fn", None), "arg_names", None)
        if arg_names is not None and [n for n in arg_names if n in signature] != list(signature):
            raise AotfuseError(f"signature order {list(signature)} differs from the kernel's arguments "
                               f"{list(arg_names)}", remedy="list the signature in argument order")
        names, types = [], []
        for n, t in signature.items():
            at = _arg_type_of(t)
            if at is not None:
                names.append(n)
                types.append(at)
        num_ctas = int(getattr(meta, "num_ctas", 1))
        for field, bad in (("num_ctas", num_ctas != 1),
                           ("launch_cooperative_grid", bool(getattr(meta, "launch_cooperative_grid", False))),
                           ("launch_pdl", bool(getattr(meta, "launch_pdl", False))),
                           ("tensordesc_meta", bool(getattr(meta, "tensordesc_meta", None)))):
            if bad:
                raise AotfuseError(f"kernel {meta.name!r} uses {field}={getattr(meta, field)!r}, which needs "
                                   f"cuLaunchKernelEx attributes this launcher does not set",
                                   remedy="compile with num_ctas=1, no cooperative grid/PDL/TMA descriptors")
        return cls(
            name=meta.name,
            cubin=bytes(compiled.asm["cubin"]),
            arch=int(meta.target.arch),
            num_warps=int(meta.num_warps),
            shared=int(meta.shared),
            arg_names=tuple(names),
            arg_types=tuple(types),
            num_ctas=num_ctas,
            global_scratch_size=int(meta.global_scratch_size or 0),
            global_scratch_align=int(meta.global_scratch_align or 1),
            profile_scratch_size=int(getattr(meta, "profile_scratch_size", 0) or 0),
            profile_scratch_align=int(getattr(meta, "profile_scratch_align", 1) or 1),
        )

    def to_json(self) -> dict:
        """JSON-able fields (without the cubin)."""
        d = dataclasses.asdict(self)
        del d["cubin"]
        d["arg_names"] = list(self.arg_names)
        d["arg_types"] = list(self.arg_types)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], cubin: bytes) -> "KernelSpec":
        d = dict(d)
        d["arg_names"] = tuple(d["arg_names"])
        d["arg_types"] = tuple(d["arg_types"])
        return cls(cubin=cubin, **d)

    def load(self, device_index: int | None = None) -> tuple[CudaModule, CudaFunction]:
        mod = CudaModule.load(self.cubin, device_index)
        return mod, mod.function(self.name, self.shared, num_warps=self.num_warps)
