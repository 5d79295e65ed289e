"""Fold the constant parts of a captured graph that lowering has no rule for.

Model code computes some tensors from nothing but shapes: transformers' causal mask is built from
`arange` position ids through `cumsum` (masking_utils.find_packed_sequence_indices) and advanced
indexing (`index.Tensor`); nothing in it depends on an input or a weight, so it is the same tensor
on every call. Lowering folds constant pointwise/view ops itself (lower/graph.py) but stops at an op
it has no rule for. This pass runs before lowering, on the FX graph: every maximal constant
subgraph that contains such an op is evaluated once, eagerly, on real tensors, and its result becomes
a new weight placeholder (`__folded__.<node>`), stored in the archive like any weight. Only
deterministic, non-mutating ATen ops are evaluated; constant subgraphs lowering can already handle
are left alone (their `arange`/`full` stay visible to later passes such as export/ranges.py).
"""
from __future__ import annotations

import operator

import torch
import torch.fx

PREFIX = "__folded__."


def _pure(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    t = node.target
    if t is operator.getitem:
        return True
    if not isinstance(t, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in t.tags or t._schema.is_mutable:
        return False
    return t.namespace == "aten"


def _map(x, env):
    if isinstance(x, torch.fx.Node):
        return env[x]
    if isinstance(x, (list, tuple)):
        return type(x)(_map(a, env) for a in x)
    if isinstance(x, dict):
        return {k: _map(v, env) for k, v in x.items()}
    return x


_EMPTIES = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_permuted.default,
            torch.ops.aten.empty_like.default, torch.ops.aten.empty_strided.default,
            torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default}


def fold_unlowerable_constants(gm: torch.fx.GraphModule, lowerable, after: torch.fx.Node | None = None,
                               seeds: dict | None = None) -> list[tuple[str, str, torch.Tensor]]:
    """Replace each constant subgraph that holds an op `lowerable(target)` rejects by a placeholder.

    `seeds`: placeholder name -> tensor, placeholders whose value is fixed at build time (an inference
    archive's buffers). Returns [(placeholder name, fqn, tensor)] for the new placeholders, inserted
    after `after` (default: the last placeholder) in graph order; the caller records them as weights."""
    graph = gm.graph
    seeds = seeds or {}
    const: dict[torch.fx.Node, bool] = {}  # constant node -> its subgraph holds an unlowerable op
    env: dict[torch.fx.Node, object] = {}
    for n in graph.nodes:
        if n.op == "placeholder" and n.name in seeds:
            const[n], env[n] = False, seeds[n.name]
        if _pure(n) and all(a in const for a in n.all_input_nodes):
            own = n.target is not operator.getitem and not lowerable(n.target)
            const[n] = own or any(const[a] for a in n.all_input_nodes)
    frontier = [n for n, bad in const.items() if bad and any(u not in const for u in n.users)]
    if not frontier:
        return []
    for n in graph.nodes:  # graph order is topological
        if n in const and n not in env:
            env[n] = n.target(*_map(n.args, env), **_map(dict(n.kwargs), env))
            if n.target in _EMPTIES and isinstance(env[n], torch.Tensor):
                # uninitialized memory: zeros, as lowering makes them, so that what is stored (where a later
                # write leaves some untouched) is the same from build to build
                env[n] = torch.zeros_like(env[n])
    if after is None:
        after = [n for n in graph.nodes if n.op == "placeholder"][-1]
    out = []
    for n in frontier:
        val = env[n]
        if not isinstance(val, torch.Tensor):
            continue
        val = val.detach().contiguous()
        with graph.inserting_after(after):
            ph = graph.placeholder(f"folded_{n.name}")
        ph.meta["val"] = val
        n.replace_all_uses_with(ph)
        after = ph
        out.append((ph.name, PREFIX + n.name, val))
    # The constant subgraph is dead now, but for its metadata checks (aten._assert_tensor_metadata,
    # which DCE keeps as side effects): they ran, on the real values, while it was evaluated.
    for n in reversed(list(graph.nodes)):
        if n in const and n.op != "placeholder" and not n.users:
            graph.erase_node(n)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return out


def lowerable_ops():
    """What lowering has a rule for: `target -> bool` (the registry, read only)."""
    from ..lower.registry import registry

    rules = registry()
    return lambda target: target in rules
