"""`aotfuse explain`: every decision the build recorded, as text (the archive's report part).

Reads only the archive: lowering choices (externs kept or split, copies realized, constants
folded), inlining, every fusion with what it saves and every distinct refused pair with its reason
(a kind and a detail; `--refused` groups them by kind), each reduction's split decision
(schedule/split.py), the kernels each group became with their blocks and why, the memory
plan, and for training builds every saved tensor and recomputed node.
"""
from __future__ import annotations

from ..archive import read_archive
from ..contract._codec import decoding
from ..contract.report import FusionRecord, Report
from .payload import read_report


def _lowering(d: dict) -> str | None:
    if "mm_gelu" in d:  # export/mm_gelu.py
        what = "fused into the matmul, one _addmm_activation extern" if d["fused"] else "not fused"
        approx = "erf" if d["approximate"] == "none" else d["approximate"]
        return f"  {d['producer']} -> {d['mm_gelu']}: {approx} GELU {what} ({d['why']})"
    if "gelu_formula" in d:  # export/gelu_formula.py
        return f"  {d['gelu_formula']}: {'a tanh GELU formula made one gelu' if d['fused'] else 'kept'} ({d['why']})"
    if "mm_residual" in d:  # lower/residual.py
        what = "fused into the matmul, one mm_residual extern" if d["fused"] else "not fused"
        return f"  {d['producer']} -> {d['mm_residual']}: residual add {what} ({d['why']})"
    if "conv_layout" in d:  # lower/conv_layout.py
        return f"  {d['conv_layout']}: {d['why']}"
    if "narrow_sort" in d:  # lower/extern.py
        return f"  {d['narrow_sort']}: {d['why']}"
    if "grouped_mm" in d:  # lower/experts.py
        return f"  {d['grouped_mm']}: grouped matmul {d['form']} over {d['groups']} groups ({d['why']})"
    if "conv_bias" in d:  # lower/extern.py
        return f"  {d['conv_bias']}: convolution + bias add ({d['why']})"
    if "addmm" in d:
        return f"  {d['addmm']}: {'kept as addmm' if d['kept'] else 'mm + bias add'} ({d['why']})"
    if "realize" in d:
        order = d.get("order")
        order = f"; {order}" if order and order != "as is" else ""
        reused = "; reused: the same view was copied for an earlier consumer" if d.get("reused") else ""
        return f"  {d['realize']}: copy of a view of {d['of']} ({d['why']}{order}{reused})"
    if "matmul" in d and "pad" in d:  # lower/extern.py (AOTFUSE_MM_PAD)
        return f"  {d['matmul']}: {d['pad']}"
    if "attention_mask" in d:  # export/masks.py
        return f"  {d['attention_mask']}: attention mask {'kept' if d['kept'] else 'removed'} ({d['why']})"
    if "attention_broadcast" in d:  # lower/extern.py (aotfuse/sdpa_shapes.py)
        return f"  {d['attention_broadcast']}: {d['why']}"
    if "attention" in d and "mode" in d:  # schedule/attention.py: the template or sdpa
        mask = f" mask {d['mask']}" if d.get("mask") else ""
        made = "; its bool mask made additive (0 / -inf) by a kernel of the program" if d.get("mask_made_additive") \
            else ""
        return (f"  {d['attention']}: attention {d.get('shape')}{' causal' if d.get('causal') else ''}{mask} -> "
                f"{d['kernel']} ({d['why']}{made})")
    if "attention" in d:
        return f"  {d['attention']}: attention kept whole ({d.get('kernel', 'fused')}: {d.get('why', '')})"
    if "embedding_backward" in d:  # lower/embedding.py
        return f"  {d['embedding_backward']}: embedding weight gradient -> {d['kernel']} ({d['why']})"
    if "reorder" in d:  # schedule/reorder.py
        return (f"  {d['reorder']}: reduced index walked in {d['buffer']}'s storage order (digits {d['digits']}, "
                f"strides {d['strides']}, fastest first {d['order']})")
    if "onehot" in d:  # schedule/trivial.py
        return f"  {d['onehot']}: a one-hot sum over {d['n']} (where(r == t, v, 0)) is v at r = t: one indirect load"
    if "duplicate" in d:  # schedule/trivial.py
        return f"  {d['duplicate']}: the same reduction as {d['of']} (body, loops, type): reads its result"
    if "uniform" in d:  # schedule/trivial.py
        how = f"{d['n']} x the value" if d["rtype"] == "sum" else "the value"
        return f"  {d['uniform']}: a {d['rtype']} over {d['n']} equal values (reads no reduced index) is {how}"
    if "folded" in d:
        return f"  {d['folded']}: folded at build time into constant {d['into']}"
    if "unread" in d:  # lower/graph.py
        return f"  {d['unread']}: not computed (nothing reads its value: its reader takes only its shape)"
    if "matmul" in d:  # template or cuBLAS (schedule/templates.py)
        sh, c = d.get("shape", {}), d.get("config")
        shape = "x".join(str(sh.get(k)) for k in "BMNK")
        tiles = (f"; tiles {c['block_m']}x{c['block_n']}x{c['block_k']}, {c['num_warps']} warps, "
                 f"{c['num_stages']} stages ({d.get('config_why')})") if c and d.get("choice") == "template" else ""
        return f"  {d['matmul']}: {d.get('op')} {shape} {d.get('dtype')} -> {d.get('choice')} ({d.get('why')}){tiles}"
    return None


