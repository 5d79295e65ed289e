"""The fused step's backward (partition/step.py): one kernel per gradient shape that multiplies the gradient
in place by the loss's gradient, and does nothing when that is 1.

`loss.backward()` hands the step a loss gradient of exactly 1: every program reads that one value and
returns, so the common step costs one launch per gradient and no memory traffic. Any other value (a
scaled loss, `(loss / n).backward()`, AMP's loss scaling) multiplies each element in fp32 and rounds
once to the gradient's dtype.
"""
from __future__ import annotations

from .kernel_src import KernelArg, KernelSource
from .pdl import kernel_text
from .printer import _HEADER
from .printer import TL_DTYPE

SCALE_BLOCK = 2048  # elements per loop step (8 per thread at 8 warps)
SCALE_WARPS = 8
SCALE_PROGRAMS = 1024  # wanted at most: with a loss gradient of 1 each program reads one value and
# returns, so the launch costs what its programs cost to schedule (128000 programs for 262M elements:
# 78 us on an H100); each program loops over a power-of-two number of blocks, up to SCALE_MAX_STEPS
SCALE_MAX_STEPS = 32  # a program's chunk (steps * SCALE_BLOCK) is its XBLOCK: at most 65536


def scale_kernel(grad_dtype: str, numel: int, tangent_dtype: str) -> KernelSource:
    """`grad *= tangent` (tangent one element), skipped when tangent == 1."""
    numel = int(numel)
    blocks = max(1, -(-numel // SCALE_BLOCK))
    steps = 1
    while steps < SCALE_MAX_STEPS and -(-blocks // steps) > SCALE_PROGRAMS:
        steps *= 2
    chunk = steps * SCALE_BLOCK  # each program: a contiguous chunk of `steps` blocks
    programs = -(-numel // chunk)
    name = f"aotf_scale_{grad_dtype}_{numel}_{tangent_dtype}"
    body = (f"    t = tl.load(in_ptr0).to(tl.float32)\n"
            f"    if t != 1.0:\n"
            f"        for step in range({steps}):\n"
            f"            xindex = tl.program_id(0) * {chunk} + step * {SCALE_BLOCK} + tl.arange(0, {SCALE_BLOCK})\n"
            f"            xmask = xindex < {numel}\n"
            f"            v = tl.load(out_ptr0 + xindex, xmask).to(tl.float32)\n"
            f"            tl.store(out_ptr0 + xindex, (v * t).to({TL_DTYPE[grad_dtype]}), xmask)")
    text = kernel_text(_HEADER, "out_ptr0, in_ptr0", body, name)
    args = (KernelArg("out_ptr0", "grad", grad_dtype, "out", numel),
            KernelArg("in_ptr0", "loss_grad", tangent_dtype, "in", 1))
    return KernelSource(name, text, args, (programs, 1, 1), SCALE_WARPS, "step_scale", "pointwise", (),
                        chunk, 1, numel, 1,
                        why=f"the fused step's backward: gradient *= loss gradient, {programs} programs of "
                            f"{steps} x {SCALE_BLOCK} elements, nothing done when it is 1")
