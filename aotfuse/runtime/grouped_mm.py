"""aotfuse::grouped_mm: a mixture of experts' grouped matmul, with aten._grouped_mm's meaning for offsets.

Two forms, each with `offs` the int32 (or int64) cumulative ends of E groups along the jagged dim:
- a [S, K], b [E, K, N] -> [S, N]: rows offs[e-1] <= r < offs[e] of a times b[e] (the experts' forward, and the
  input gradient with b transposed);
- a [M, S], b [S, N] -> [E, M, N]: group e is a[:, offs[e-1]:offs[e]] @ b[offs[e-1]:offs[e]] (the experts' weight
  gradient); an empty group gives zeros.

Rows (columns) past offs[-1] belong to no group: only an expert-parallel model's sentinel tokens are sorted there,
and transformers masks them.

- sm_90 / sm_100 with bf16 operands: torch._grouped_mm, CUTLASS's grouped kernel (what eager runs; no host sync, a
  CUDA graph captures it). It leaves the rows past offs[-1] as it finds them, and it needs rows of 16-byte
  multiples: an operand is copied into the order that has them; where no order has, or the result's rows are
  not, the next form runs.
- Any other CUDA case (float32 experts, transformers' fallback op; bf16 on sm_80/86/89, where torch's call loops
  over the groups with the offsets copied to the host): the group of each row found on the device (searchsorted),
  every group's matmul over all rows, the other groups' rows dropped by a where. E times the arithmetic of a
  grouped kernel, but no host sync and exact per-row products, so graphs capture it too.
- CPU (the interpreter's path): one torch.mm per group over its slice, the offsets read on the host.

Every form but the first writes the rows past offs[-1] as zeros. This module imports only torch.
"""
from __future__ import annotations

import functools

import torch

_LIB = torch.library.Library("aotfuse", "FRAGMENT")  # noqa: TOR901 (kept alive for the process)
_LIB.define("grouped_mm(Tensor a, Tensor b, Tensor offs) -> Tensor")


def result_shape(a_shape, b_shape, offs_shape) -> list[int]:
    """The result's shape, or ValueError naming what does not fit (the meta kernel and load-time validation)."""
    if len(offs_shape) != 1:
        raise ValueError(f"grouped_mm: offs must be 1-D, got {len(offs_shape)} dims")
    (e,) = offs_shape
    if len(a_shape) == 2 and len(b_shape) == 3:
        if b_shape[0] != e or a_shape[1] != b_shape[1]:
            raise ValueError(f"grouped_mm: {list(a_shape)} @ groups {list(b_shape)} with {e} offsets")
        return [a_shape[0], b_shape[2]]
    if len(a_shape) == 2 and len(b_shape) == 2:
        if a_shape[1] != b_shape[0]:
            raise ValueError(f"grouped_mm: {list(a_shape)} @ {list(b_shape)} do not share the jagged dim")
        return [e, a_shape[0], b_shape[1]]
    raise ValueError(f"grouped_mm: operands of {len(a_shape)} and {len(b_shape)} dims (2 and 3, or 2 and 2)")


def _meta(a, b, offs):
    try:
        shape = result_shape(tuple(a.shape), tuple(b.shape), tuple(offs.shape))
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None
    if a.dtype != b.dtype or offs.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"grouped_mm: operands {a.dtype} and {b.dtype}, offsets {offs.dtype}")
    return torch.empty(shape, dtype=a.dtype, device=a.device)


def _kernel_layout(t: torch.Tensor) -> torch.Tensor | None:
    """t as torch._grouped_mm's CUDA kernel takes it: one of its last two strides 1, the other a multiple of 16
    bytes and at least that dim's size, the data 16-byte aligned. A copy in the first of row-major and
    column-major order that has such strides when t has none; None when neither order has them (a dim of
    too few elements: the device form runs instead)."""
    s, n = t.stride(), t.shape
    item = t.element_size()

    def ok(s) -> bool:
        return ((s[-1] == 1 and (s[-2] * item) % 16 == 0 and s[-2] >= n[-1]) or
                (s[-2] == 1 and (s[-1] * item) % 16 == 0 and s[-1] >= n[-2]))

    if t.data_ptr() % 16 == 0 and ok(s):
        return t
    if (n[-1] * item) % 16 == 0:
        return t.contiguous()
    if (n[-2] * item) % 16 == 0:
        return t.transpose(-2, -1).contiguous().transpose(-2, -1)
    return None


def _on_host(a, b, offs):
    """One torch.mm per group over its slice; the offsets read on the host (CPU tensors: no sync to speak of)."""
    shape = result_shape(tuple(a.shape), tuple(b.shape), tuple(offs.shape))
    out = torch.zeros(shape, dtype=a.dtype, device=a.device)
    start, jagged = 0, a.shape[0] if b.dim() == 3 else a.shape[1]
    for e, end in enumerate(offs.tolist()):
        end = min(max(end, start), jagged)
        if end > start:
            if b.dim() == 3:
                torch.mm(a[start:end], b[e], out=out[start:end])
            else:
                torch.mm(a[:, start:end], b[start:end], out=out[e])
        start = end
    return out


def _on_device(a, b, offs):
    """Every group's matmul over all rows, each row kept from its own group's (no host sync, graph-safe)."""
    jagged = a.shape[0] if b.dim() == 3 else a.shape[1]
    group = torch.searchsorted(offs.to(torch.int64), torch.arange(jagged, device=a.device), right=True)
    if b.dim() == 3:
        out = torch.zeros((a.shape[0], b.shape[2]), dtype=a.dtype, device=a.device)
        for e in range(b.shape[0]):
            out = torch.where((group == e).unsqueeze(1), torch.mm(a, b[e]), out)
        return out
    out = torch.empty((offs.shape[0], a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    for e in range(offs.shape[0]):
        torch.mm(torch.where((group == e).unsqueeze(0), a, zero), b, out=out[e])
    return out


@functools.cache
def _grouped_kernel(device_index: int) -> bool:
    """Whether torch's CUTLASS grouped kernel runs on this device: sm_90 and sm_100 only (torch 2.10-2.11's
    GroupedBlas.cpp). Elsewhere torch._grouped_mm falls back to a loop over groups that copies the offsets to the
    host: a sync per call, and an error inside a CUDA graph's capture."""
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10)


def _grouped_mm(a, b, offs):
    _meta(a, b, offs)  # the same checks on every device
    if a.is_cuda and a.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and \
            _grouped_kernel(a.device.index if a.device.index is not None else torch.cuda.current_device()) and \
            (b.shape[-1] * b.element_size()) % 16 == 0:  # its result's rows too are 16-byte multiples
        ka, kb = _kernel_layout(a), _kernel_layout(b)
        if ka is not None and kb is not None:
            return torch._grouped_mm(ka, kb, offs=offs.to(torch.int32))
    if a.is_cuda:
        return _on_device(a, b, offs)
    return _on_host(a, b, offs)


for _key in ("CPU", "CUDA"):
    _LIB.impl("grouped_mm", _grouped_mm, _key)
_LIB.impl("grouped_mm", _meta, "Meta")

grouped_mm = torch.ops.aotfuse.grouped_mm.default
