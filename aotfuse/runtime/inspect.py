"""What an archive holds, as one JSON-able dict (`aotfuse inspect --json`)."""
from __future__ import annotations

from ..archive import Archive, read_archive
from ..errors import ArchiveError
from .artifact import _unpack
from .validate import validate_archive, validate_manifest


def describe(archive: Archive) -> dict:
    """The archive's contents, after the same checks `aotfuse.load` makes (a malformed archive is an
    ArchiveError here too, never a KeyError); the report part is informational and only type-checked."""
    m = archive.manifest
    validate_manifest(m)
    kernels = _unpack(archive.part("kernels"), "kernels")
    progs = {name: _unpack(archive.part(f"program.{name}"), name) for name in m["programs"]}
    validate_archive(m, kernels, progs, archive.weights)
    report = _report(_unpack(archive.part("report"), "report"))
    programs = {}
    for name, p in progs.items():
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


def _report(report) -> dict:
    """The sections `describe` shows, each a dict (an archive's report is not load-bearing)."""
    if not isinstance(report, dict):
        raise ArchiveError("part 'report' is not a map")
    for key in ("fusion_summary", "memory", "timings", "backward", "partition"):
        if key in report and not isinstance(report[key], dict):
            raise ArchiveError(f"part 'report': {key!r} is not a map")
    for key in ("fusion_summary", "memory"):
        if key in report.get("backward", {}) and not isinstance(report["backward"][key], dict):
            raise ArchiveError(f"part 'report': backward.{key} is not a map")
    return report


def inspect_archive(src) -> dict:
    with read_archive(src) as ar:
        return describe(ar)
