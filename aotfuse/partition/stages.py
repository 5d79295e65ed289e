"""A staged backward: the backward graph cut into K programs that run in order, each returning the gradients
that are complete by its end, so a data-parallel wrapper (DDP) gets them while the rest of the backward
still runs and its all-reduce overlaps the compute.

One backward program returns every gradient when it ends; DDP's buckets are all-reduced after that, with
nothing left to hide the communication behind. Cut into stages, the runtime's autograd chain
(runtime/training.py) runs stage 0 and hands its gradients to autograd (DDP's hooks fire and its bucket's
all-reduce is queued on its own stream) before it queues stage 1, and so on.

Where the cuts go: each gradient gets a stage by the order the graph completes them (the node that
produces each), so that the stages hand over about equal bytes (DDP's buckets fill in that order: its
first iteration rebuilds them by arrival); every other node runs as late as its readers allow (the
earliest stage that reads it), so a stage computes only what its gradients need and only values read
by two stages cross a cut (computed in the first, carried to the second). A multi-output op's tuple never
crosses: its getitems run where it runs.

Stage programs (TrainInfo.stages, .carries): stage k takes the backward's inputs (the saved tensors, then
the loss's gradient), then the `carries[k-1]` values the previous stage carries over; it returns its
gradients (TrainInfo.stages[k], indices into `grads`, in order), then the `carries[k]` values it carries
on (those defined by it or an earlier stage and read after it; a value carried through is an input
returned as it is).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..errors import BuildError
from ..fxgraph import size_hint


@dataclasses.dataclass(frozen=True)
class Staging:
    graphs: tuple  # one fx.GraphModule per stage
    stages: tuple[tuple[int, ...], ...]  # per stage: indices into the backward's outputs (grads), in order
    carries: tuple[int, ...]  # per stage: values carried on to the next (last: 0)
    carried_bytes: tuple[int, ...]  # per stage: bytes of those values
    why: str


def _nbytes(val) -> int:
    return size_hint(val.numel()) * val.element_size() if isinstance(val, torch.Tensor) else 0


_VIEW_NAMES = frozenset(("view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze",
                         "squeeze", "alias", "slice", "select", "as_strided", "detach", "narrow", "unflatten",
                         "view_as", "expand_as"))


def _readers(ph: fx.Node) -> list:
    """The nodes that read a placeholder's storage: its users, and through views of it, theirs."""
    import operator

    out, todo, seen = [], [ph], {ph}
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.op == "output" or u in seen:
                continue
            seen.add(u)
            out.append(u)
            name = getattr(u.target, "__name__", "").split(".")[0]
            if u.target is operator.getitem or name in _VIEW_NAMES:
                todo.append(u)
    return out


def _assign(body, grads, anchor, cap, k):
    """(node -> stage, gradient -> stage): every node as late as its readers and its cap allow."""
    stage_of = {}
    for n in reversed(body):
        users = [stage_of[u] for u in n.users if u in stage_of]
        st = min(users) if users else k - 1
        stage_of[n] = min(st, cap.get(n, k))
    for n in body:  # a multi-output op's tuple never crosses a cut: its getitems run where it runs
        if not isinstance(n.meta.get("val"), torch.Tensor):
            for u in n.users:
                if u in stage_of:
                    stage_of[u] = stage_of[n]
    grad_stage = [cap.get(g, anchor[i]) if isinstance(g, fx.Node) else anchor[i] for i, g in enumerate(grads)]
    grad_stage = [min(gs, stage_of.get(g, gs)) if isinstance(g, fx.Node) else gs for g, gs in zip(grads, grad_stage)]
    return stage_of, grad_stage


