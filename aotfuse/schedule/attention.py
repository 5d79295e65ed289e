"""Inference attention: the flash-attention template (emit/template_attn.py) or torch's sdpa extern?
The decision, made at lowering (lower/extern.py asks for each sdpa), with its reason for the report.

`AOTFUSE_ATTENTION` (knobs.py): `auto` (the default: the template where it is supported and was
measured faster, else sdpa), `template` (wherever supported), `extern` (always sdpa). The template
supports what it was written and measured for; anything else keeps sdpa, and the reason goes into
the report (`explain`):
- static shapes, q/k/v of rank 4 ([B, H, T, D]) with the same B and H (with enable_gqa, k and v may have
  H / G heads: query head h reads kv head h // G), D in 16..128 a power of two, bf16 or fp16, the last dim
  contiguous;
- an attention mask (what export/masks.py did not turn into is_causal or drop: padding, windows) of at
  most 4 dims broadcastable to [B, H, T, S], bool (True keeps) or float (added to the scaled scores);
  a row masked everywhere gives 0, as torch's math sdpa does; dropout 0;
- causal only with as many keys as queries (sdpa's causal mask is top-left aligned).
`auto` takes the template up to D = 64 (H200, 2026-11-26, scripts/attn_probe.py: 44.0 vs 47.5 us at
8 x 12 x 1024 x 64 causal, 13.4 vs 14.7 at 1 x 1024, 3.5 vs 6.1 at 1 x 128; scripts/attn_mask_bench.py,
8 x 12 x 1024 x 64 with a kept mask: bool padding 83.6 vs 106.2 us, float padding 78.8 vs 101.0, a bool
window [B, 1, T, T] 112.6 vs 137.5; not measured beyond D = 64), except for short sequences over many row
blocks (at most AUTO_SDPA_MAX_KEYS keys, at least AUTO_SDPA_MIN_PROGRAMS blocks of 64 query rows) without a
per-head mask: there torch's sdpa (cuDNN) was faster (H100, 2026-11-27, scripts/attn_probe.py causal: 32 x 512
76.6 vs 54.9 us, 64 x 256 58.2 vs 40.8, 16 x 512 32.5 vs 32.2, but 8 x 1024 46.8 vs 48.2 and 4 x 2048 73.8 vs
79.1; scripts/attn_mask_bench.py at 32 x 512: padding masks 1.13-1.46x, at 8 x 1024 0.79-0.92x; whole models
with AOTFUSE_ATTENTION=extern: ViT-B/16 (197 tokens) 6.27 -> 6.06 ms, BERT-base (32 x 512, padding mask) 9.56 ->
9.39-9.42, T5's per-head position bias 3.26 -> 8.15, which is why a per-head mask keeps the template).
"""
from __future__ import annotations

from ..emit.kernel_src import INDEX_LIMIT
from ..ir.attention import BLOCK_M, BLOCK_N
from ..ir.loop import TensorArg
from ..ir.sizes import static
from ..knobs import knobs

MODES = ("auto", "template", "extern")
AUTO_MAX_HEAD_DIM = 64  # measured (module docstring)
# short sequences over many row blocks go to sdpa (module docstring): at most this many keys ...
AUTO_SDPA_MAX_KEYS = 512
# ... over at least this many 64-row blocks (4 waves of an H100's 132 SMs; smaller attentions are launch-bound,
# where the template won: 3.5 vs 6.1 us at 1 x 12 x 128 x 64, H200)
AUTO_SDPA_MIN_PROGRAMS = 4 * 132


def mode() -> str:
    m = (knobs.attention or "auto").lower()
    if m not in MODES:
        from ..errors import BuildError

        raise BuildError(f"AOTFUSE_ATTENTION={knobs.attention!r}", remedy=f"use one of {', '.join(MODES)}")
    return m


MASK_DTYPES = ("bool", "bfloat16", "float16", "float32")


def mask_kind(mask_dtype: str | None) -> str:
    """"" (no mask), "bool" (True keeps) or "add" (added to the scaled scores), as sdpa reads them."""
    return "" if mask_dtype is None else "bool" if mask_dtype == "bool" else "add"


def _mask_refusal(mask: TensorArg, mask_dtype: str, q: TensorArg, k: TensorArg) -> str | None:
    if mask_dtype not in MASK_DTYPES:
        return f"a {mask_dtype} attention mask"
    if len(mask.shape) > 4 or not all(static(d) for d in (*mask.shape, *mask.stride, mask.offset)):
        return f"an attention mask of shape {mask.shape} (the template takes a static mask of at most 4 dims)"
    want = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    for got, full in zip(reversed(mask.shape), reversed(want)):
        if int(got) not in (1, int(full)):
            return f"an attention mask of shape {mask.shape} that does not broadcast to {list(want)}"
    return None


