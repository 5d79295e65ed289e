"""aotfuse::mm_residual: a matmul with its bias and a residual added as it writes its result.

    mm_residual(self [M, K], mat2 [K, N], residual [M, N], bias [N] | None) -> self @ mat2 + bias + residual
    mm_residual.out(..., *, out [M, N])

A transformer's attention output and MLP down projections end in `x + linear(h)`: the residual stream
read once more and the sum written. Lowering (lower/residual.py) gives such a matmul this op when it
stays a cuBLAS call. On CUDA the executor runs it as one cublasLtMatmul (runtime/cublaslt.py): D =
A @ B + beta * C with C the residual and beta 1, the bias in the BIAS epilogue, C read as the tile is
written (its own layout, not D's). The sum is rounded once from fp32, as a template's epilogue rounds
it, where eager rounds the product to the dtype before the add: a half-precision result may differ
from eager's by one rounding of the product.

Elsewhere (the CPU, a misaligned operand on CUDA, AOTFUSE_CUBLASLT=0) this module's implementation runs:
`addmm(residual, self, mat2)` (torch copies the residual into `out` and runs the matmul with beta 1), then
the bias added in place. This module imports only torch.
"""
from __future__ import annotations

import torch

_LIB = torch.library.Library("aotfuse", "FRAGMENT")  # noqa: TOR901 (kept alive for the process)
_LIB.define("mm_residual(Tensor self, Tensor mat2, Tensor residual, Tensor? bias) -> Tensor")
_LIB.define("mm_residual.out(Tensor self, Tensor mat2, Tensor residual, Tensor? bias, *, Tensor(a!) out) -> Tensor(a!)")


def mm_residual_out(self, mat2, residual, bias, *, out):
    """The reference implementation, into `out` (the executor's binding when cuBLASLt does not run it)."""
    torch.addmm(residual, self, mat2, out=out)
    if bias is not None:
        out.add_(bias)
    return out


def _mm_residual(self, mat2, residual, bias):
    out = torch.empty((self.shape[0], mat2.shape[1]), dtype=self.dtype, device=self.device)
    return mm_residual_out(self, mat2, residual, bias, out=out)


def _meta(self, mat2, residual, bias):
    if self.dim() != 2 or mat2.dim() != 2 or self.shape[1] != mat2.shape[0]:
        raise RuntimeError(f"mm_residual: {list(self.shape)} @ {list(mat2.shape)} is not a matrix product")
    shape = (self.shape[0], mat2.shape[1])
    if tuple(residual.shape) != shape:
        raise RuntimeError(f"mm_residual: residual {list(residual.shape)} is not the product's {list(shape)}")
    if bias is not None and tuple(bias.shape) != (shape[1],):
        raise RuntimeError(f"mm_residual: bias {list(bias.shape)} is not one value per column ({shape[1]})")
    if len({t.dtype for t in (self, mat2, residual) + ((bias,) if bias is not None else ())}) != 1:
        raise RuntimeError("mm_residual: operands of different dtypes")
    return torch.empty(shape, dtype=self.dtype, device=self.device)


def _meta_out(self, mat2, residual, bias, *, out):
    _meta(self, mat2, residual, bias)
    return out


for _key in ("CPU", "CUDA"):
    _LIB.impl("mm_residual", _mm_residual, _key)
    _LIB.impl("mm_residual.out", mm_residual_out, _key)
_LIB.impl("mm_residual", _meta, "Meta")
_LIB.impl("mm_residual.out", _meta_out, "Meta")

mm_residual = torch.ops.aotfuse.mm_residual.default
mm_residual_out_op = torch.ops.aotfuse.mm_residual.out
