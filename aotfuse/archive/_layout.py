"""Byte layout of a .aotf file: header, table-of-contents schema, limits. Pure: no file I/O.

Everything a reader learns from a file passes through here and is validated before use, so that
format.py can slice the buffer without re-checking. artifacts/FORMAT.md is the prose spec.
"""
from __future__ import annotations

import dataclasses
import struct
import zlib
from typing import Any

import msgpack
import torch

from aotfuse.dtypes import STORAGE
from aotfuse.errors import ArchiveError

FORMAT_VERSION = 1
MIN_SUPPORTED_VERSION = 1

# "AOTF" names the file in a hex dump; "\r\n" dies under CRLF->LF conversion, the lone "\n" under
# LF->CRLF; "\x00" makes git/diff treat the file as binary (so autocrlf never touches it) and dies
# when a tool strips NULs.
MAGIC = b"AOTF\r\n\x00\n"

# magic, version, header_size, toc_length, file_size, toc_crc32, flags, reserved, header_crc32.
# magic and version stay at offsets 0 and 8 in every future version: they are read before anything
# else so a newer file is refused by version rather than reported as corrupt.
_HEADER = struct.Struct("<8sIIQQII20sI")
HEADER_SIZE = _HEADER.size  # 64
assert HEADER_SIZE == 64
ALIGN = 64  # every data item starts on a 64-byte boundary of the file (cache line / vector loads)
CODEC_ZSTD = "zstd"
ZSTD_LEVEL = 10  # fixed: part bytes must not depend on the caller's environment

# Limits a reader enforces before allocating; the writer enforces the same ones so it can never
# produce a file this reader refuses.
MAX_TOC_BYTES = 64 << 20
MAX_PART_RAW_BYTES = 1 << 30
MAX_NDIM = 64
MAX_ELEMENTS = 1 << 62  # keeps every shape's element count and strides inside int64
MAX_MANIFEST_DEPTH = 64  # msgpack's C unpacker refuses nesting past ~1024; stay far below it
_IMPLAUSIBLE_VERSION = 1 << 16  # a version field this large is damage, not a future release

# Allow-list: the only dtypes a file may name. Keyed by the name torch prints, minus "torch.".
DTYPES: dict[str, torch.dtype] = STORAGE

# First bytes of files people hand us by mistake, to say what they handed us.
_FOREIGN = (
    (b"PK\x03\x04", "a zip file (torch.save checkpoints are zip files)"),
    (b"\x89PNG", "a PNG image"),
    (b"\x1f\x8b", "a gzip file"),
    (b"\x28\xb5\x2f\xfd", "a bare zstd stream"),
    (b"\x7fELF", "an ELF binary"),
    (b"\x80", "a pickle"),
)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclasses.dataclass(frozen=True)
class Header:
    version: int
    toc_length: int
    file_size: int
    toc_crc32: int

    @property
    def toc_end(self) -> int:
        return HEADER_SIZE + self.toc_length


@dataclasses.dataclass(frozen=True)
class PartEntry:
    name: str
    offset: int  # absolute file offset of the stored (compressed) bytes
    stored_len: int
    raw_len: int
    codec: str
    crc32: int  # over the stored bytes: checkable without decompressing


@dataclasses.dataclass(frozen=True)
class WeightEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, multiple of ALIGN
    nbytes: int
    crc32: int


@dataclasses.dataclass(frozen=True)
class Toc:
    manifest: dict
    parts: tuple[PartEntry, ...]
    weights: tuple[WeightEntry, ...]


# ---------------------------------------------------------------- header

