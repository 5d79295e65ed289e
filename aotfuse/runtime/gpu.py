"""GPU kernel launchers: cubins loaded through the CUDA driver, launched on torch's current stream."""
from __future__ import annotations

from typing import Callable

import torch

from ..contract.kernels import KernelEntry
from ..errors import ArchiveError, GuardError
from ..knobs import knobs
from .cuda_driver import CudaModule, device_arch


def pick_arch(available: list[str], device: torch.device) -> str:
    """The cubin architecture to run on `device`: the exact one, else the newest lower minor of its major."""
    cc = device_arch(device.index or 0)
    have = {int(a[3:]): a for a in available}
    if cc in have:
        return have[cc]
    same_major = [v for v in have if v // 10 == cc // 10 and v < cc and v != 90]  # sm_90 cubins are sm_90a
    if same_major:
        return have[max(same_major)]
    raise GuardError(f"archive has cubins for {', '.join(sorted(available))} but {device} is sm_{cc}",
                     remedy=f"rebuild with --arch sm_{cc}")


def make_launchers(kernels: dict[str, KernelEntry], device: torch.device) -> tuple[dict[str, Callable], str, list]:
    """kernel name -> launch(grid, stream, device addresses). Returns the launchers, the arch used, and the modules."""
    if not kernels:  # every step an extern (a Linear + GELU fused into one cuBLASLt call): any GPU runs it
        return {}, f"sm_{device_arch(device.index or 0)}", []
    archs = sorted({a for k in kernels.values() for a in k.binaries})
    arch = pick_arch(archs, device)
    pdl = knobs.pdl_launch
    if pdl not in ("kernels", "all", "off"):
        raise GuardError(f"AOTFUSE_PDL_LAUNCH={pdl!r} is not one of kernels, all, off",
                         remedy="set AOTFUSE_PDL_LAUNCH to kernels (the default), all or off")
    launchers, modules = {}, []
    for name, k in kernels.items():
        b = k.binaries.get(arch)
        if b is None:
            raise GuardError(f"kernel {name} has no cubin for {arch}", remedy=f"rebuild with --arch {arch}")
        if b.profile_scratch:
            raise ArchiveError(f"kernel {name} needs profile scratch memory, which this runtime does not provide",
                               remedy="rebuild without Triton's instrumentation")
        mod = CudaModule.load(b.cubin, device.index or 0)
        modules.append(mod)
        fn = mod.function(b.name, b.shared, b.num_warps)
        if b.pdl and pdl != "off" and int(arch[3:]) >= 90:  # compiled with the PDL wait (emit/pdl.py)
            fn.enable_pdl(after_kernels_only=pdl == "kernels")
        # pointers, then the int32 sizes of a kernel compiled for dynamic dims (their values: Launch.sizes)
        bound = fn.bind(["ptr"] * len(k.args) + ["i32"] * len(k.size_args), b.num_warps, b.shared)
        if b.global_scratch:
            bound = ScratchLaunch(bound, b.global_scratch, device)
        persistent = k.persistent if b.persistent is None else b.persistent
        if persistent:
            bound = PersistentLaunch(bound, persistent * sm_count(device))
        if b.grid is not None:  # a template compiled from this target's own tiles (Binary.grid)
            bound = GridLaunch(bound, tuple(b.grid))
        launchers[name] = bound  # called as bound(grid, stream, addresses [+ sizes]) by the executor
    return launchers, arch, modules


class ScratchLaunch:
    """A kernel that needs global scratch (`bytes_per_program` for each program: the TMA descriptors
    a matmul template makes in the kernel). Each prepared launch site (one per executor state, so
    per caller stream) owns its scratch, allocated once: concurrent states never share one, and a
    CUDA graph captures a fixed address. A plain call allocates for that call, on the launch's stream,
    so the allocator reuses it only after the kernel."""

    __slots__ = ("bound", "bytes_per_program", "device")

    def __init__(self, bound, bytes_per_program: int, device: torch.device):
        self.bound, self.bytes_per_program, self.device = bound, int(bytes_per_program), device

    def _alloc(self, grid) -> torch.Tensor:
        n = grid[0] * grid[1] * grid[2] * self.bytes_per_program
        return torch.empty(max(n, 1), dtype=torch.uint8, device=self.device)

    def __call__(self, grid, stream, args, **kw) -> None:
        if stream:  # allocated on the launch's stream, so the allocator reuses it only after the kernel
            with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=self.device)):
                scratch = self._alloc(grid)
        else:
            scratch = self._alloc(grid)
        self.bound(grid, stream, args, global_scratch=scratch.data_ptr())

    def prepare(self, grid):
        p = self.bound.prepare(grid)
        p.keep = self._alloc(grid)
        p.global_scratch = p.keep.data_ptr()
        return p


def sm_count(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device.index or 0).multi_processor_count)


class PersistentLaunch:
    """A persistent kernel (KernelEntry.persistent): its programs stride over the grid's tiles by
    tl.num_programs(0), so it launches min(tiles, programs) programs: `persistent` per SM of this
    device."""

    __slots__ = ("inner", "programs")

    def __init__(self, inner, programs: int):
        self.inner, self.programs = inner, max(1, programs)

    def _grid(self, grid):
        return (min(grid[0], self.programs), grid[1], grid[2])

    def __call__(self, grid, stream, args, **kw) -> None:
        self.inner(self._grid(grid), stream, args, **kw)

    def prepare(self, grid):
        return self.inner.prepare(self._grid(grid))


class GridLaunch:
    """A binary with its own grid (a matmul template compiled from its target's own tiles,
    contract/kernels.Binary.grid): the program's launch grid (the entry's tiles) is replaced by it."""

    __slots__ = ("inner", "grid")

    def __init__(self, inner, grid: tuple):
        self.inner, self.grid = inner, grid

    def __call__(self, grid, stream, args, **kw) -> None:
        self.inner(self.grid, stream, args, **kw)

    def prepare(self, grid):
        return self.inner.prepare(self.grid)