def index_refusal(views, block: int = max(BLOCK_M, BLOCK_N)) -> str | None:
    """The kernel indexes with 32-bit integers: the farthest element any view reaches, with the rows and keys
    padded to whole blocks (the padded rows' addresses are computed, then masked), must stay below 2**31."""
    for t in views:
        shape = [int(n) for n in t.shape]
        if len(shape) >= 2:  # rows / keys run to the next whole block
            shape[-2] = -(-shape[-2] // block) * block
        reach = int(t.offset) + sum((n - 1) * abs(int(st)) for n, st in zip(shape, t.stride)) + 1
        if reach > INDEX_LIMIT:
            return f"a q/k/v/mask view reaches element {reach} (32-bit indexing: at most 2**31 - 1)"
    return None


def refusal(q: TensorArg, k: TensorArg, v: TensorArg, mask, causal: bool, gqa: bool, dtype: str,
            mask_dtype: str | None = None) -> str | None:
    """Why the template cannot run this attention (None: it can)."""
    if dtype not in ("bfloat16", "float16"):
        return f"{dtype} attention (the template takes bf16 and fp16)"
    shapes = (q.shape, k.shape, v.shape)
    if any(len(s) != 4 for s in shapes):
        return f"q/k/v of rank {len(q.shape)}, {len(k.shape)}, {len(v.shape)} (the template takes [B, H, T, D])"
    if not all(static(d) for t in (q, k, v) for d in (*t.shape, *t.stride, t.offset)):
        return "dynamic sizes (the template's sizes and strides are literals)"
    (b, h, tq, d), (bk, hk, tk, dk), (bv, hv, tv, dv) = shapes
    # grouped-query attention (enable_gqa): k and v have H / G heads, query head h reads kv head h // G
    kv_ok = hk == h or (gqa and hk and h % hk == 0)
    if (bk, bv, hv) != (b, b, hk) or not kv_ok or tk != tv or dk != d or dv != d:
        return (f"q {q.shape}, k {k.shape}, v {v.shape}: the template needs the same B and D, as many keys as values, "
                "and as many k/v heads as query heads (or, with enable_gqa, a divisor of them)")
    if d < 16 or d > 128 or d & (d - 1):
        return f"head dim {d} (the template takes a power of two from 16 to 128)"
    if causal and tq != tk:
        return f"causal with {tq} queries and {tk} keys (sdpa's top-left causal mask)"
    if any(t.stride[3] != 1 for t in (q, k, v)):
        return "a q/k/v view whose last dim is not contiguous"
    if tq == 0 or tk == 0 or b * h == 0:
        return "an empty attention"
    if mask is not None:
        why = _mask_refusal(mask, mask_dtype, q, k)
        if why is not None:
            return why
    if b * h * tq * d > INDEX_LIMIT:
        return f"an output of {b * h * tq * d} elements (32-bit indexing)"
    return index_refusal((q, k, v) if mask is None else (q, k, v, mask))


def choose(name: str, q: TensorArg, k: TensorArg, v: TensorArg, mask, causal: bool, gqa: bool,
           dtype: str, mask_dtype: str | None = None) -> tuple[bool, dict]:
    """(template?, the decision record for the report)."""
    md = mode()
    rec = {"attention": name, "mode": md, "shape": list(q.shape), "causal": bool(causal)}
    if mask is not None:
        rec["mask"] = f"{mask_dtype} {list(mask.shape)}"
    if md == "extern":
        rec.update(kernel="sdpa", why="AOTFUSE_ATTENTION=extern")
        return False, rec
    why = refusal(q, k, v, mask, causal, gqa, dtype, mask_dtype)
    if why is not None:
        rec.update(kernel="sdpa", why=why)
        return False, rec
    d = int(q.shape[3])
    if md == "auto" and d > AUTO_MAX_HEAD_DIM:
        rec.update(kernel="sdpa", why=f"head dim {d} > {AUTO_MAX_HEAD_DIM}: the template was measured faster than "
                                      "sdpa up to 64 only (AOTFUSE_ATTENTION=template forces it)")
        return False, rec
    b, h, tq, tk = int(q.shape[0]), int(q.shape[1]), int(q.shape[2]), int(k.shape[2])
    programs = b * h * -(-tq // BLOCK_M)
    per_head_mask = mask is not None and len(mask.shape) >= 3 and int(mask.shape[-3]) > 1
    if md == "auto" and tk <= AUTO_SDPA_MAX_KEYS and programs >= AUTO_SDPA_MIN_PROGRAMS and not per_head_mask:
        rec.update(kernel="sdpa", why=f"{tk} keys <= {AUTO_SDPA_MAX_KEYS} over {programs} row blocks: sdpa's kernels "
                                      "(cuDNN) were measured faster there (H100, 2026-11-27: the template 1.01-1.46x of "
                                      "sdpa's time at 16-64 x 12 x 256-512 x 64; ViT-B/16 and BERT-base whole "
                                      "models 2-3% faster with sdpa); AOTFUSE_ATTENTION=template forces it")
        return False, rec
    measured = ("H200: 0.78-0.82x of sdpa's time at 8x12x1024x64 with a kept padding or window mask" if mask is not None
                else "H200: 0.93x at 8x12x1024x64 causal, 0.58x at 1x12x128x64")
    rec.update(kernel="template", why=("AOTFUSE_ATTENTION=template" if md == "template" else
                                       f"flash-attention template: measured faster than sdpa at D <= 64 ({measured})"))
    return True, rec