def _program_lines(name: str, rep: Report, refused_only: bool, res: tuple | None = None) -> list[str]:
    out = [f"== {name} program =="]
    s = rep.fusion_summary
    out.append(f"{s.loop_ir_nodes} loop-IR nodes, {s.inlined} inlined, {s.groups} groups "
               f"-> {s.kernel_launches} kernel launches ({s.unique_kernels} unique) + {s.externs} externs")
    out.append("-- lowering")
    out += [line for line in map(_lowering, rep.lowering) if line is not None]
    out.append("-- inlining")
    out += [f"  {d.producer} -> {d.consumer}: {d.reason}" for d in rep.inline]
    if rep.splits:
        n_split = sum(1 for d in rep.splits if d["split"])
        out.append(f"-- reductions ({n_split} of {len(rep.splits)} split in two stages; schedule/split.py)")
        for d in rep.splits:
            what = f"{d['node']} ({d['rtype']}, {d['pattern']}, {d['x']} outputs x {d['r']})"
            if d["split"]:
                out.append(f"  SPLIT   {what}: {d['chunks']} chunks of {d['chunk']} ({d['how']}) into "
                           f"{d['partial']}: {d['reason']}")
            else:
                out.append(f"  kept    {what}: {d['reason']}")
    by_kind: dict[str, list[FusionRecord]] = {}
    for d in rep.fusion:
        if not d.fused:
            by_kind.setdefault(d.reason, []).append(d)
    if refused_only:
        out.append("-- fusion refusals by reason (score = bytes of traffic fusion would have saved)")
        for kind, ds in by_kind.items():
            out.append(f"  {kind} ({len(ds)}):")
            out += [f"    {d.kind:10s} {d.a} + {d.b} (score {d.score})" + (f": {d.detail}" if d.detail else "")
                    for d in ds]
    else:
        out.append("-- fusion (best-first; score = bytes of traffic saved)")
        for d in rep.fusion:
            verdict = "FUSED  " if d.fused else "refused"
            out.append(f"  {verdict} {d.kind:10s} {d.a} + {d.b} (score {d.score}): {d.text}")
        if by_kind:
            out.append("  refused by reason: " + ", ".join(f"{k} {len(ds)}" for k, ds in by_kind.items()))
    out.append("-- groups -> kernels")
    for g in rep.groups:
        space = f"{g.xnumel}x{g.rnumel}" if g.kind != "extern" else ""
        out.append(f"  {g.name:5s} {g.kind:10s} {space:12s} {g.kernel or 'extern'}: {', '.join(g.nodes)}")
        if g.blocks:
            b = g.blocks
            out.append(f"        {b['kind']} XBLOCK={b['xblock']} RBLOCK={b['rblock']} num_warps={b['num_warps']} "
                       f"grid={b['grid'][0]}: {b['why']}")
        if res is not None and isinstance(res[1], dict) and g.kernel in res[1]:
            out.append(f"        {res[1][g.kernel].line(res[0])}")
    m = rep.memory
    out.append(f"-- memory: arena {m.arena_bytes} B for {m.buffers} buffers (no reuse: {m.naive_bytes} B); "
               f"{m.bound_extern_results} extern results bound as returned")
    if m.plan:
        out.append(f"   offsets by {m.plan}; at most {m.peak_live_bytes} B live at once (no arena "
                   f"{'without hosts ' if m.donated_bytes else ''}is smaller)")
    if m.donation:
        out.append(f"   buffers in idle inputs or outputs (schedule/hosts.py): {m.donation}"
                   + (f" ({m.donated_bytes} B of buffers)" if m.donated_bytes else ""))
    return out


