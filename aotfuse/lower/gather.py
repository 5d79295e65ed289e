"""Gather lowerings (index_select, gather, index.Tensor): loads at data-dependent offsets (ir.loop.Gather)."""
from __future__ import annotations

import torch

from .rules import collector

aten = torch.ops.aten
RULES: list = []
rule = collector(RULES)


def register_all(register) -> None:
    """Files this module's rules in the registry (called once, by registry.build, in a fixed order)."""
    for r in RULES:
        register(*r.ops, category=r.category, note=r.note)(r.fn)
