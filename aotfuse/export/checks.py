"""Export's metadata checks leave the graph before anything reads it.

`x.to(device=, dtype=)` leaves an `aten._assert_tensor_metadata` node on x in an exported graph: a check of
x's dtype, device and layout that the trace already established (shapes and dtypes are the archive's guards).
FX's dead-code elimination keeps such a node (it has side effects), and with it everything it reads: a
transformers mask that no layer uses (Gemma 3 with only sliding-window layers builds the full causal mask
too) stayed in the graph, lowered to kernels that stored nothing, and the archive was refused at load. So
the checks are erased and the graph's dead code with them.
"""
from __future__ import annotations

import torch

CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)


def drop_metadata_checks(gm: torch.fx.GraphModule) -> int:
    """Erase the metadata checks, then the code only they read. Returns how many checks went."""
    graph = gm.graph
    checks = [n for n in graph.nodes if n.op == "call_function" and n.target in CHECKS]
    for n in checks:
        graph.erase_node(n)
    if checks:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    return len(checks)
