"""GPU kernel launchers: cubins loaded through the CUDA driver, launched on torch's current stream."""
from __future__ import annotations

from typing import Callable

import torch

from ..contract.kernels import KernelEntry
from ..errors import ArchiveError, GuardError
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
    launchers, modules = {}, []
    for name, k in kernels.items():
        b = k.binaries.get(arch)
        if b is None:
            raise GuardError(f"kernel {name} has no cubin for {arch}", remedy=f"rebuild with --arch {arch}")
        if b.global_scratch or b.profile_scratch:
            raise ArchiveError(f"kernel {name} needs scratch memory, which this runtime does not provide")
        mod = CudaModule.load(b.cubin, device.index or 0)
        modules.append(mod)
        fn = mod.function(b.name, b.shared, b.num_warps)
        # pointers, then the int32 sizes of a kernel compiled for dynamic dims (their values: Launch.sizes)
        bound = fn.bind(["ptr"] * len(k.args) + ["i32"] * len(k.size_args), b.num_warps, b.shared)
        launchers[name] = bound  # called as bound(grid, stream, addresses [+ sizes]) by the executor
    return launchers, arch, modules
