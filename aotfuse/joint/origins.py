"""Which line of the model a joint-graph op came from, for the refusals that name it.

aot_autograd traces the joint forward/backward graph through an intermediate FX graph of its own, so every
node's stack trace ends in that generated code (`<eval_with_key>.N ... line 59, in forward`), never in the
model's source: a refusal of an op in a training build could only name the op. While the joint graph is
traced, `call_sites()` (a TorchFunctionMode) records, for each torch function the model calls
(`F.max_pool3d`, `torch.nn.functional.grid_sample`, `torch.sort`), the first few model lines that call it:
the innermost frames outside torch and aotfuse. `attribute(gm, sites)` then gives each node without a model
frame of its own the call sites of the function its op's name descends from (`max_pool3d_with_indices_backward`
-> `max_pool3d`, the longest recorded name the op's name starts with), as `node.meta["aotfuse_call_site"]`,
which lowering's refusals print (lower/graph._where). A name match is a pointer, not a proof: the meta says
which function it matched.
"""
from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

from ..fxgraph import is_model_code, model_frames

SITES_PER_FUNCTION = 3  # model lines kept per torch function: enough to point at the call, cheap to record


def _model_frame() -> str | None:
    """The innermost frame outside torch, aotfuse and the standard wrappers, as a traceback line."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if is_model_code(path):
            return f'File "{path}", line {f.f_lineno}, in {f.f_code.co_name}'
        f = f.f_back
    return None


class call_sites(TorchFunctionMode):
    """Records up to SITES_PER_FUNCTION model lines per torch function called while the joint graph is traced."""

    def __init__(self):
        super().__init__()
        self.sites: dict[str, list[str]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        if name and not name.startswith("__"):
            seen = self.sites.setdefault(name.lstrip("_"), [])
            if len(seen) < SITES_PER_FUNCTION:
                where = _model_frame()
                if where and where not in seen:
                    seen.append(where)
        return func(*args, **(kwargs or {}))


def _op_base(target) -> str:
    name = getattr(target, "__name__", str(target)).split(".")[0]
    return name.lstrip("_")


def attribute(gm: torch.fx.GraphModule, sites: dict[str, list[str]]) -> None:
    """node.meta["aotfuse_call_site"] = (function, its model lines) for every op node with no model frame in its
    own stack trace whose op name starts with a recorded function's name (the longest such name)."""
    names = sorted((n for n in sites if sites[n] and len(n) > 2), key=len, reverse=True)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if model_frames(node.meta.get("stack_trace")):
            continue
        base = _op_base(node.target)
        # a name ends where the op's name does or at a separator ("exp" is not "exponential"'s call)
        match = next((n for n in names if base.startswith(n) and base[len(n):len(n) + 1] in ("", "_", ".")), None)
        if match is not None:
            node.meta["aotfuse_call_site"] = (match, tuple(sites[match]))
