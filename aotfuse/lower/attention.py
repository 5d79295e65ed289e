"""Inference attention lowered to the flash-attention template's node (ir/attention.AttentionKernel);
schedule/attention.py decides whether it is taken (else lower/extern.py keeps torch's sdpa)."""
from __future__ import annotations

from ..ir.attention import AttentionKernel
from ..ir.loop import TensorArg
from ..schedule.attention import mask_kind

_BTHD = (0, 2, 1, 3)  # [B, H, T, D] results stored [B, T, H, D]


def lower_attention(ctx, node, q: TensorArg, k: TensorArg, v: TensorArg, causal: bool, scale, shape, dtype: str,
                    mask: TensorArg | None = None, mask_dtype: str | None = None):
    """The AttentionKernel node writing a fresh buffer stored [B, T, H, D]; returns its logical view."""
    from ..ir.views import View

    name = ctx.fresh("attn")
    stored = tuple(shape[p] for p in _BTHD)
    ctx.add_buffer(name, stored, dtype, "extern")
    view = View.of_buffer(name, stored, dtype).permute([_BTHD.index(i) for i in range(4)])
    d = int(q.shape[3])
    sc = float(scale) if scale is not None else d ** -0.5
    args = (q, k, v) if mask is None else (q, k, v, mask)
    ctx.nodes.append(AttentionKernel(name, "aotfuse.attention_template", args, (), True, view.as_strided(),
                                     causal=bool(causal), scale=sc, mask=mask_kind(mask_dtype)))
    return view
