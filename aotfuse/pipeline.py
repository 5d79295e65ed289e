"""aotfuse.build: the one function that lists the pipeline's stages in order.

export -> lower -> inline -> trivial reductions -> split reductions -> fuse -> plan memory -> generate kernels -> compile cubins -> program -> archive.
Each stage is a function from one value to the next; the pipeline records what each decided and
how long it took, in the report stored in the archive.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import time
from typing import Callable

import msgpack
import torch

from . import __version__
from .archive import write_archive
from .archive.format import write_atomically
from .contract.kernels import has_pdl, has_target_tiles
from .contract.program import PDL_VERSION, TILES_VERSION
from .emit.pdl import uses_grid_dependency
from .contract import (Binary, FusionSummary, GroupRecord, InlineRecord, KernelArg, KernelEntry,
                       Manifest, MemorySummary, OutputSpec, Report, kernels_to_dict)
from .dtypes import TORCH
from .emit.compile import compile_all
from .emit.kernel_src import generate
from .emit.program import build_program
from .export import capture
from .errors import AotfuseError, BuildError
from .knobs import knobs, override
from .ir.sizes import current_dims, dims_scope, foreign_symbols, hint, spelled
from .schedule.fusion import fuse
from .schedule.inline import inline_pointwise
from .schedule.trivial import trivial_reductions
from .schedule.reorder import reorder_reductions
from .schedule.split import split_reductions
from .lower import lower
from .schedule.donors import donatable_inputs
from .schedule.memplan import plan_memory

Progress = Callable[[str, dict], None]


@dataclasses.dataclass(frozen=True)
class BuildResult:
    data: bytes
    report: Report  # as stored in the archive (its `report` part)
    timings: dict  # stage -> seconds (not in the archive: builds are byte-for-byte reproducible)
    compiled_kernels: int = 0  # distinct kernels compiled (per target)
    manifest: Manifest | None = None  # as stored in the archive (its `call` maps inputs/outputs to the model's)

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
        try:
            out = fn(*args, **kwargs)
        except RecursionError as exc:
            # an expression nested deeper than Python's walks allow: a typed error naming the stage, not a crash
            raise BuildError(f"stage {name}: an expression of this model is nested too deeply for the build's "
                             "recursive walks (a long chain of ops fused into one value)",
                             remedy="report the model (the op making the chain: rewrite it as a reduction); raising "
                                    "sys.setrecursionlimit may get the build through") from exc
        except (TypeError, ValueError) as exc:
            if not current_dims() or isinstance(exc, AotfuseError):
                raise
            # a pass met a size it could only handle as an int: name the stage, never a bare TypeError
            raise BuildError(f"stage {name}: this model's graph needs a case that is not supported with dynamic "
                             f"dims yet ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                             remedy="build it with static shapes (drop --dynamic), or make fewer dims dynamic; "
                                    "report the model") from exc
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
    splits: tuple = ()


def _suffix(program: str) -> str:
    """Stage names carry the program's name, but for the (first) forward program's."""
    return "" if program == "forward" else f"[{program}]"


def _scale_kernels(step: _Compiled, info) -> list:
    """The fused step's backward kernels (emit/scale.py): per gradient output, in order."""
    from .emit.scale import scale_kernel

    bufs = step.graph.buffer_map
    outs = step.graph.outputs[1 + len(info.mutated_buffers):]
    if len(outs) != len(info.grads):
        raise BuildError(f"internal: the step program returns {len(outs)} gradients, the train info lists "
                         f"{len(info.grads)}")
    loss = bufs[step.graph.outputs[0].view.buf].dtype
    return [scale_kernel(bufs[o.view.buf].dtype, math.prod(o.view.shape), loss) for o in outs]


