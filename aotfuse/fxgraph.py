"""Walks over FX graphs that several stages need (the joint trace, the partition)."""
from __future__ import annotations

from typing import Callable, Iterable

import torch


def value(n):
    """A node's traced value (meta['val']: a fake tensor, a size), or None for a non-node or a node without one."""
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


NOT_MODEL_CODE = ("/torch/", "/aotfuse/", "/contextlib.py", "/functools.py", "<eval_with_key>")  # path fragments


def is_model_code(path_or_frame: str) -> bool:
    """Is a source path (or a traceback's `File "..."` line) the model's own code: not torch, aotfuse, the standard
    wrappers or FX's generated code?"""
    return not any(t in path_or_frame for t in NOT_MODEL_CODE)


def model_frames(stack_trace: str | None) -> list[str]:
    """The `File "..."` lines of a node's stack trace that are the model's own code, innermost last."""
    return [ln.strip() for ln in (stack_trace or "").splitlines()
            if ln.strip().startswith("File ") and is_model_code(ln)]


def module_path(node: torch.fx.Node) -> str:
    """The qualified name of the innermost module that made `node` (nn_module_stack), or "" when unknown."""
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def closure(nodes: Iterable, step: Callable[[torch.fx.Node], Iterable]) -> set:
    """The FX nodes among `nodes` and all reachable from them by `step` (non-nodes are skipped)."""
    seen, todo = set(), [n for n in nodes if isinstance(n, torch.fx.Node)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(step(n))
    return seen


def ancestors(nodes: Iterable) -> set:
    """`nodes` and every node they read, transitively."""
    return closure(nodes, lambda n: n.all_input_nodes)


def descendants(node: torch.fx.Node) -> set:
    """`node` and every node that reads it, transitively."""
    return closure([node], lambda n: n.users)


def size_hint(s) -> int:
    """An int, or a torch SymInt's value at the example, read without adding a guard (a dynamic dim stays
    dynamic)."""
    if isinstance(s, torch.SymInt):
        h = s.node.hint
        return int(h) if h is not None else int(s.node.shape_env.size_hint(s.node.expr))
    return int(s)
