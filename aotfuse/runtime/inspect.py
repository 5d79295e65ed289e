"""What an archive holds, as one JSON-able dict (`aotfuse inspect --json`)."""
from __future__ import annotations

import collections

from ..archive import Archive, read_archive
from .payload import read_payload, read_report


def describe(archive: Archive) -> dict:
    """The archive's contents, after the same checks `aotfuse.load` makes (a malformed archive is an
    ArchiveError here too, never a KeyError); the report part is informational, read typed."""
    payload = read_payload(archive)
    m = payload.manifest
    report = read_report(archive)
    programs = {}
    for name, p in payload.programs.items():
        ops = collections.Counter(ins.op for ins in p.instructions)
        programs[name] = {"version": p.version, "instructions": len(p.instructions), "by_op": dict(ops),
                          "arena_bytes": p.arena_bytes}
    out = {
        "format_version": archive.format_version,
        "size_bytes": archive.size,
        "sha256": archive.sha256(),  # of the whole file: pin it with aotfuse.load(path, sha256=...)
        "aotfuse_version": m.aotfuse_version,
        "torch_version": m.torch_version,
        "targets": list(m.targets),
        "inputs": [s.to_dict() for s in m.inputs],  # a dynamic axis is its dim symbol ("s0")
        "outputs": [s.to_dict() for s in m.outputs],  # sizes: ints or expressions over the dims
        "programs": programs,
        "kernels": [{"name": n, "kind": k.kind, "nodes": list(k.nodes), "grid": list(k.grid),
                     "num_warps": k.num_warps, "targets": sorted(k.binaries), "launches": k.launches}
                    for n, k in payload.kernels.items()],
        "weights_bytes": archive.weights_bytes,
        "weights": len(archive.weights),
        "fusion": report.fusion_summary.to_dict(),
        "memory": report.memory.to_dict(),
    }
    if m.dims:  # dynamic dims: symbol, label, inclusive range, the example's size
        out["dims"] = [d.to_dict() for d in m.dims]
    if report.backward is not None:
        out["fusion_backward"] = report.backward.fusion_summary.to_dict()
        out["memory_backward"] = report.backward.memory.to_dict()
    if report.partition is not None:
        out["partition"] = report.partition
    if m.train is not None:
        out["train"] = {"params": list(m.train.params), "mode": m.train.mode, "n_saved": m.train.n_saved,
                        "saved_bytes": m.train.saved_bytes,
                        # buffers the forward updates (train-mode BatchNorm); the runtime writes them back
                        "mutated_buffers": list(m.train.mutated_buffers),
                        # a staged backward: per stage, how many gradients it hands to autograd
                        "stages": [len(st) for st in m.train.stages]}
    return out


def inspect_archive(src) -> dict:
    with read_archive(src) as ar:
        return describe(ar)