def _schedule_program(st: _Stages, name: str, cg, saved_by: tuple | None = None) -> _Compiled:
    """saved_by: (the forward's _Compiled, its outputs before the saved tensors) for a backward that may
    place buffers in the saved tensors it no longer reads (schedule/donors.py)."""
    sfx = _suffix(name)
    graph, lctx = st.run("lower" + sfx, lower, cg, name)
    n_lowered = len(graph.nodes)
    graph, inlined = st.run("inline" + sfx, inline_pointwise, graph)
    graph, trivial = st.run("trivial" + sfx, trivial_reductions, graph)
    if trivial:  # the pointwise nodes they became may inline into their consumers
        lctx.decisions.extend(trivial)
        graph, more = st.run("inline" + sfx, inline_pointwise, graph)
        inlined = tuple(inlined) + tuple(more)
    # after inlining (a reduction's body holds its real loads), before fusion (the partial fuses)
    graph, splits = st.run("split" + sfx, split_reductions, graph)
    sched = st.run("fuse" + sfx, fuse, graph)
    # a group of reductions walks the reduced index in its largest input's storage order (channels-last GroupNorm rows)
    graph, reordered = st.run("reorder" + sfx, reorder_reductions, graph, sched)
    lctx.decisions.extend(reordered)
    donors, donor_why = None, ""
    if saved_by is not None:
        donors, donor_why = donatable_inputs(saved_by[0].graph, graph, saved_by[1])
    plan = st.run("memory_plan" + sfx, plan_memory, graph, sched, donors)
    if saved_by is not None and not donors:  # what the outputs hosted, and why no saved tensor could
        plan = dataclasses.replace(plan, donation="; ".join(x for x in (plan.donation, f"saved tensors: {donor_why}") if x))
    kernels = st.run("codegen" + sfx, lambda: {g.name: generate(g, graph, sched.stored)
                                               for g in sched.groups if g.kind != "extern"})
    return _Compiled(name, cg, graph, lctx, n_lowered, inlined, sched, plan, kernels, splits)


def build(model: torch.nn.Module, example_inputs=(), *, example_kwargs: dict | None = None, targets=None,
          train: bool = False, memory_budget: float = 1.0, progress: Progress | None = None,
          step: str | None = None, backward_stages: int | None = None, dynamic_shapes=None) -> BuildResult:
    """Package `model` for `example_inputs`' shapes into one .aotf archive (returned as bytes).

    train=True: the model's forward returns the loss. step (default knobs.train_step, "split"): "split"
    packages a forward program (loss and the tensors saved for the backward) and a backward program
    (gradients), split by our min-cut; "auto" (a scalar loss; else split) or "step" packages one program,
    "step": the forward and the backward for a loss gradient of 1 (partition/step.py); the runtime's
    backward scales the gradients by the actual one. backward_stages (default knobs.backward_stages, 1):
    with "split", cut the backward into up to this many programs that hand their gradients to autograd
    in turn (partition/stages.py), so DistributedDataParallel's all-reduce overlaps the rest of the backward.

    dynamic_shapes: dims that vary between calls, as torch.export takes them (a dict by input name, or a
    tuple by position, of {axis: torch.export.Dim(name, min=, max=)}) or as `--dynamic` strings
    ("tokens.1=1..64"). Checked before anything runs; kernels then take the dims as arguments, sizes and
    the memory plan are expressions of them, and the guards check each dim's range (export/dynamic.py).

    example_kwargs: keyword arguments of the example call, `model(*example_inputs, **example_kwargs)`,
    as users call it (`input_ids=`, `labels=`). Tensor values become program inputs named by their
    keyword, after the positional ones, in the order the manifest's `call["inputs"]["keywords"]` records;
    constants (None, bool, int, float, str) are specialized. The manifest's `call["outputs"]` records the
    output's structure (ModelOutput fields / dict keys / tuple) whose leaves are the outputs in order.
    """
    with contextlib.ExitStack() as scope:
        return _build(scope, model, example_inputs, example_kwargs=example_kwargs, targets=targets, train=train,
                      memory_budget=memory_budget, progress=progress, step=step, backward_stages=backward_stages,
                      dynamic_shapes=dynamic_shapes)


