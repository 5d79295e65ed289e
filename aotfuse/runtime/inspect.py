"""What an archive holds, as one JSON-able dict (`aotfuse inspect --json`)."""
from __future__ import annotations

import msgpack

from ..archive import Archive, read_archive


def describe(archive: Archive) -> dict:
    m = archive.manifest
    kernels = msgpack.unpackb(archive.part("kernels"), raw=False, strict_map_key=False)
    report = msgpack.unpackb(archive.part("report"), raw=False, strict_map_key=False)
    programs = {}
    for name in m["programs"]:
        p = msgpack.unpackb(archive.part(f"program.{name}"), raw=False, strict_map_key=False)
        ops = {}
        for ins in p["instructions"]:
            ops[ins["op"]] = ops.get(ins["op"], 0) + 1
        programs[name] = {"instructions": len(p["instructions"]), "by_op": ops, "arena_bytes": p["arena_bytes"]}
    out = {
        "format_version": archive.format_version,
        "size_bytes": archive.size,
        "sha256": archive.sha256(),  # of the whole file: pin it with aotfuse.load(path, sha256=...)
        "aotfuse_version": m.get("aotfuse_version"),
        "targets": list(m["targets"]),
        "inputs": m["inputs"],
        "outputs": m["outputs"],
        "programs": programs,
        "kernels": [{"name": n, "kind": k["kind"], "nodes": k["nodes"], "grid": k["grid"],
                     "num_warps": k["num_warps"], "targets": sorted(k["binaries"]),
                     "launches": k.get("launches", 1)} for n, k in kernels.items()],
        "weights_bytes": archive.weights_bytes,
        "weights": len(archive.weights),
        "fusion": report.get("fusion_summary", {}),
        "memory": report.get("memory", {}),
        "timings": report.get("timings", {}),
    }
    if "backward" in report:
        out["fusion_backward"] = report["backward"].get("fusion_summary", {})
        out["memory_backward"] = report["backward"].get("memory", {})
    if "partition" in report:
        out["partition"] = report["partition"]
    return out


def inspect_archive(src) -> dict:
    with read_archive(src) as ar:
        return describe(ar)
