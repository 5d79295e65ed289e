"""Registers, spills and shared memory of each kernel of an archive, read off its cubins with no GPU
(cuobjdump -res-usage, the one Triton ships): the first thing to read when a kernel runs far under
the copy bandwidth (a kernel holding too many values per thread runs few programs per SM, or spills).

    python3 scripts/kernel_regs.py ARCHIVE [--arch sm_90] [--sass NAME]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import aotfuse


def cuobjdump() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("archive")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--sass", help="print the SASS of this kernel")
    a = ap.parse_args(argv)
    art = aotfuse.load(a.archive, device="cpu")
    print(f"{'kernel':<40} {'warps':>5} {'XBLOCK':>6} {'RBLOCK':>6} {'regs':>5} {'spill st/ld B':>13} {'smem B':>7}"
          f" {'progs/SM (regs)':>15}")
    with tempfile.TemporaryDirectory() as d:
        for name, k in art.kernels.items():
            b = k.binaries.get(a.arch)
            if b is None:
                continue
            path = os.path.join(d, name + ".cubin")
            with open(path, "wb") as f:
                f.write(b.cubin)
            out = subprocess.run([cuobjdump(), "-res-usage", path], capture_output=True, text=True).stdout
            regs = int(re.search(r"REG:(\d+)", out).group(1)) if "REG:" in out else -1
            stack = re.search(r"STACK:(\d+)", out)
            smem = re.search(r"SHARED:(\d+)", out)
            lst = re.search(r"LOCAL:(\d+)", out)
            per_sm = 65536 // max(1, regs * 32 * k.num_warps) if regs > 0 else 0
            print(f"{name:<40} {k.num_warps:>5} {k.xblock:>6} {k.rblock:>6} {regs:>5} "
                  f"{(stack.group(1) if stack else '?') + '/' + (lst.group(1) if lst else '?'):>13} "
                  f"{int(smem.group(1)) + b.shared if smem else b.shared:>7} {per_sm:>15}")
            if a.sass == name:
                print(subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True).stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
