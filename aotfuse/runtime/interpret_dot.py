"""A fix for Triton's interpreter: tl.dot of bfloat16 tiles.

The interpreter keeps bfloat16 data as uint16 bit patterns and its `create_dot` hands them to
np.matmul as they are (integers, not values). Patched here to widen bfloat16 operands to float32
first: a product of two bfloat16 values is exact in float32 and the accumulator is float32, which is
what the GPU's tensor cores compute. Idempotent; other dtypes take Triton's own path.
"""
from __future__ import annotations

_PATCHED = False


def patch_interpreter_dot() -> None:
    global _PATCHED
    if _PATCHED:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def _widen(h):
        if h.dtype.scalar == tl.bfloat16:
            bits = h.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    _PATCHED = True
