"""The one table of dtypes: IR/program name <-> torch dtype <-> itemsize <-> Triton type name.

Every stage names dtypes by the string torch prints minus "torch." ("float32"); this module is the
only place that maps those names to anything else. It imports only torch, because the runtime
(which must not import triton) reads it too: Triton types are plain strings here.
"""
from __future__ import annotations

import torch

# Dtypes kernels compute on (the loop IR, programs, the runtime): name, torch dtype, Triton scalar.
# bool is i1 in Triton. Order is the IR's canonical order (error messages list names in it).
_KERNEL = (
    ("float32", torch.float32, "fp32"), ("float16", torch.float16, "fp16"), ("bfloat16", torch.bfloat16, "bf16"),
    ("float64", torch.float64, "fp64"), ("int64", torch.int64, "i64"), ("int32", torch.int32, "i32"),
    ("int16", torch.int16, "i16"), ("int8", torch.int8, "i8"), ("uint8", torch.uint8, "u8"),
    ("bool", torch.bool, "i1"),
)

NAMES: tuple[str, ...] = tuple(n for n, _, _ in _KERNEL)
TORCH: dict[str, torch.dtype] = {n: dt for n, dt, _ in _KERNEL}
NAME_OF: dict[torch.dtype, str] = {dt: n for n, dt, _ in _KERNEL}
ITEMSIZE: dict[str, int] = {n: dt.itemsize for n, dt, _ in _KERNEL}
TRITON: dict[str, str] = {n: t for n, _, t in _KERNEL}  # pointer signatures: "*" + TRITON[name]
FLOATS: tuple[str, ...] = tuple(n for n, dt, _ in _KERNEL if dt.is_floating_point)
HALF: tuple[str, ...] = ("float16", "bfloat16")  # stored narrow, computed in float32

def name_of(dtype: torch.dtype) -> str:
    """The name of any torch dtype in this table's spelling ("float32"), known to the table or not."""
    return str(dtype).removeprefix("torch.")


# What an archive may name for a weight or a spec (a superset: weights are stored, not computed on).
STORAGE: dict[str, torch.dtype] = {
    name_of(dt): dt
    for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.float8_e4m3fn, torch.float8_e5m2,
        torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8,
        torch.uint64, torch.uint32, torch.uint16, torch.uint8,
        torch.bool,
    )
}


def compute_dtype(name: str) -> str:
    """Arithmetic happens in float32 for half types (as Inductor does)."""
    return "float32" if name in HALF else name


def input_kind(dtype: torch.dtype) -> str:
    """float | int | bool: how an input's values are drawn and which guards describe it."""
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"
