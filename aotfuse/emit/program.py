"""The execution program, built from the schedule and the memory plan: a `contract.Program`.

Its schema (instructions, fields, versions) is aotfuse/contract/program.py and artifacts/FORMAT.md.
"""
from __future__ import annotations

from ..contract.program import (PROGRAM_VERSION, Alloc, Extern as ExternIns, ExternOut, Free, Launch, LaunchCase, Program, ProgramInput,
                                Return, TensorRef, WeightSpec)
from ..ir.loop import Extern, LoopGraph, TensorArg
from ..schedule.fusion import Schedule
from ..schedule.memplan import MemoryPlan
from .kernel_src import KernelSource
from ..ir.sizes import spelled


def _sizes(ns) -> tuple:
    return tuple(spelled(n) for n in ns)


def program_arg(a):
    """An IR extern argument as a program argument: TensorArg -> TensorRef, sequences -> tuples."""
    if isinstance(a, TensorArg):
        return TensorRef(a.buf, _sizes(a.shape), _sizes(a.stride), spelled(a.offset))
    if isinstance(a, (list, tuple)):
        return tuple(program_arg(x) for x in a)
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise TypeError(f"extern argument of type {type(a).__name__} cannot be encoded")


def build_program(graph: LoopGraph, sched: Schedule, kernels: dict[str, KernelSource], plan: MemoryPlan) -> Program:
    bufs = graph.buffer_map
    nodes = {n.name: n for n in graph.nodes}
    alloc_of = {a.buf: a for a in plan.allocations}
    separate = set(plan.separate)
    frees = dict(plan.frees)
    instrs: list = []

    def alloc(name: str, own: bool) -> Alloc:  # own: an allocation of its own, not in the arena
        b = bufs[name]
        if own:
            return Alloc(name, -1, _sizes(b.shape), b.dtype)
        a = alloc_of[name]
        return Alloc(name, spelled(a.offset), _sizes(b.shape), b.dtype, a.host)

    # multi-output externs: the call's further results (ir.loop.Extern.result), defined by its instruction
    results: dict[str, list] = {}
    for n in graph.nodes:
        if isinstance(n, Extern) and n.result is not None:
            results.setdefault(n.result[0], []).append(n)
    # outputs that host buffers dying before they are written (schedule/hosts.py): allocated first
    hosting = set(plan.hosting_outputs)
    instrs += [alloc(name, True) for name in plan.hosting_outputs]
    for step, g in enumerate(sched.groups):
        if g.kind == "extern":
            ext: Extern = nodes[g.nodes[0]]
            if ext.result is not None:  # bound by its call's instruction (scheduled before it)
                if step in frees:
                    instrs.append(Free(tuple(frees[step])))
                continue
            b = bufs[ext.name]
            if (ext.name in alloc_of or ext.name in separate) and ext.name not in hosting:
                instrs.append(alloc(ext.name, ext.name not in alloc_of))
            outs = tuple(ExternOut(r.name, program_arg(r.out), _sizes(bufs[r.name].shape), bufs[r.name].dtype)
                         for r in sorted(results.get(ext.name, ()), key=lambda r: r.result[1]))
            instrs.append(ExternIns(ext.target, program_arg(ext.args), {k: program_arg(v) for k, v in ext.kwargs},
                                    ext.name, program_arg(ext.out), ext.out_variant, _sizes(b.shape), b.dtype, outs))
        else:
            k = kernels[g.name]
            instrs += [alloc(a.buf, a.buf in separate) for a in k.args if a.role == "out" and a.buf not in hosting]
            choose = tuple(LaunchCase(upto, v.name, tuple(v.grid), tuple(v.sizes) if v.aligned_sizes else ())
                           for upto, v in k.variants)
            instrs.append(Launch(k.name, tuple(k.grid), tuple(a.buf for a in k.args), sizes=tuple(k.sizes),
                                 choose=choose, on=k.variant_on if choose else None))
        if step in frees:
            instrs.append(Free(tuple(frees[step])))
    instrs.append(Return(tuple(program_arg(o.view) for o in graph.outputs)))
    return Program(
        version=PROGRAM_VERSION,
        inputs=tuple(ProgramInput(name, _sizes(bufs[name].shape), bufs[name].dtype) for name in graph.inputs),
        weights={buf: fqn for buf, fqn in graph.weights},
        weight_specs={buf: WeightSpec(tuple(bufs[buf].shape), bufs[buf].dtype) for buf, _ in graph.weights},
        arena_bytes=spelled(plan.arena_bytes),
        rng=graph.rng,
        instructions=tuple(instrs),
    )
