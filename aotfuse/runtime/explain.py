"""`aotfuse explain`: every decision the build recorded, as text (the archive's report part).

Reads only the archive: lowering choices (externs kept or split, copies realized, constants
folded), inlining, every fusion with what it saves and every distinct refused pair with its reason
(a kind and a detail; `--refused` groups them by kind), the kernels each group became, the memory
plan, and for training builds every saved tensor and recomputed node.
"""
from __future__ import annotations

import msgpack

from ..archive import read_archive


def refusal_kind(d: dict) -> str:
    """A refused fusion record's kind (a FuseRefusal value). Reports written before kinds were
    separate hold one 'kind: detail' string."""
    return d["reason"] if "detail" in d else d["reason"].split(":")[0]


def fusion_reason(d: dict) -> str:
    """'kind: detail' for a refusal, the detail ('saves N bytes') for a fusion."""
    if "detail" not in d:
        return d["reason"]
    if d["fused"] or not d.get("reason"):
        return d["detail"]
    return f"{d['reason']}: {d['detail']}" if d["detail"] else d["reason"]


def _detail(d: dict) -> str:
    if "detail" not in d:
        rest = d["reason"].partition(":")[2].strip()
        return f": {rest}" if rest else ""
    return f": {d['detail']}" if d["detail"] else ""


def _program_lines(name: str, rep: dict, refused_only: bool) -> list[str]:
    out = [f"== {name} program =="]
    s = rep.get("fusion_summary", {})
    out.append(f"{s.get('loop_ir_nodes')} loop-IR nodes, {s.get('inlined')} inlined, {s.get('groups')} groups "
               f"-> {s.get('kernel_launches')} kernel launches ({s.get('unique_kernels')} unique) + "
               f"{s.get('externs')} externs")
    out.append("-- lowering")
    for d in rep.get("lowering", []):
        if "addmm" in d:
            out.append(f"  {d['addmm']}: {'kept as addmm' if d['kept'] else 'mm + bias add'} ({d['why']})")
        elif "realize" in d:
            out.append(f"  {d['realize']}: copy of a view of {d['of']} ({d['why']})")
        elif "folded" in d:
            out.append(f"  {d['folded']}: folded at build time into constant {d['into']}")
        elif "matmul" in d:  # template or cuBLAS (schedule/templates.py)
            sh, c = d.get("shape", {}), d.get("config")
            shape = "x".join(str(sh.get(k)) for k in "BMNK")
            tiles = (f"; tiles {c['block_m']}x{c['block_n']}x{c['block_k']}, {c['num_warps']} warps, "
                     f"{c['num_stages']} stages ({d.get('config_why')})") if c and d.get("choice") == "template" else ""
            out.append(f"  {d['matmul']}: {d.get('op')} {shape} {d.get('dtype')} -> {d.get('choice')} ({d.get('why')}){tiles}")
    out.append("-- inlining")
    for d in rep.get("inline", []):
        out.append(f"  {d['producer']} -> {d['consumer']}: {d['reason']}")
    fusion = rep.get("fusion", [])
    by_kind: dict[str, list[dict]] = {}
    for d in fusion:
        if not d["fused"]:
            by_kind.setdefault(refusal_kind(d), []).append(d)
    if refused_only:
        out.append("-- fusion refusals by reason (score = bytes of traffic fusion would have saved)")
        for kind, ds in by_kind.items():
            out.append(f"  {kind} ({len(ds)}):")
            out += [f"    {d['kind']:10s} {d['a']} + {d['b']} (score {d['score']}){_detail(d)}" for d in ds]
    else:
        out.append("-- fusion (best-first; score = bytes of traffic saved)")
        for d in fusion:
            verdict = "FUSED  " if d["fused"] else "refused"
            out.append(f"  {verdict} {d['kind']:10s} {d['a']} + {d['b']} (score {d['score']}): {fusion_reason(d)}")
        if by_kind:
            out.append("  refused by reason: " + ", ".join(f"{k} {len(ds)}" for k, ds in by_kind.items()))
    out.append("-- groups -> kernels")
    for g in rep.get("groups", []):
        what = g["kernel"] or "extern"
        space = f"{g['xnumel']}x{g['rnumel']}" if g["kind"] != "extern" else ""
        out.append(f"  {g['name']:5s} {g['kind']:10s} {space:12s} {what}: {', '.join(g['nodes'])}")
    m = rep.get("memory", {})
    out.append(f"-- memory: arena {m.get('arena_bytes')} B for {m.get('buffers')} buffers "
               f"(no reuse: {m.get('naive_bytes')} B); {m.get('bound_extern_results')} extern results bound as returned")
    return out


def explain(src, *, program: str | None = None, refused_only: bool = False) -> str:
    with read_archive(src) as ar:
        report = msgpack.unpackb(ar.part("report"), raw=False, strict_map_key=False)
    lines = []
    if program in (None, "forward"):
        lines += _program_lines("forward", report, refused_only)
    if program in (None, "backward") and "backward" in report:
        lines += [""] + _program_lines("backward", report["backward"], refused_only)
    part = report.get("partition")
    if part and program is None:
        lines += ["", "== partition (min-cut) =="]
        lines.append(f"saved {part['saved_bytes']} B for the backward; budget {part.get('memory_budget', part.get('budget'))}")
        for s in part["saved"]:
            packed = " (bit-packed)" if s.get("packed") else ""
            lines.append(f"  saved {s['name']}: {s['nbytes']} B from {s['producer_op']}{packed}: {s['why']}")
        rec = part.get("recomputed", [])
        names = [f"{r['name']} ({r['op']})" if isinstance(r, dict) else str(r) for r in rec]
        lines.append(f"  recomputed in the backward ({len(rec)}): {', '.join(names)}")
    return "\n".join(lines)
