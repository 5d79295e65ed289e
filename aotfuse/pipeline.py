"""aotfuse.build: the one function that lists the pipeline's stages in order.

export -> lower -> inline -> fuse -> plan memory -> generate kernels -> compile cubins -> program -> archive.
Each stage is a function from one value to the next; the pipeline records what each decided and
how long it took, in the report stored in the archive.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

import msgpack
import torch

from . import __version__
from .archive import write_archive
from .archive.format import write_atomically
from .dtypes import TORCH
from .emit.compile import compile_all
from .emit.kernel_src import generate
from .emit.program import build_program
from .export import capture
from .knobs import knobs
from .schedule.fusion import fuse
from .schedule.inline import inline_pointwise
from .lower import lower
from .schedule.memplan import plan_memory

Progress = Callable[[str, dict], None]


@dataclasses.dataclass(frozen=True)
class BuildResult:
    data: bytes
    report: dict
    timings: dict

    def save(self, path) -> int:
        import os

        os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
        write_atomically(path, (self.data,))
        return len(self.data)


class _Stages:
    # Records timings and emits progress events around each stage.
    def __init__(self, progress: Progress | None):
        self.progress = progress
        self.timings: dict[str, float] = {}

    def run(self, name: str, fn, *args, **kwargs):
        if self.progress:
            self.progress("stage", {"name": name, "status": "start"})
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.timings[name] = round(time.perf_counter() - t0, 4)
        if self.progress:
            self.progress("stage", {"name": name, "status": "done", "seconds": self.timings[name]})
        return out


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """One program's compiler state between stages (forward, or backward for --train)."""

    name: str
    cg: object
    graph: object
    lctx: object
    n_lowered: int
    inlined: tuple
    sched: object
    plan: object
    kernels: dict


def _schedule_program(st: _Stages, name: str, cg) -> _Compiled:
    sfx = "" if name == "forward" else f"[{name}]"
    graph, lctx = st.run("lower" + sfx, lower, cg, name)
    n_lowered = len(graph.nodes)
    graph, inlined = st.run("inline" + sfx, inline_pointwise, graph)
    sched = st.run("fuse" + sfx, fuse, graph)
    plan = st.run("memory_plan" + sfx, plan_memory, graph, sched)
    kernels = st.run("codegen" + sfx, lambda: {g.name: generate(g, graph, sched.stored)
                                               for g in sched.groups if g.kind != "extern"})
    return _Compiled(name, cg, graph, lctx, n_lowered, inlined, sched, plan, kernels)


def build(model: torch.nn.Module, example_inputs=(), *, example_kwargs: dict | None = None, targets=None,
          train: bool = False, memory_budget: float = 1.0, progress: Progress | None = None) -> BuildResult:
    """Package `model` for `example_inputs`' shapes into one .aotf archive (returned as bytes).

    train=True: the model's forward returns the loss; the archive holds a forward program (loss and
    the tensors saved for the backward) and a backward program (gradients), split by our min-cut.

    example_kwargs: keyword arguments of the example call, `model(*example_inputs, **example_kwargs)`,
    as users call it (`input_ids=`, `labels=`). Tensor values become program inputs named by their
    keyword, after the positional ones, in the order `report["call"]["inputs"]["keywords"]` records;
    constants (None, bool, int, float, str) are specialized. `report["call"]["outputs"]` records the
    output's structure (ModelOutput fields / dict keys / tuple) whose leaves are the outputs in order.
    """
    targets = tuple(targets or knobs.targets)
    st = _Stages(progress)
    t_all = time.perf_counter()
    example_inputs = tuple(example_inputs)
    train_info = None
    if train:
        from .joint import trace_joint
        from .partition import partition
        from .pipeline_train import train_graphs as _train_graphs

        joint = st.run("joint", trace_joint, model, example_inputs, example_kwargs=example_kwargs)
        call = {"inputs": joint.call, "outputs": joint.outputs_tree, "loss_leaf": joint.loss_leaf}
        part = st.run("partition", partition, joint, memory_budget)
        fwd_cg, bwd_cg, train_info = _train_graphs(joint, part)
        progs = [_schedule_program(st, "forward", fwd_cg), _schedule_program(st, "backward", bwd_cg)]
    else:
        cg = st.run("export", capture, model, example_inputs, example_kwargs=example_kwargs)
        call = {"inputs": cg.call, "outputs": cg.outputs_tree}
        progs = [_schedule_program(st, "forward", cg)]
    all_kernels = [k for p in progs for k in p.kernels.values()]
    binaries = st.run("compile", compile_all, all_kernels, targets, knobs.compile_workers, progress)
    programs = {p.name: st.run("program" + ("" if p.name == "forward" else f"[{p.name}]"), build_program,
                               p.graph, p.sched, p.kernels, p.plan) for p in progs}
    report = _report(progs[0])
    if len(progs) > 1:
        report["backward"] = _report(progs[1])
        report["partition"] = part.report()
    report["call"] = call  # how the program's flat inputs/outputs map to the model's call and output object
    manifest, parts, weights = st.run("archive", _pack, progs, programs, binaries, report, targets, train_info)
    data = write_archive(manifest, parts, weights)
    st.timings["total"] = round(time.perf_counter() - t_all, 4)
    report["timings"] = dict(st.timings)  # like the count below, not in the archive (reproducible bytes)
    report["compiled_kernels"] = len(binaries)
    return BuildResult(data, report, dict(st.timings))


