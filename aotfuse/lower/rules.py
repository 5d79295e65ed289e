"""A lowering rule (ops, op class, function, note) and the collector each rule module files its rules with."""
from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Rule:
    ops: tuple
    category: str  # a class of aotfuse/opclass.py
    fn: Callable
    note: str = ""


def collector(rules: list):
    """`rule(*ops, category=..., note=...)`, used as `register` was: appends to `rules`, touches no registry."""
    def rule(*ops, category: str, note: str = ""):
        def deco(fn):
            rules.append(Rule(tuple(ops), category, fn, note))
            return fn
        return deco
    return rule