def _build(scope: contextlib.ExitStack, model: torch.nn.Module, example_inputs=(), *, example_kwargs: dict | None = None, targets=None,
          train: bool = False, memory_budget: float = 1.0, progress: Progress | None = None,
          step: str | None = None, backward_stages: int | None = None, dynamic_shapes=None) -> BuildResult:
    targets = tuple(targets or knobs.targets)
    # Decisions made for the targets (a matmul template's tiles: emit/mm_configs.py) read knobs.targets:
    # the build's own targets, for its whole scope.
    scope.enter_context(override(targets=targets))
    dynamic = ()
    if dynamic_shapes:
        from .export.capture import split_example
        from .export.dynamic import requests

        pos, kw, _ = split_example(model, tuple(example_inputs), example_kwargs)
        dynamic = requests(model, dynamic_shapes, pos, kw)
    st = _Stages(progress)
    t_all = time.perf_counter()
    example_inputs = tuple(example_inputs)
    train_info = None
    dims = ()
    scales = []  # a fused step's backward kernels, launched by the runtime itself (emit/scale.py)
    if train:
        from .joint import trace_joint
        from .partition import partition, step_graphs, step_mode, train_graphs as _train_graphs

        joint = st.run("joint", trace_joint, model, example_inputs, example_kwargs=example_kwargs, dynamic=dynamic)
        dims = joint.dims
        scope.enter_context(dims_scope(dims))  # sizes are expressions of these until the build ends
        scope.enter_context(foreign_symbols(joint.symmap))
        call = {"inputs": joint.call, "outputs": joint.outputs_tree, "loss_leaf": joint.loss_leaf}
        mode, mode_why = step_mode(joint, step or knobs.train_step)
        stage_why = None
        part = st.run("partition", partition, joint, memory_budget)
        if mode == "step" and backward_stages is not None and backward_stages > 1:
            raise BuildError(f"backward_stages={backward_stages} with a fused step ({mode_why}): one program "
                             f"computes forward and backward, there is no backward to cut",
                             remedy="build with step='split' to stage the backward")
        if mode == "step":
            step_cg, train_info = st.run("stitch", step_graphs, joint, part)
            progs = [_schedule_program(st, "step", step_cg)]
            scales = _scale_kernels(progs[0], train_info)
            train_info = dataclasses.replace(train_info, scale_kernels=tuple(k.name for k in scales))
        else:
            fwd_cg, bwd_cgs, train_info, staging = st.run(
                "stage", _train_graphs, joint, part, knobs.backward_stages if backward_stages is None else backward_stages)
            stage_why = staging.why
            progs = [_schedule_program(st, "forward", fwd_cg)]
            # one backward program: it may place buffers in the saved tensors it has read for the last time
            # (a staged backward's stages share them: not donated)
            saved_by = (progs[0], 1 + len(train_info.mutated_buffers)) if knobs.donate and len(bwd_cgs) == 1 else None
            progs += [_schedule_program(st, name, cg, saved_by) for name, cg in zip(train_info.programs[1:], bwd_cgs)]
    else:
        cg = st.run("export", capture, model, example_inputs, example_kwargs=example_kwargs, dynamic=dynamic)
        call = {"inputs": cg.call, "outputs": cg.outputs_tree}
        dims = cg.dims
        scope.enter_context(dims_scope(dims))  # sizes are expressions of these until the build ends
        scope.enter_context(foreign_symbols(cg.symmap))
        progs = [_schedule_program(st, "forward", cg)]
    # each group's kernel, and its variants per sub-range of a dynamic length (emit/variants.py)
    all_kernels = [x for p in progs for k in p.kernels.values() for x in (k, *(v for _, v in k.variants))] + scales
    binaries = st.run("compile", compile_all, all_kernels, targets, knobs.compile_workers, progress)
    programs = {p.name: st.run("program" + _suffix(p.name), build_program,
                               p.graph, p.sched, p.kernels, p.plan) for p in progs}
    report = _report(progs[0])
    params = {}
    if train:
        # the joint trace's attention choices (fused or math, and why) go with the partition's record
        part_rec = {**part.report(), "attention": [dict(d) for d in joint.decisions],
                    "product_sums": [dict(d) for d in joint.product_sums],
                    "tied_embeddings": [dict(d) for d in joint.tied_embeddings],
                    "step": {"mode": mode, "why": mode_why}}
        if stage_why is not None:
            part_rec["stages"] = {"programs": list(train_info.programs[1:]), "why": stage_why}
        report = dataclasses.replace(report, backward=_report(progs[1]) if len(progs) > 1 else None,
                                     stages=tuple(_report(p) for p in progs[2:]), partition=part_rec)
        # parameters and the buffers the forward updates are program inputs: the archive holds their initial values
        params = {name: joint.weights[name] for name in joint.param_names + joint.mutated_buffers}
    manifest, parts, weights = st.run("archive", _pack, progs, all_kernels, programs, binaries, report, targets,
                                      train_info, params, call)
    data = write_archive(manifest.to_dict(), parts, weights)
    st.timings["total"] = round(time.perf_counter() - t_all, 4)
    return BuildResult(data, report, dict(st.timings), len(binaries), manifest)