def stage_backward(bwd_gm: fx.GraphModule, k: int, pinned: dict[int, int] | None = None) -> Staging:
    """Cut `bwd_gm` (placeholders: saved tensors then the tangent; output: the gradients) into at most k
    stages. k <= 1, or a graph with fewer than 2 gradients, gives one stage: the graph itself. `pinned`:
    saved index -> gradient index of a parameter the backward reads; no stage after that gradient's reads it."""
    nodes = list(bwd_gm.graph.nodes)
    out = next(n for n in reversed(nodes) if n.op == "output")
    grads = list(out.args[0])
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    # sizes of dynamic dims (partition/mincut.dim_value: no inputs, no cost): copied into each stage that
    # reads them, never carried
    dim_sizes = [n for n in body if isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat))]
    body = [n for n in body if not isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat))]
    pos = {n: i for i, n in enumerate(body)}
    ready = [pos.get(g, -1) if isinstance(g, fx.Node) else -1 for g in grads]
    if k <= 1 or len(grads) < 2:
        return Staging((bwd_gm,), (tuple(range(len(grads))),), (0,), (0,), "one backward program")
    sizes = [_nbytes(g.meta.get("val")) if isinstance(g, fx.Node) else 0 for g in grads]
    total = sum(sizes) or 1
    # each gradient's stage: by completion order, about equal bytes per stage
    anchor, acc = {}, 0
    for i in sorted(range(len(grads)), key=lambda i: ready[i]):
        st = min(k - 1, int(k * (acc + sizes[i] / 2) / total))
        acc += sizes[i]
        anchor[i] = st
    node_anchor = {}
    for i, g in enumerate(grads):
        if isinstance(g, fx.Node) and g.op != "placeholder":
            node_anchor[g] = min(node_anchor.get(g, k), anchor[i])
    # a saved parameter (or a view of it) is read only up to the stage that hands its gradient over: an
    # optimizer step in a gradient hook (ZeRO-style overlap) may change it as soon as the gradient is out
    placeholders = [n for n in nodes if n.op == "placeholder"]
    readers = {gi: _readers(placeholders[i]) for i, gi in (pinned or {}).items() if i < len(placeholders)}
    cap = dict(node_anchor)
    while True:
        stage_of, grad_stage = _assign(body, grads, anchor, cap, k)
        moved = False
        for gi, rs in readers.items():
            for r in rs:
                if stage_of.get(r, -1) > grad_stage[gi]:
                    cap[r] = min(cap.get(r, k), grad_stage[gi])
                    moved = True
        if not moved:
            break
    used = sorted(set(grad_stage) | set(stage_of.values()))
    renum = {st: j for j, st in enumerate(used)}
    stage_of = {n: renum[st] for n, st in stage_of.items()}
    grad_stage = [renum[st] for st in grad_stage]
    n_stages = len(used)
    if n_stages < 2:
        return Staging((bwd_gm,), (tuple(range(len(grads))),), (0,), (0,),
                       "one backward program: every gradient needs the whole backward")
    stages = tuple(tuple(i for i in range(len(grads)) if grad_stage[i] == s) for s in range(n_stages))
    # carried after stage s: values of stages <= s read by a later stage, or returned as a later stage's gradient
    carried = []
    for s in range(n_stages):
        later_reads = {a for n in body if stage_of[n] > s for a in n.all_input_nodes}
        later_reads |= {grads[i] for i in range(len(grads)) if grad_stage[i] > s and isinstance(grads[i], fx.Node)}
        carried.append([n for n in body if stage_of[n] <= s and n in later_reads])
    for s, vals in enumerate(carried):
        bad = [n.name for n in vals if not isinstance(n.meta.get("val"), torch.Tensor)]
        if bad:
            raise BuildError(f"internal: backward stage {s} would carry non-tensor values {bad}")
    graphs = []
    for s in range(n_stages):
        g = fx.Graph()
        env = {}
        for ph in placeholders:
            env[ph] = g.placeholder(ph.name)
            env[ph].meta = dict(ph.meta)
        if s:
            for n in carried[s - 1]:
                env[n] = g.placeholder(f"carry_{n.name}")
                env[n].meta = dict(n.meta)
        mine = [n for n in body if stage_of[n] == s]
        read = {a for n in mine for a in n.all_input_nodes}
        for n in dim_sizes:
            if n in read:
                env[n] = g.node_copy(n)
        for n in mine:
            env[n] = g.node_copy(n, lambda x: env[x])
        outs = [env[grads[i]] if isinstance(grads[i], fx.Node) else grads[i] for i in stages[s]]
        outs += [env[n] for n in carried[s]] if s < n_stages - 1 else []
        g.output(tuple(outs))
        g.lint()
        graphs.append(fx.GraphModule(bwd_gm, g))
    carries = tuple(len(carried[s]) if s < n_stages - 1 else 0 for s in range(n_stages))
    cbytes = tuple(sum(_nbytes(n.meta.get("val")) for n in carried[s]) if s < n_stages - 1 else 0
                   for s in range(n_stages))
    gb = [sum(sizes[i] for i in st) for st in stages]
    why = (f"{n_stages} backward stages (asked {k}): gradients by completion order, about equal bytes per stage, "
           f"each node in the first stage that reads it "
           f"({', '.join(f'{len(st)} grads {b / 2**20:.1f} MiB' for st, b in zip(stages, gb))}); carried between "
           f"stages: {', '.join(f'{c} values {b / 2**20:.1f} MiB' for c, b in zip(carries[:-1], cbytes[:-1]))}")
    return Staging(tuple(graphs), stages, carries, cbytes, why)
