"""Registers, spills and shared memory of each kernel of an archive, read off its cubins with no GPU, as a
table (what `aotfuse explain --resources` shows under each group), and optionally one kernel's SASS.

    python3 scripts/kernel_regs.py ARCHIVE [--arch sm_90] [--sass KERNEL]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import aotfuse
from aotfuse.runtime.resources import cuobjdump, kernel_resources


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("archive")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--sass", help="print the SASS of this kernel")
    a = ap.parse_args(argv)
    art = aotfuse.load(a.archive, device="cpu")
    res = kernel_resources(art.kernels, a.arch)
    if isinstance(res, str):
        print(res)
        return 1
    print(f"{'kernel':<40} {'warps':>5} {'XBLOCK':>6} {'RBLOCK':>6} {'regs':>5} {'spill B':>7} {'smem B':>7} {'progs/SM':>8}")
    for name, r in res.items():
        k = art.kernels[name]
        print(f"{name:<40} {r.num_warps:>5} {k.xblock:>6} {k.rblock:>6} {r.registers:>5} {r.spill_bytes:>7} "
              f"{r.shared:>7} {r.programs_per_sm:>8}")
    if a.sass:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.cubin")
            with open(path, "wb") as f:
                f.write(art.kernels[a.sass].binaries[a.arch].cubin)
            print(subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True).stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