def _report_size(v):
    """A size left as a dims expression in a report record (a group's extent, a split's r): the report's
    figures are at the build's example (explain says so); the program holds the expressions."""
    import sympy

    from .ir.sizes import hint

    if isinstance(v, sympy.Basic):
        return hint(v)
    raise TypeError(f"cannot serialize {type(v).__name__}")


def _report(p: _Compiled) -> Report:
    sched, plan, kernels = p.sched, p.plan, p.kernels
    refused = [d for d in sched.decisions if not d.fused]
    refusals = collections.Counter(d.refusal.value for d in refused)  # by kind, in first-seen order
    launches = collections.Counter(k.name for k in kernels.values())
    return Report(
        fusion_summary=FusionSummary(
            loop_ir_nodes=p.n_lowered, inlined=len(p.inlined), groups=len(sched.groups),
            kernel_launches=len(kernels), unique_kernels=len(launches),
            externs=sum(1 for g in sched.groups if g.kind == "extern"),
            fused_pairs=sum(1 for d in sched.decisions if d.fused), refused_pairs=len(refused),
            refusals=dict(refusals)),
        # each fusion, and each distinct refused pair once: reason = FuseRefusal value (None if fused)
        fusion=tuple(d.to_report() for d in sched.decisions),
        inline=tuple(InlineRecord(d.producer, d.consumer, d.reason) for d in p.inlined),
        splits=tuple(d.to_report() for d in p.splits),
        lowering=tuple(p.lctx.decisions),
        groups=tuple(GroupRecord(g.name, g.kind, tuple(g.nodes), g.xnumel, g.rnumel,
                                 kernels[g.name].name if g.name in kernels else None,
                                 _blocks(kernels[g.name]) if g.name in kernels else None) for g in sched.groups),
        memory=MemorySummary(hint(plan.arena_bytes), plan.naive_bytes, len(plan.allocations), len(plan.bound),
                             plan.peak_live_bytes, plan.how, plan.donated_bytes, plan.donation),
    )


def _blocks(k) -> dict:
    """A kernel's launch shape and why (emit/space.block_choice), for explain."""
    return {"kind": k.kind, "pattern": k.pattern, "xblock": k.xblock, "rblock": k.rblock,
            "num_warps": k.num_warps, "grid": list(k.grid), "why": k.why}


