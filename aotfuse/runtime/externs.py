"""The allow-list of aten overloads the program may call. Nothing outside it is ever resolved."""
from __future__ import annotations

import torch

from ..errors import ArchiveError

aten = torch.ops.aten

ALLOWED = {
    "aten.mm.out": aten.mm.out,
    "aten.bmm.out": aten.bmm.out,
    "aten.addmm.out": aten.addmm.out,
    "aten.embedding.out": aten.embedding.out,
    "aten.convolution.out": aten.convolution.out,
    "aten.scaled_dot_product_attention.default": aten.scaled_dot_product_attention.default,
    "aten.embedding_dense_backward.out": aten.embedding_dense_backward.out,
}


def resolve(target: str):
    fn = ALLOWED.get(target)
    if fn is None:
        raise ArchiveError(f"program calls {target!r}, which is not on the runtime's extern allow-list",
                           remedy="rebuild the archive with this aotfuse version")
    return fn
