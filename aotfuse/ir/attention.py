"""The attention template's loop-IR node: an inference scaled_dot_product_attention that codegen emits
as a Triton flash-attention kernel (emit/template_attn.py) instead of calling torch's sdpa.

To every pass that does not know it (dependencies, inlining, fusion, memory planning) it is an
Extern: it reads its q, k, v views whole and writes its own buffer, and nothing fuses into it.
Fusion gives its group the kind "attention"; codegen writes the kernel; the program launches it
like any kernel (no extern instruction). Its output buffer is out_variant (planned in the arena).
"""
from __future__ import annotations

import dataclasses

from .loop import Extern


BLOCK_M = BLOCK_N = 64  # query rows per program, keys per step (H200: the best of scripts/attn_probe.py's configs)


@dataclasses.dataclass(frozen=True)
class AttentionKernel(Extern):
    causal: bool = False
    scale: float = 0.0  # softmax scale (1/sqrt(D) when sdpa's was None)
    block_m: int = BLOCK_M
    block_n: int = BLOCK_N
    num_warps: int = 4
    num_stages: int = 3
    mask: str = ""  # "" none; "bool": args[3] keeps where True; "add": args[3] is added to the scaled scores


def is_attention(node) -> bool:
    return isinstance(node, AttentionKernel)