def _report(p: _Compiled) -> dict:
    sched, plan, kernels = p.sched, p.plan, p.kernels
    refused = [d for d in sched.decisions if not d.fused]
    refusals = collections.Counter(d.refusal.value for d in refused)  # by kind, in first-seen order
    launches = collections.Counter(k.name for k in kernels.values())
    return {
        "fusion_summary": {
            "loop_ir_nodes": p.n_lowered,
            "inlined": len(p.inlined),
            "groups": len(sched.groups),
            "kernel_launches": len(kernels),
            "unique_kernels": len(launches),
            "externs": sum(1 for g in sched.groups if g.kind == "extern"),
            "fused_pairs": sum(1 for d in sched.decisions if d.fused),
            "refused_pairs": len(refused),
            "refusals": dict(refusals),
        },
        # each fusion, and each distinct refused pair once: reason = FuseRefusal value (None if fused)
        "fusion": [d.to_report() for d in sched.decisions],
        "inline": [dataclasses.asdict(d) for d in p.inlined],
        "lowering": p.lctx.decisions,
        "groups": [{"name": g.name, "kind": g.kind, "nodes": list(g.nodes), "xnumel": g.xnumel, "rnumel": g.rnumel,
                    "kernel": kernels[g.name].name if g.name in kernels else None} for g in sched.groups],
        "memory": {"arena_bytes": plan.arena_bytes, "naive_bytes": plan.naive_bytes,
                   "buffers": len(plan.allocations), "bound_extern_results": len(plan.bound)},
    }


def _pack(progs, programs, binaries, report, targets, train_info):
    kpart, sources = {}, {}
    for p in progs:
        for k in p.kernels.values():
            entry = kpart.setdefault(k.name, {
                "kind": k.kind, "nodes": list(k.nodes), "grid": list(k.grid), "num_warps": k.num_warps,
                "xblock": k.xblock, "rblock": k.rblock, "xnumel": k.xnumel, "rnumel": k.rnumel,
                "args": [{"name": a.name, "dtype": a.dtype, "role": a.role, "numel": a.numel} for a in k.args],
                "binaries": {arch: {"cubin": b.cubin, "name": b.name, "num_warps": b.num_warps, "shared": b.shared,
                                    "global_scratch": b.global_scratch, "profile_scratch": b.profile_scratch}
                             for arch, b in binaries[k.name].items()},
                "launches": 0,
            })
            entry["launches"] += 1
            # Identical sources may be launched on buffers of different sizes (e.g. a prefix read):
            # record the smallest, which every launch satisfies and which covers what the kernel touches.
            for rec, a in zip(entry["args"], k.args):
                rec["numel"] = min(rec["numel"], a.numel)
            sources[k.name] = k.source
    weights = {}
    for p in progs:
        for buf, fqn in p.graph.weights:
            weights[fqn] = p.lctx.constants[buf] if fqn.startswith("__const__.") else p.cg.weights[fqn]
    if train_info:
        weights.update(train_info.pop("param_tensors"))
    fwd = progs[0]
    bufs = fwd.graph.buffer_map
    manifest = {
        "format": "aotfuse",
        "aotfuse_version": __version__,
        "torch_version": torch.__version__.split("+")[0],
        "targets": list(targets),
        "programs": [p.name for p in progs],
        "inputs": [s.to_dict() for s in fwd.cg.inputs],
        "outputs": [{"shape": list(o.view.shape), "dtype": str(TORCH[bufs[o.view.buf].dtype])}
                    for o in fwd.graph.outputs],
        "single_output": fwd.cg.single_output,
        "kernels": sorted(kpart),
    }
    if train_info:
        manifest["inputs"] = train_info["user_inputs"]
        manifest["outputs"] = manifest["outputs"][:1]  # the loss; the rest are saved for the backward
        manifest["single_output"] = True
        manifest["train"] = train_info
    pack = lambda v: msgpack.packb(v, use_bin_type=True)  # noqa: E731
    parts = {"kernels": pack(kpart), "sources": pack(sources), "report": pack(report)}
    for name, prog in programs.items():
        parts[f"program.{name}"] = pack(prog)  # no timings in the archive: builds are byte-for-byte reproducible
    return manifest, parts, weights
