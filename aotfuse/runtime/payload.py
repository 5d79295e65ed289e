"""An archive's payload as the runtime reads it: msgpack parts decoded, checked, then typed.

Order matters: a program's version is checked first (a newer archive is refused as such, with
"upgrade aotfuse", whatever else changed in it), then everything `runtime/validate.py` checks, and
only then are the dicts turned into the `aotfuse.contract` dataclasses the runtime reads. An archive
with dynamic dims is typed first (each size expression parsed) and then validated specialized at
its range ends (runtime/validate_dims.py).
"""
from __future__ import annotations

import dataclasses

import msgpack

from ..archive import Archive
from ..contract import Manifest, Program, Report, check_program_version, kernels_from_dict
from ..errors import ArchiveError
from .validate import validate_archive, validate_manifest
from .validate_kernels import validate_sources

_UNPACK = dict(raw=False, strict_map_key=False)


def unpack(blob: bytes, what: str):
    try:
        return msgpack.unpackb(blob, **_UNPACK)
    except Exception as exc:  # msgpack raises several types for bad data
        raise ArchiveError(f"part {what!r} is not valid msgpack: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Payload:
    manifest: Manifest
    kernels: dict  # name -> contract.KernelEntry
    programs: dict  # name -> contract.Program, in manifest order


def read_payload(archive: Archive) -> Payload:
    """The manifest, kernels and programs of `archive`, validated (ArchiveError on any flaw)."""
    m = archive.manifest
    validate_manifest(m)  # before any field of it is read
    progs = {name: unpack(archive.part(f"program.{name}"), f"program.{name}") for name in m["programs"]}
    for name, p in progs.items():
        check_program_version(p.get("version") if type(p) is dict else None, f"program {name!r}")
    kernels = unpack(archive.part("kernels"), "kernels")
    if "dims" in m:
        from .validate_dims import read_dynamic

        return Payload(*read_dynamic(m, kernels, progs, archive.weights))
    # Every program is checked against the kernels and weights before a launcher is made or a byte runs.
    validate_archive(m, kernels, progs, archive.weights)
    return Payload(Manifest.from_dict(m), kernels_from_dict(kernels),
                   {name: Program.from_dict(p, name) for name, p in progs.items()})


def read_sources(archive: Archive, kernels: dict) -> dict[str, str]:
    """The CPU path's Triton source of each kernel (their content is checked by interpret.py)."""
    sources = unpack(archive.part("sources"), "sources")
    validate_sources(sources, kernels)
    return sources


def read_report(archive: Archive) -> Report:
    """The build's decisions (informational: typed, but nothing that runs reads it)."""
    return Report.from_dict(unpack(archive.part("report"), "report"))