def _kernel_entries(kernels, binaries) -> dict[str, KernelEntry]:
    """One entry per distinct kernel, in first-launch order across the programs (then the kernels the
    runtime launches itself: the fused step's scaling)."""
    launched: dict[str, list] = {}
    for k in kernels:
        launched.setdefault(k.name, []).append(k)
    out = {}
    for name, ks in launched.items():
        k = ks[0]
        # Identical sources may be launched on buffers of different sizes (e.g. a prefix read):
        # record the smallest, which every launch satisfies and which covers what the kernel touches.
        args = tuple(KernelArg(a.name, a.dtype, a.role, min((x.args[i].numel for x in ks), key=_at_example))
                     for i, a in enumerate(k.args))
        bins = {arch: Binary(b.cubin, b.name, b.num_warps, b.shared, b.global_scratch, b.profile_scratch,
                             b.grid, b.persistent, b.pdl)
                for arch, b in binaries[name].items()}
        out[name] = KernelEntry(k.kind, tuple(k.nodes), tuple(k.grid), k.num_warps, k.xblock, k.rblock, k.xnumel,
                                k.rnumel, args, bins, launches=len(ks), size_args=tuple(k.sizes),
                                persistent=k.persistent)
    return out


def _at_example(n) -> int:
    """A recorded size (an int, or a dims expression's text) at the build's example."""
    if isinstance(n, int):
        return n
    from .contract.sizes import evaluate
    from .ir.sizes import current_dims

    return evaluate(n, {d.name: v.hint for d, v in current_dims().items()})


def _pack(progs, all_kernels, programs, binaries, report: Report, targets, train_info, params: dict,
          call: dict | None = None):
    kernels = _kernel_entries(all_kernels, binaries)
    sources = {k.name: k.source for k in all_kernels}
    weights = {}
    for p in progs:
        for buf, fqn in p.graph.weights:
            w = p.lctx.constants[buf] if fqn.startswith("__const__.") else p.cg.weights[fqn]
            perm = p.lctx.weight_perms.get(buf)
            weights[fqn] = w if perm is None else w.permute(perm).contiguous()  # stored in its channels-last order
    weights.update(params)
    fwd = progs[0]
    bufs = fwd.graph.buffer_map
    inputs = tuple(s.to_contract() for s in fwd.cg.inputs)
    outputs = tuple(OutputSpec(tuple(spelled(d) for d in o.view.shape),
                               str(TORCH[bufs[o.view.buf].dtype])) for o in fwd.graph.outputs)
    single = fwd.cg.single_output
    if fwd.cg.dims:
        from .contract.manifest import DimSpec
    if train_info:
        # the loss; the rest are saved for the backward
        inputs, outputs, single = train_info.user_inputs, outputs[:1], True
    manifest = Manifest(format="aotfuse", aotfuse_version=__version__,
                        torch_version=torch.__version__.split("+")[0], targets=tuple(targets),
                        programs=tuple(p.name for p in progs), inputs=inputs, outputs=outputs, single_output=single,
                        kernels=tuple(sorted(kernels)), train=train_info, call=call,
                        **({"dims": tuple(DimSpec(sym=d.sym.name, name=d.name, lo=d.lo, hi=d.hi, hint=d.hint)
                                          for d in fwd.cg.dims)} if fwd.cg.dims else {}))
    pack = lambda v: msgpack.packb(v, use_bin_type=True, default=_report_size)  # noqa: E731
    parts = {"kernels": pack(kernels_to_dict(kernels)), "sources": pack(sources), "report": pack(report.to_dict())}
    # a binary with its own tiles, or compiled with the PDL wait: an older reader must refuse
    # (a source with the PDL parameter, even without an sm_90 binary: an older source check refuses it)
    pdl = has_pdl(kernels) or any(uses_grid_dependency(src) for src in sources.values())
    least = PDL_VERSION if pdl else TILES_VERSION if has_target_tiles(kernels) else 0
    for name, prog in programs.items():
        if prog.version < least:
            prog = dataclasses.replace(prog, version=least)
        parts[f"program.{name}"] = pack(prog.to_dict())  # no timings in the archive: reproducible bytes
    return manifest, parts, weights
