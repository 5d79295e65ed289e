"""A fix for Triton's interpreter: float32 -> bfloat16 casts round to nearest even, as on the GPU.

The interpreter keeps bfloat16 data as uint16 bit patterns. Its `cast_impl` (behind `x.to(tl.bfloat16)`
and a store's implicit cast) narrows float32 with no rounding mode, which truncates the low 16 bits:
rounding toward zero, twice the error of the GPU's `cvt.rn.bf16.f32` and biased, so the error of a
bf16 model on the CPU path grows with its depth (every kernel's bf16 output shrinks a little) where
the GPU's and eager's do not. Its round-to-nearest mode (`create_fp_to_fp`) rounds ties away from zero.
Patched here: float32 -> bfloat16 rounds to nearest, ties to even, NaN stays NaN (quieted) and
overflow goes to inf; integer and float64 sources go through float32 first (the interpreter
would write their values as bit patterns), and bfloat16 to anything but float32 widens to float32
first (it would read the bit patterns as values). Idempotent; every other cast takes Triton's own path.
"""
from __future__ import annotations

_PATCHED = False


def bf16_bits_rtne(f32):
    """The bfloat16 bit patterns (uint16) nearest to a float32 numpy array, ties to even."""
    import numpy as np

    bits = np.ascontiguousarray(f32, dtype=np.float32).view(np.uint32).astype(np.uint64)
    out = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    out = np.where(nan, (bits >> 16) | 0x40, out)
    return out.astype(np.uint16).reshape(np.shape(f32))


def patch_interpreter_bf16_cast() -> None:
    global _PATCHED
    if _PATCHED:
        return
    import numpy as np
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original_cast, original_fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def _to_f32(self, h):
        if h.dtype.scalar == tl.float32:
            return h
        if h.dtype.scalar == tl.bfloat16:  # exact: the bits are the top half of a float32
            return interpreter.TensorHandle((np.asarray(h.data).astype(np.uint32) << 16).view(np.float32),
                                            tl.float32)
        return original_cast(self, h, tl.float32)

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if d == tl.bfloat16 and s != tl.bfloat16:
            return interpreter.TensorHandle(bf16_bits_rtne(_to_f32(self, src).data), tl.bfloat16)
        if s == tl.bfloat16 and d != tl.bfloat16 and d != tl.float32:
            return original_cast(self, _to_f32(self, src), dst_type)
        return original_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16
                and rounding_mode in (None, ir.ROUNDING_MODE.RTNE)):
            return interpreter.TensorHandle(bf16_bits_rtne(src.data), tl.bfloat16)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    # The cast entry points are lambdas over self.cast_impl in the class body: they find the patch.
    _PATCHED = True