def pack_header(toc: bytes, file_size: int) -> bytes:
    body = _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, len(toc), file_size,
                        zlib.crc32(toc), 0, bytes(20), 0)[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def _bad_magic(head: bytes) -> ArchiveError:
    if head.startswith(b"AOTF\n\x00\n"):
        why = "its CRLF bytes were turned into LF: it was copied in text mode"
    elif head.startswith((b"AOTF\r\r\n", b"AOTF\r\n\x00\r\n")):
        why = "its LF bytes were turned into CRLF: it was copied in text mode"
    elif head.startswith(b"AOTF"):
        why = "magic is damaged"
    else:
        what = next((w for sig, w in _FOREIGN if head.startswith(sig)), None)
        if what is None and len(head) >= 9 and head[8:9] == b"{":
            what = "a safetensors file"
        hint = f"; looks like {what}" if what else ""
        return ArchiveError(f"not an aotfuse archive (bad magic {head[:8]!r}{hint}): expected a .aotf file")
    return ArchiveError(f"corrupted aotfuse archive (magic {head[:8]!r}: {why})",
                        remedy="copy the file in binary mode, or rebuild it")


def parse_header(head: bytes, size: int) -> Header:
    """Validate the first 64 bytes. `size` is the real length of the source."""
    if size == 0:
        raise ArchiveError("not an aotfuse archive (file is empty): expected a .aotf file")
    if size < HEADER_SIZE:
        if MAGIC.startswith(head[:8]) or head.startswith(MAGIC):
            raise ArchiveError(f"archive truncated: file is {size} bytes, shorter than the "
                               f"{HEADER_SIZE}-byte header")
        raise _bad_magic(head)
    magic, version, header_size, toc_length, file_size, toc_crc, flags, reserved, crc = \
        _HEADER.unpack(head[:HEADER_SIZE])
    if magic != MAGIC:
        raise _bad_magic(head)
    if version >= _IMPLAUSIBLE_VERSION:
        raise ArchiveError(f"corrupted aotfuse archive: format version field reads {version}, "
                           f"which no release has used")
    if version > FORMAT_VERSION:
        raise ArchiveError(f"archive format version {version} is newer than this aotfuse supports "
                           f"({MIN_SUPPORTED_VERSION}..{FORMAT_VERSION})", remedy="upgrade aotfuse")
    if version < MIN_SUPPORTED_VERSION:
        raise ArchiveError(f"archive format version {version} is older than this aotfuse supports "
                           f"({MIN_SUPPORTED_VERSION}..{FORMAT_VERSION})",
                           remedy="rebuild the archive with this aotfuse")
    computed = zlib.crc32(head[:HEADER_SIZE - 4])
    if computed != crc:
        raise ArchiveError(f"checksum mismatch in archive header (stored crc32 {crc:#010x}, "
                           f"computed {computed:#010x}): file is corrupted")
    # Past the checksum a bad value means a buggy or hostile writer, not a flipped bit.
    if header_size != HEADER_SIZE:
        raise ArchiveError(f"malformed archive: header size {header_size}, expected {HEADER_SIZE}")
    if flags != 0 or reserved != bytes(20):
        raise ArchiveError("malformed archive: reserved header fields are not zero")
    if not 0 < toc_length <= MAX_TOC_BYTES:
        raise ArchiveError(f"malformed archive: table of contents length {toc_length} is outside "
                           f"1..{MAX_TOC_BYTES}")
    return Header(version, toc_length, file_size, toc_crc)


# ---------------------------------------------------------------- table of contents

def pack_toc(manifest: dict, parts: list[PartEntry], weights: list[WeightEntry]) -> bytes:
    """`manifest` must already be canonical (format._canonical): sorted keys, plain types."""
    toc = {
        "manifest": manifest,
        "parts": [{"name": p.name, "offset": p.offset, "stored_len": p.stored_len,
                   "raw_len": p.raw_len, "codec": p.codec, "crc32": p.crc32} for p in parts],
        "weights": [{"name": w.name, "dtype": w.dtype, "shape": list(w.shape), "offset": w.offset,
                     "nbytes": w.nbytes, "crc32": w.crc32} for w in weights],
    }
    return msgpack.packb(toc, use_bin_type=True)


def _pairs_to_dict(pairs: list) -> dict:
    # msgpack would keep the last of duplicate keys silently; two readers could then disagree.
    out: dict = {}
    for key, value in pairs:
        if type(key) is not str:
            raise ArchiveError(f"malformed archive: map key {key!r} in table of contents is not a string")
        if key in out:
            raise ArchiveError(f"malformed archive: duplicate key {key!r} in table of contents")
        out[key] = value
    return out


def unpack_toc(raw: bytes | memoryview, header: Header) -> Toc:
    computed = zlib.crc32(raw)
    if computed != header.toc_crc32:
        raise ArchiveError(f"checksum mismatch in table of contents (stored crc32 "
                           f"{header.toc_crc32:#010x}, computed {computed:#010x}): file is corrupted")
    n = len(raw)
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True,
                              object_pairs_hook=_pairs_to_dict, max_str_len=n,
                              max_bin_len=n, max_array_len=n, max_map_len=n, max_ext_len=0)
    except (ValueError, msgpack.UnpackException) as e:  # FormatError, ExtraData, StackError, bad UTF-8, ...
        raise ArchiveError(f"malformed archive: table of contents does not decode ({type(e).__name__}: {e})") from e
    top = _fields(obj, ("manifest", "parts", "weights"), "table of contents")
    if type(top["manifest"]) is not dict:
        raise ArchiveError("malformed archive: manifest is not a map")
    for key in ("parts", "weights"):
        if type(top[key]) is not list:
            raise ArchiveError(f"malformed archive: '{key}' in table of contents is not a list")
    parts = tuple(_part(e, i) for i, e in enumerate(top["parts"]))
    weights = tuple(_weight(e, i) for i, e in enumerate(top["weights"]))
    for kind, items in (("part", parts), ("weight", weights)):
        seen: set[str] = set()
        for item in items:
            if item.name in seen:
                raise ArchiveError(f"malformed archive: two {kind}s named {item.name!r}")
            seen.add(item.name)
    return Toc(top["manifest"], parts, weights)


