"""A staged backward: the backward graph cut into K programs that run in order, each returning the gradients
that are complete by its end, so a data-parallel wrapper (DDP) gets them while the rest of the backward
still runs and its all-reduce overlaps the compute.

One backward program returns every gradient when it ends; DDP's buckets are all-reduced after that, with
nothing left to hide the communication behind. Cut into stages, the runtime's autograd chain
(runtime/training.py) runs stage 0 and hands its gradients to autograd (DDP's hooks fire and its bucket's
all-reduce is queued on its own stream) before it queues stage 1, and so on.

Where the cuts go: the gradients in the order the graph completes them (the node that produces each),
cut where the running sum of gradient bytes crosses k/K of the total, so the stages hand over about equal
bytes (DDP's buckets fill in that order: the first iteration rebuilds them by arrival). A cut is moved
later while a value crossing it is not a tensor (a multi-output op's tuple is read through getitem).

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


@dataclasses.dataclass(frozen=True)
class Staging:
    graphs: tuple  # one fx.GraphModule per stage
    stages: tuple[tuple[int, ...], ...]  # per stage: indices into the backward's outputs (grads), in order
    carries: tuple[int, ...]  # per stage: values carried on to the next (last: 0)
    carried_bytes: tuple[int, ...]  # per stage: bytes of those values
    why: str


def _nbytes(val) -> int:
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def stage_backward(bwd_gm: fx.GraphModule, k: int) -> Staging:
    """Cut `bwd_gm` (placeholders: saved tensors then the tangent; output: the gradients) into at most k
    stages. k <= 1, or a graph with fewer than 2 gradients, gives one stage: the graph itself."""
    nodes = list(bwd_gm.graph.nodes)
    out = next(n for n in reversed(nodes) if n.op == "output")
    grads = list(out.args[0])
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    pos = {n: i for i, n in enumerate(body)}
    ready = [pos.get(g, -1) if isinstance(g, fx.Node) else -1 for g in grads]
    if k <= 1 or len(grads) < 2:
        return Staging((bwd_gm,), (tuple(range(len(grads))),), (0,), (0,), "one backward program")
    sizes = [_nbytes(g.meta.get("val")) if isinstance(g, fx.Node) else 0 for g in grads]
    total = sum(sizes) or 1
    order = sorted(range(len(grads)), key=lambda i: ready[i])
    cuts, acc, target = [], 0, 1
    for i in order:
        acc += sizes[i]
        while target < k and acc * k >= target * total:
            cuts.append(ready[i])
            target += 1
    last_use = {}  # node -> position of its last reader in the body (len(body) for the output)
    for n in body:
        for a in n.all_input_nodes:
            last_use[a] = pos[n]
    for g in grads:
        if isinstance(g, fx.Node):
            last_use[g] = max(last_use.get(g, -1), len(body))

    def movable(c: int) -> int:  # the first cut at or after c that no non-tensor value crosses
        while c < len(body) - 1:
            crossing = [last_use[n] for n in body[:c + 1]
                        if last_use.get(n, -1) > c and not isinstance(n.meta.get("val"), torch.Tensor)]
            if not crossing:
                break
            c = max(crossing)
        return c

    bounds = sorted({movable(c) for c in cuts if 0 <= c < len(body) - 1})
    bounds = [b for b in bounds if b < len(body) - 1]
    if not bounds:
        return Staging((bwd_gm,), (tuple(range(len(grads))),), (0,), (0,),
                       "one backward program: no cut between gradients")
    ranges = []
    lo = 0
    for b in bounds:
        ranges.append((lo, b))
        lo = b + 1
    ranges.append((lo, len(body) - 1))
    stage_of = {}
    for s, (a, b) in enumerate(ranges):
        for n in body[a:b + 1]:
            stage_of[n] = s
    placeholders = [n for n in nodes if n.op == "placeholder"]
    grad_stage = [stage_of.get(g, 0) if isinstance(g, fx.Node) else 0 for g in grads]
    stages = tuple(tuple(i for i in range(len(grads)) if grad_stage[i] == s) for s in range(len(ranges)))
    # carried after stage s: values of stages <= s read by a later stage, or returned as a later stage's gradient
    carried = []
    for s in range(len(ranges)):
        later_reads = {a for n in body if stage_of[n] > s for a in n.all_input_nodes}
        later_reads |= {grads[i] for i in range(len(grads)) if grad_stage[i] > s and isinstance(grads[i], fx.Node)}
        carried.append([n for n in body if stage_of[n] <= s and n in later_reads])
    for s, vals in enumerate(carried):
        bad = [n.name for n in vals if not isinstance(n.meta.get("val"), torch.Tensor)]
        if bad:
            raise BuildError(f"internal: backward stage {s} would carry non-tensor values {bad}")
    graphs = []
    for s, (a, b) in enumerate(ranges):
        g = fx.Graph()
        env = {}
        for ph in placeholders:
            env[ph] = g.placeholder(ph.name)
            env[ph].meta = dict(ph.meta)
        if s:
            for n in carried[s - 1]:
                env[n] = g.placeholder(f"carry_{n.name}")
                env[n].meta = dict(n.meta)
        for n in body[a:b + 1]:
            env[n] = g.node_copy(n, lambda x: env[x])
        outs = [env[grads[i]] if isinstance(grads[i], fx.Node) else grads[i] for i in stages[s]]
        outs += [env[n] for n in carried[s]] if s < len(ranges) - 1 else []
        g.output(tuple(outs))
        g.lint()
        graphs.append(fx.GraphModule(bwd_gm, g))
    carries = tuple(len(carried[s]) if s < len(ranges) - 1 else 0 for s in range(len(ranges)))
    cbytes = tuple(sum(_nbytes(n.meta.get("val")) for n in carried[s]) if s < len(ranges) - 1 else 0
                   for s in range(len(ranges)))
    gb = [sum(sizes[i] for i in st) for st in stages]
    why = (f"{len(ranges)} backward stages (asked {k}): gradients cut by completion order into about equal bytes "
           f"({', '.join(f'{len(st)} grads {b / 2**20:.1f} MiB' for st, b in zip(stages, gb))}); carried between "
           f"stages: {', '.join(f'{c} values {b / 2**20:.1f} MiB' for c, b in zip(carries[:-1], cbytes[:-1]))}")
    return Staging(tuple(graphs), stages, carries, cbytes, why)
