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
  the rows cut into E chunks, one matmul per (chunk, group) pair the sorted rows make (at most 2E - 1 of them,
  batched), each row kept from its own group's. About twice a grouped kernel's arithmetic and a static shape
  everywhere: no host sync, so graphs capture it too.
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
    # a fresh copy (contiguous() would return a contiguous view as it is, at a misaligned address)
    if (n[-1] * item) % 16 == 0:
        return t.clone(memory_format=torch.contiguous_format)
    if (n[-2] * item) % 16 == 0:
        return t.transpose(-2, -1).clone(memory_format=torch.contiguous_format).transpose(-2, -1)
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


SLOT_BATCH_BYTES = 64 << 20  # the device form's transient operand copies per batch of slots


def _slots(group: torch.Tensor, experts: int, chunk: int):
    """The (chunk, group) pairs that rows sorted by group make, as three device tensors over a static number of
    slots, nC + E - 1: each chunk's first group, plus one more per group boundary inside it (groups only grow
    along the rows). Per slot: its chunk, its group (clamped) and whether it is a real pair (the rest are
    padding; a chunk wholly past the last offset has none)."""
    jagged = group.shape[0]
    n_chunks = -(-jagged // chunk)
    first = torch.arange(n_chunks, device=group.device) * chunk
    lo = group[first]
    hi = torch.clamp(group[torch.clamp(first + chunk - 1, max=jagged - 1)], max=experts - 1)
    count = torch.clamp(hi - lo + 1, min=0)
    ends = torch.cumsum(count, 0)
    j = torch.arange(n_chunks + experts - 1, device=group.device)
    c = torch.clamp(torch.searchsorted(ends, j, right=True), max=n_chunks - 1)
    g = torch.clamp(lo[c] + j - (ends[c] - count[c]), min=0, max=experts - 1)
    return c, g, j < ends[-1]


def _padded(t: torch.Tensor, dim: int, size: int, fill) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, torch.full(shape, fill, dtype=t.dtype, device=t.device)], dim)


def _on_device(a, b, offs):
    """Rows (columns) cut into chunks of about S / E; one matmul per (chunk, group) pair the sorted rows make, each
    keeping only its group's rows: about twice a grouped kernel's arithmetic, every shape static, no host sync.
    The pairs run as batched matmuls over operands gathered per pair (SLOT_BATCH_BYTES at a time)."""
    experts = offs.shape[0]
    rows = b.dim() == 3
    jagged = a.shape[0] if rows else a.shape[1]
    if jagged == 0 or experts == 0:  # nothing to multiply: the result's zeros
        return torch.zeros(result_shape(tuple(a.shape), tuple(b.shape), tuple(offs.shape)), dtype=a.dtype,
                           device=a.device)
    chunk = max(64, -(-jagged // experts))
    n_chunks = -(-jagged // chunk)
    group = torch.searchsorted(offs.to(torch.int64), torch.arange(jagged, device=a.device), right=True)
    c, g, valid = _slots(group, experts, chunk)
    groups = _padded(group, 0, n_chunks * chunk, experts).view(n_chunks, chunk)
    item = a.element_size()
    if rows:  # [S, K] @ [E, K, N] -> [S, N]
        k, n = a.shape[1], b.shape[2]
        a3 = _padded(a, 0, n_chunks * chunk, 0).reshape(n_chunks, chunk, k)
        out = torch.zeros((n_chunks, chunk, n), dtype=a.dtype, device=a.device)
        per_slot = (k * n + chunk * (k + 2 * n)) * item  # the group's weights, the chunk's rows, its product
    else:  # [M, S] @ [S, N] -> [E, M, N]
        m, n = a.shape[0], b.shape[1]
        a3 = _padded(a, 1, n_chunks * chunk, 0).reshape(m, n_chunks, chunk).permute(1, 0, 2)
        b3 = _padded(b, 0, n_chunks * chunk, 0).reshape(n_chunks, chunk, n)
        wide = torch.promote_types(a.dtype, torch.float32)  # partial sums across chunks, rounded once
        acc = torch.zeros((experts, m, n), dtype=wide, device=a.device)
        per_slot = chunk * (m + n) * item + m * n * (item + torch.empty((), dtype=wide).element_size())
    per = max(1, SLOT_BATCH_BYTES // max(1, per_slot))
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    for s0 in range(0, c.shape[0], per):
        ci, gi, vi = c[s0:s0 + per], g[s0:s0 + per], valid[s0:s0 + per]
        keep = (groups.index_select(0, ci) == gi.unsqueeze(1)) & vi.unsqueeze(1)  # [pairs, chunk]
        if rows:
            prod = torch.bmm(a3.index_select(0, ci), b.index_select(0, gi))
            # each row takes its own pair's product; the other pairs of its chunk add exact zeros
            out.index_add_(0, ci, torch.where(keep.unsqueeze(-1), prod, zero))
        else:
            # both operands masked: a value in another group's row (an inf) must not reach this group (0 * inf)
            cols = torch.where(keep.unsqueeze(1), a3.index_select(0, ci), zero)
            brows = torch.where(keep.unsqueeze(-1), b3.index_select(0, ci), zero)
            acc.index_add_(0, gi, torch.bmm(cols, brows).to(acc.dtype))
    if rows:
        return out.view(n_chunks * chunk, n)[:jagged]
    return acc.to(a.dtype)


@functools.cache
def _grouped_kernel_major(device_index: int) -> int:
    """The device's major version where torch's CUTLASS grouped kernel runs (sm_90 and sm_100 only, torch
    2.10-2.11's GroupedBlas.cpp), else 0. Elsewhere torch._grouped_mm falls back to a loop over groups that copies
    the offsets to the host: a sync per call, and an error inside a CUDA graph's capture."""
    major = torch.cuda.get_device_capability(device_index)[0]
    return major if major in (9, 10) else 0


def _grouped_mm(a, b, offs):
    _meta(a, b, offs)  # the same checks on every device
    major = _grouped_kernel_major(a.device.index if a.device.index is not None else torch.cuda.current_device()) \
        if a.is_cuda else 0
    # the weight-gradient form only where it was checked (sm_90): torch's issue 172439 reports non-zero results
    # for empty groups on sm_100
    if a.is_cuda and a.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and \
            (major == 9 or (major == 10 and b.dim() == 3)) and \
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
