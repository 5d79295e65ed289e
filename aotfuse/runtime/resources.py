"""What each kernel of an archive asks of an SM, read off its cubins with no GPU (`aotfuse explain
--resources`): registers a thread, bytes spilled to local memory, shared memory, how many
programs fit one SM by each of those limits, and the widths of its global loads and stores (static
instruction counts in the SASS: a 16-byte `LDG.E.128` is a vectorized load). A kernel far under
the copy bandwidth usually runs few programs per SM (too many registers a thread: the mix-order
kernel at 128 registers and 8 warps fits two) or spills.

The numbers come from `cuobjdump -res-usage` (CUDA's, or the copy in Triton's NVIDIA backend, found
without importing Triton): the runtime never imports the compiler stack. Where none is found the
report says so and nothing else changes.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile

# Per SM: registers, shared memory (bytes, what one SM can give its resident programs), warps, programs.
_SM = {"sm_80": (65536, 167936, 64, 32), "sm_86": (65536, 102400, 48, 16), "sm_89": (65536, 102400, 48, 24),
       "sm_90": (65536, 233472, 64, 32)}
_RESERVED_SMEM = 1024  # the driver's shared memory per program (sm_80 and later)


@dataclasses.dataclass(frozen=True)
class Resources:
    registers: int  # per thread
    spill_bytes: int  # stack frame (local memory) per thread
    shared: int  # bytes per program, static and dynamic
    num_warps: int
    by_registers: int  # programs per SM each limit allows
    by_shared: int
    by_warps: int
    cap: int = 32  # the SM's most resident programs
    loads: tuple = ()  # ((bytes, instructions), ...) global loads by width, widest first
    stores: tuple = ()

    @property
    def programs_per_sm(self) -> int:
        return min(self.by_registers, self.by_shared, self.by_warps)

    def widths(self) -> str:
        def one(pairs):
            return ", ".join(f"{b} B x {n}" for b, n in pairs) or "none"
        return f"global loads {one(self.loads)}; stores {one(self.stores)}"

    def line(self, arch: str) -> str:
        limits = {"registers": self.by_registers, "shared memory": self.by_shared, "warps": self.by_warps}
        low = min(limits.values())
        bound = (" and ".join(k for k, v in limits.items() if v == low) if self.programs_per_sm < self.cap
                 else f"the SM's {self.cap}-program limit")
        spill = f"{self.spill_bytes} B spilled a thread" if self.spill_bytes else "no spills"
        return (f"{arch}: {self.registers} registers a thread, {spill}, {self.shared} B shared: "
                f"{self.programs_per_sm} programs of {self.num_warps} warps per SM (bound by {bound}); "
                f"{self.widths()}")


def cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


def parse_res_usage(text: str) -> tuple[int, int, int] | None:
    """(registers, stack bytes, static shared bytes) from `cuobjdump -res-usage` of a one-kernel cubin."""
    reg = re.search(r"REG:(\d+)", text)
    if reg is None:
        return None
    stack = re.search(r"STACK:(\d+)", text)
    smem = re.search(r"SHARED:(\d+)", text)
    return int(reg.group(1)), int(stack.group(1)) if stack else 0, int(smem.group(1)) if smem else 0


_WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}
_MEM = re.compile(r"\b(LDG|STG)\.E((?:\.[A-Z0-9]+)*)")


def access_widths(sass: str) -> tuple[tuple, tuple]:
    """(loads, stores): ((bytes, instructions), ...) of the global loads and stores in `sass`, widest
    first (LDG.E.128: 16 bytes; LDG.E: 4; cache and eviction qualifiers such as .EL are ignored)."""
    counts: dict = {"LDG": {}, "STG": {}}
    for op, quals in _MEM.findall(sass):
        width = next((_WIDTH[q] for q in quals.split(".") if q in _WIDTH), 4)
        counts[op][width] = counts[op].get(width, 0) + 1
    return tuple(tuple(sorted(counts[op].items(), reverse=True)) for op in ("LDG", "STG"))


def occupancy(arch: str, registers: int, spill: int, shared: int, num_warps: int) -> Resources:
    regs_sm, smem_sm, warps_sm, progs_sm = _SM.get(arch, _SM["sm_80"])
    per_thread = -(-max(registers, 1) // 8) * 8  # allocated in units of 8 registers a thread (256 a warp)
    by_regs = regs_sm // (per_thread * 32 * num_warps)
    by_smem = smem_sm // (shared + _RESERVED_SMEM) if shared else progs_sm
    return Resources(registers, spill, shared, num_warps, min(by_regs, progs_sm), min(by_smem, progs_sm),
                     min(warps_sm // num_warps, progs_sm), progs_sm)


def kernel_resources(kernels: dict, arch: str) -> dict[str, Resources] | str:
    """Per kernel name (those with a cubin for `arch`), or why there are none (a sentence)."""
    tool = cuobjdump()
    if tool is None:
        return "no cuobjdump found (CUDA's, or Triton's NVIDIA backend): resource use not shown"
    out: dict[str, Resources] = {}
    with tempfile.TemporaryDirectory() as d:
        for name, k in kernels.items():
            b = k.binaries.get(arch)
            if b is None:
                continue
            path = os.path.join(d, "k.cubin")
            with open(path, "wb") as f:
                f.write(b.cubin)
            # one call prints both: the resource line and the SASS
            res = subprocess.run([tool, "-res-usage", "-sass", path], capture_output=True, text=True, timeout=60)
            got = parse_res_usage(res.stdout)
            if got is None:
                return f"cuobjdump could not read kernel {name}'s {arch} cubin: {res.stderr.strip()[:200]}"
            regs, stack, static = got
            loads, stores = access_widths(res.stdout)
            out[name] = dataclasses.replace(occupancy(arch, regs, stack, static + b.shared, b.num_warps),
                                            loads=loads, stores=stores)
    return out