def _fields(obj: Any, keys: tuple[str, ...], where: str) -> dict:
    if type(obj) is not dict:
        raise ArchiveError(f"malformed archive: {where} is a {type(obj).__name__}, expected a map")
    if set(obj) != set(keys):
        missing = sorted(set(keys) - set(obj))
        extra = sorted(set(obj) - set(keys))
        raise ArchiveError(f"malformed archive: {where} has missing fields {missing} / unknown fields {extra}")
    return obj


def _uint(entry: dict, key: str, where: str, limit: int = 1 << 63) -> int:
    v = entry[key]
    if type(v) is not int or not 0 <= v < limit:  # `type is` also rejects bool
        raise ArchiveError(f"malformed archive: {where} field {key!r} is {v!r}, expected an integer in 0..{limit - 1}")
    return v


def _name(entry: dict, where: str) -> str:
    v = entry["name"]
    if type(v) is not str or not v:
        raise ArchiveError(f"malformed archive: {where} has name {v!r}, expected a non-empty string")
    return v


def _part(obj: Any, i: int) -> PartEntry:
    e = _fields(obj, ("name", "offset", "stored_len", "raw_len", "codec", "crc32"), f"part #{i}")
    name = _name(e, f"part #{i}")
    where = f"part {name!r}"
    if e["codec"] != CODEC_ZSTD:
        raise ArchiveError(f"malformed archive: {where} uses codec {e['codec']!r}; this aotfuse knows {CODEC_ZSTD!r}")
    raw_len = _uint(e, "raw_len", where)
    if raw_len > MAX_PART_RAW_BYTES:
        raise ArchiveError(f"malformed archive: {where} declares {raw_len} bytes uncompressed, "
                           f"over the {MAX_PART_RAW_BYTES}-byte cap")
    return PartEntry(name, _uint(e, "offset", where), _uint(e, "stored_len", where), raw_len,
                     CODEC_ZSTD, _uint(e, "crc32", where, 1 << 32))


def _weight(obj: Any, i: int) -> WeightEntry:
    e = _fields(obj, ("name", "dtype", "shape", "offset", "nbytes", "crc32"), f"weight #{i}")
    name = _name(e, f"weight #{i}")
    where = f"weight {name!r}"
    dtype = e["dtype"]
    if type(dtype) is not str or dtype not in DTYPES:
        raise ArchiveError(f"malformed archive: {where} has dtype {dtype!r}, not one of {sorted(DTYPES)}")
    shape = e["shape"]
    if type(shape) is not list or len(shape) > MAX_NDIM or \
            any(type(d) is not int or not 0 <= d <= MAX_ELEMENTS for d in shape):
        raise ArchiveError(f"malformed archive: {where} has shape {shape!r}, expected at most "
                           f"{MAX_NDIM} non-negative integers")
    numel = 1
    nonzero = 1  # strides of an empty tensor are still products of its dims: bound those too
    for d in shape:
        numel *= d
        nonzero *= max(d, 1)
        if nonzero > MAX_ELEMENTS:
            raise ArchiveError(f"malformed archive: {where} has shape {shape!r}, too many elements")
    nbytes = _uint(e, "nbytes", where)
    if numel * DTYPES[dtype].itemsize != nbytes:
        raise ArchiveError(f"malformed archive: {where} is {dtype}{shape} = "
                           f"{numel * DTYPES[dtype].itemsize} bytes but records nbytes={nbytes}")
    offset = _uint(e, "offset", where)
    if offset % ALIGN:
        raise ArchiveError(f"malformed archive: {where} starts at byte {offset}, not {ALIGN}-byte aligned")
    return WeightEntry(name, dtype, tuple(shape), offset, nbytes, _uint(e, "crc32", where, 1 << 32))


def check_spans(toc: Toc, header: Header, size: int) -> None:
    """Every item inside the data region, inside the file, and no two overlapping."""
    data_start = header.toc_end
    spans = sorted([(p.offset, p.offset + p.stored_len, "part", p.name) for p in toc.parts] +
                   [(w.offset, w.offset + w.nbytes, "weight", w.name) for w in toc.weights])
    prev_end, prev = data_start, None
    for start, end, kind, name in spans:
        if end > size:
            raise ArchiveError(f"archive truncated: {kind} {name!r} spans bytes {start}..{end} "
                               f"but file is {size} bytes")
        if start < prev_end:
            inside = f"{prev[0]} {prev[1]!r}" if prev else "the header/table of contents"
            raise ArchiveError(f"malformed archive: {kind} {name!r} (bytes {start}..{end}) overlaps {inside}")
        prev_end, prev = end, (kind, name)
    if size < header.file_size:
        raise ArchiveError(f"archive truncated: header records {header.file_size} bytes but file is {size} bytes")
    if size > header.file_size:
        raise ArchiveError(f"archive has {size - header.file_size} unexpected bytes after its recorded end "
                           f"(byte {header.file_size}): file was appended to or is corrupted")