def _step_mode(part: dict | None) -> str:
    step = (part or {}).get("step")
    return step.get("mode", "split") if isinstance(step, dict) else "split"


def _partition_lines(part: dict) -> list[str]:
    step = part.get("step")
    if _step_mode(part) == "step":
        out = ["== partition (min-cut) ==", f"one program (fused step): {step.get('why')}",
               f"kept from the forward half for the backward half {part['saved_bytes']} B (live inside the step "
               f"program, planned in its arena); budget {part.get('memory_budget')}"]
    else:
        out = ["== partition (min-cut) ==",
               f"saved {part['saved_bytes']} B for the backward; budget {part.get('memory_budget')}"]
        if isinstance(step, dict):
            out.append(f"two programs: {step.get('why')}")
        stages = part.get("stages")
        if isinstance(stages, dict):
            out.append(f"backward programs {', '.join(map(str, stages.get('programs', [])))}: {stages.get('why')}")
    for s in part["saved"]:
        packed = " (bit-packed)" if s.get("packed") else ""
        out.append(f"  saved {s['name']}: {s['nbytes']} B from {s['producer_op']}{packed}: {s['why']}")
    for u in part.get("buffer_updates", []):
        out.append(f"  buffer update {u.get('buffer')}: {u.get('node')} ({u.get('note')})")
    for a in part.get("attention", []):
        out.append(f"  attention {a.get('attention')} {a.get('query')}: {a.get('kernel')} ({a.get('why')})")
    for a in part.get("product_sums", []):
        out.append(f"  sum of {a.get('terms')} matmul products {a.get('product_sum')} {a.get('shape')}: "
                   f"{'one matmul' if a.get('merged') else 'kept as a chain'} ({a.get('why')})")
    for a in part.get("tied_embeddings", []):
        out.append(f"  tied embedding gradient {a.get('tied_embedding')} ({a.get('embedding_backward')}): "
                   f"{'one buffer with its matmul' if a.get('fused') else 'kept as an add'} ({a.get('why')})")
    rec = part.get("recomputed", [])
    names = [f"{r['name']} ({r['op']})" for r in rec]
    out.append(f"  recomputed in the backward ({len(rec)}): {', '.join(names)}")
    return out


def explain_report(report: Report, *, program: str | None = None, refused_only: bool = False,
                   resources: tuple | None = None) -> str:
    """resources: (arch, {kernel: runtime.resources.Resources} or why there are none) to show per kernel."""
    sections = []
    if resources is not None and isinstance(resources[1], str):
        sections.append([f"-- resources: {resources[1]}"])
    first = "step" if _step_mode(report.partition) == "step" else "forward"
    if program in (None, first):
        sections.append(_program_lines(first, report, refused_only, resources))
    if program in (None, "backward") and report.backward is not None:
        sections.append(_program_lines("backward", report.backward, refused_only, resources))
    for k, rep in enumerate(report.stages, start=1):  # a staged backward's later programs
        if program in (None, f"backward_{k}"):
            sections.append(_program_lines(f"backward_{k}", rep, refused_only, resources))
    if report.partition is not None and program is None:
        with decoding("part 'report': partition"):  # a free-form section: a slip in it is an ArchiveError
            sections.append(_partition_lines(report.partition))
    return "\n\n".join("\n".join(lines) for lines in sections)


def explain(src, *, program: str | None = None, refused_only: bool = False, resources: str | None = None) -> str:
    """resources: a target ("sm_90") whose cubins to read registers, spills and shared memory off
    (runtime/resources.py), shown under each kernel; "auto": the archive's newest target."""
    with read_archive(src) as ar:
        report = read_report(ar)
        res = None
        if resources is not None:
            from .payload import read_payload
            from .resources import kernel_resources

            kernels = read_payload(ar).kernels
            targets = sorted({t for k in kernels.values() for t in k.binaries}, key=lambda t: int(t[3:]))
            arch = targets[-1] if resources == "auto" and targets else resources
            if arch not in targets:
                from ..errors import AotfuseError

                raise AotfuseError(f"the archive has no cubins for {arch!r}",
                                   remedy=f"pass one of: {', '.join(targets) or '(none)'}")
            res = (arch, kernel_resources(kernels, arch))
    return explain_report(report, program=program, refused_only=refused_only, resources=res)
