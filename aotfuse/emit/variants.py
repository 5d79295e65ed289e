"""Kernel variants per sub-range of a dynamic reduced length (issue 10: one kernel cannot serve 1..8192 well).

For each bound of space.variant_blocks inside the length's range, the group's kernel with the blocks rows
of that length get (held in registers, rows packed); each also compiled for dims that are multiples of 16
(aligned rows vectorize). The launch lists them by increasing bound (contract/program.Launch.choose); the
runtime picks one per shape when it specializes the program, so the dispatch costs nothing per call.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable

from ..ir.sizes import text
from .kernel_src import KernelSource
from .space import variant_blocks

INT32_MAX = 2**31 - 1
UNALIGNED_PERSISTENT_MAX = 1024


def with_variants(group, main: KernelSource, gen: Callable[..., KernelSource]) -> KernelSource:
    """`main` (the group's kernel for its whole range) with its variants; gen(blocks=, dims=) writes the
    group's kernel with other blocks, taking the given dim arguments."""
    cases = variant_blocks(group.xnumel, group.rnumel, main.pattern)
    if not cases:
        return main
    variants = [(upto, gen(blocks=b)) for upto, b in cases]
    dims = tuple(sorted({d for k in [main] + [v for _, v in variants] for d in k.sizes}, key=lambda d: int(d[1:])))
    if any(k.sizes != dims for k in [main] + [v for _, v in variants]):  # one signature for every variant
        main = gen(dims=dims)
        variants = [(upto, gen(blocks=b, dims=dims)) for upto, b in cases]
    # Each sub-range also gets a twin for dims that are multiples of 16 (listed first: the program takes it
    # when they are): with a dynamic row length, a row's start is aligned only if the length is, and
    # Triton vectorizes a load only where it knows the alignment.
    # Unaligned rows longer than UNALIGNED_PERSISTENT_MAX run the range's own kernel: held in registers
    # with scalar loads they lost to looping (H100, softmax [16384, 3000] bf16: 178 us persistent 4096
    # vs 162 us looped; aligned 3072: 102 us persistent).
    both = []
    for upto, v in variants + [(INT32_MAX, main)]:
        both.append((upto, _aligned(v)))
        if upto <= UNALIGNED_PERSISTENT_MAX or v is main:
            both.append((upto, v))
    both = both[:-1]  # the last (unaligned, whole range) is the launch's own kernel
    note = "; variants by r (" + text(group.rnumel) + "): " + ", ".join(
        f"r <= {upto}: {v.kind.replace('_reduction', '')} {v.xblock}x{v.rblock}/{v.num_warps}w" for upto, v in variants) + \
        f", else this kernel; each also compiled for dims that are multiples of 16 ({', '.join(dims)}: aligned rows, " \
        f"vectorized loads)"
    return dataclasses.replace(main, why=main.why + note, variants=tuple(both), variant_on=text(group.rnumel))


def _aligned(k: KernelSource) -> KernelSource:
    """The same kernel compiled for dims that are all multiples of 16 (a source comment makes it a kernel of
    its own name; the compile gives its int32 arguments Triton's divisibility-by-16 attribute)."""
    old = k.name
    src = k.source.replace(f"def {old}(", "def KERNEL_NAME(").replace(
        "@triton.jit\n", "# sizes: multiples of 16\n@triton.jit\n", 1)
    name = f"{old[:old.rindex('_') + 1]}{hashlib.sha256(src.encode()).hexdigest()[:12]}"
    return dataclasses.replace(k, name=name, source=src.replace("KERNEL_NAME", name), aligned_sizes=True,
                               why=k.why + "; dims multiples of 16")
