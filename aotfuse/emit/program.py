"""The execution program: a flat list of instructions, as plain data (msgpack), never code.

Instructions (all fields are data):
  alloc  {buf, offset, shape, dtype}          view of the per-call arena (offset -1: its own allocation)
  launch {kernel, grid, args: [buf...]}       one fused kernel
  extern {target, args, kwargs, out, out_view, out_variant, shape, dtype}
  free   {bufs: [...]}                        drop references after their last use
  return {outputs: [view...]}

Version 2 (2026-11-23) adds `weight_specs` {buf: {shape, dtype}}: the shape and dtype each weight
had at build time, so the runtime refuses an archive whose weight tensor disagrees with its program.
The kernels part records per argument the element count it was generated for (see pipeline._pack).
"""
from __future__ import annotations

from ..schedule.fusion import Schedule
from ..ir.loop import Extern, LoopGraph, TensorArg
from ..schedule.memplan import MemoryPlan
from .kernel_src import KernelSource

PROGRAM_VERSION = 2


def encode_arg(a):
    if isinstance(a, TensorArg):
        return {"t": a.buf, "shape": list(a.shape), "stride": list(a.stride), "offset": a.offset}
    if isinstance(a, (list, tuple)):
        return [encode_arg(x) for x in a]
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise TypeError(f"extern argument of type {type(a).__name__} cannot be encoded")


def build_program(graph: LoopGraph, sched: Schedule, kernels: dict[str, KernelSource], plan: MemoryPlan) -> dict:
    bufs = graph.buffer_map
    nodes = {n.name: n for n in graph.nodes}
    alloc_of = {a.buf: a for a in plan.allocations}
    separate = set(plan.separate)
    frees = dict(plan.frees)
    instrs = []
    for step, g in enumerate(sched.groups):
        if g.kind == "extern":
            ext: Extern = nodes[g.nodes[0]]
            b = bufs[ext.name]
            if ext.name in alloc_of:
                instrs.append(_alloc(alloc_of[ext.name], b))
            elif ext.name in separate:
                instrs.append(_alloc_separate(ext.name, b))
            instrs.append({"op": "extern", "target": ext.target, "args": encode_arg(ext.args),
                           "kwargs": {k: encode_arg(v) for k, v in ext.kwargs}, "out": ext.name,
                           "out_view": encode_arg(ext.out), "out_variant": ext.out_variant,
                           "shape": list(b.shape), "dtype": b.dtype})
        else:
            k = kernels[g.name]
            for a in k.args:
                if a.role == "out":
                    instrs.append(_alloc_separate(a.buf, bufs[a.buf]) if a.buf in separate
                                  else _alloc(alloc_of[a.buf], bufs[a.buf]))
            instrs.append({"op": "launch", "kernel": k.name, "grid": list(k.grid), "args": [a.buf for a in k.args]})
        if step in frees:
            instrs.append({"op": "free", "bufs": list(frees[step])})
    instrs.append({"op": "return", "outputs": [encode_arg(o.view) for o in graph.outputs]})
    return {
        "version": PROGRAM_VERSION,
        "inputs": [{"buf": name, "shape": list(bufs[name].shape), "dtype": bufs[name].dtype} for name in graph.inputs],
        "weights": {buf: fqn for buf, fqn in graph.weights},
        "weight_specs": {buf: {"shape": list(bufs[buf].shape), "dtype": bufs[buf].dtype} for buf, _ in graph.weights},
        "arena_bytes": plan.arena_bytes,
        "rng": graph.rng,
        "instructions": instrs,
    }


def _alloc_separate(name, b) -> dict:
    return {"op": "alloc", "buf": name, "offset": -1, "shape": list(b.shape), "dtype": b.dtype}


def _alloc(a, b) -> dict:
    return {"op": "alloc", "buf": a.buf, "offset": a.offset, "shape": list(b.shape), "dtype": b.dtype}
