"""Writer and reader of the single-file .aotf archive.

Byte layout and table validation live in _layout.py; the prose spec is artifacts/FORMAT.md.
Reading maps the file (paths) or wraps the caller's buffer (bytes) and hands out weights as
zero-copy views; nothing is extracted to disk and nothing unpickled or evaluated.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import mmap
import os
import secrets
import stat
import sys
import warnings
import zlib
from typing import Iterable, Union

import torch
import zstandard

from aotfuse.errors import ArchiveError

from ._layout import (
    CODEC_ZSTD, DTYPES, FORMAT_VERSION, HEADER_SIZE, MAX_MANIFEST_DEPTH, MAX_NDIM, MAX_PART_RAW_BYTES,
    MAX_TOC_BYTES, MIN_SUPPORTED_VERSION, ZSTD_LEVEL, Header, PartEntry, WeightEntry, align,
    check_spans, pack_header, pack_toc, parse_header, unpack_toc,
)

__all__ = ["FORMAT_VERSION", "MIN_SUPPORTED_VERSION", "Archive", "read_archive", "save_archive",
           "write_archive"]

Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]
_DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}
_INT_RANGE = (-(1 << 63), 1 << 64)  # what msgpack can encode


def _check_host() -> None:
    # Weights are stored and mapped as raw little-endian bytes; a big-endian host would need a
    # byte-swapping copy, which defeats zero-copy loading. No such host runs aotfuse today.
    if sys.byteorder != "little":
        raise ArchiveError("aotfuse archives need a little-endian host")


# ---------------------------------------------------------------- writing

def _canonical(value, where: str, depth: int = 0):
    """Plain msgpack types with sorted map keys, so equal manifests encode to equal bytes."""
    if depth > MAX_MANIFEST_DEPTH:
        raise ArchiveError(f"cannot write archive: {where} nests deeper than {MAX_MANIFEST_DEPTH} levels")
    kind = type(value)
    if value is None or kind in (bool, float, str):
        return value
    if kind is int:
        if not _INT_RANGE[0] <= value < _INT_RANGE[1]:
            raise ArchiveError(f"cannot write archive: {where} = {value} does not fit in 64 bits")
        return value
    if kind in (bytes, bytearray, memoryview):
        return bytes(value)
    if kind in (list, tuple):  # tuples come back as lists: msgpack has one array type
        return [_canonical(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if kind is dict:
        for key in value:
            if type(key) is not str:
                raise ArchiveError(f"cannot write archive: {where} has non-string key {key!r}")
        return {k: _canonical(value[k], f"{where}[{k!r}]", depth + 1) for k in sorted(value)}
    raise ArchiveError(f"cannot write archive: {where} is a {kind.__name__}; manifest values must be "
                       f"None, bool, int, float, str, bytes, list or dict")


def _part_blob(name: str, value) -> tuple[bytes, int, int]:
    """(stored bytes, raw length, crc32 of the stored bytes)."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ArchiveError(f"cannot write archive: part {name!r} is a {type(value).__name__}, expected bytes")
    view = memoryview(value)
    if not view.c_contiguous:
        raise ArchiveError(f"cannot write archive: part {name!r} is a non-contiguous buffer")
    view = view.cast("B")
    if len(view) > MAX_PART_RAW_BYTES:
        raise ArchiveError(f"cannot write archive: part {name!r} is {len(view)} bytes, over the "
                           f"{MAX_PART_RAW_BYTES}-byte cap readers enforce")
    # Fixed level, one thread, no dict id: the frame depends only on the input (and libzstd).
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True, write_checksum=False,
                                    write_dict_id=False, threads=0)
    stored = cctx.compress(view)
    return stored, len(view), zlib.crc32(stored)


def _weight_bytes(name: str, tensor) -> tuple[str, tuple[int, ...], memoryview, int]:
    """(dtype name, shape, row-major bytes, crc32); no copy for a contiguous tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise ArchiveError(f"cannot write archive: weight {name!r} is a {type(tensor).__name__}, expected a tensor")
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
        raise ArchiveError(f"cannot write archive: weight {name!r} must be a dense CPU tensor "
                           f"(got {tensor.device.type}, {tensor.layout})")
    dtype = _DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise ArchiveError(f"cannot write archive: weight {name!r} has unsupported dtype {tensor.dtype}")
    # conj/neg bits are lazy flags, not data: materialize them before taking the bytes.
    t = tensor.detach().resolve_conj().resolve_neg().contiguous()
    if t.dim() > MAX_NDIM:
        raise ArchiveError(f"cannot write archive: weight {name!r} has {t.dim()} dims, over {MAX_NDIM}")
    raw = _raw_bytes(t)
    return dtype, tuple(t.shape), raw, zlib.crc32(raw)


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """A read-only byte view of a contiguous CPU tensor's data, without a copy and without numpy.

    A contiguous tensor's elements are the numel * itemsize bytes from data_ptr() (a storage
    offset is already in data_ptr), whatever the dtype (bf16 and fp8 included). The view is a
    ctypes array over that address which keeps the tensor, and so its storage, alive.
    """
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    buf = (ctypes.c_ubyte * nbytes).from_address(t.data_ptr())
    buf._owner = t  # the memory belongs to t: keep it alive as long as the view
    return memoryview(buf).cast("B").toreadonly()


def _plan(manifest: dict, parts: dict, weights: dict) -> tuple[list, int]:
    """The file as an ordered list of buffers to concatenate, and its total size."""
    _check_host()
    if type(manifest) is not dict:
        raise ArchiveError(f"cannot write archive: manifest is a {type(manifest).__name__}, expected a dict")
    man = _canonical(manifest, "manifest")
    blobs = [(name, *_part_blob(name, parts[name])) for name in _sorted_names(parts, "part")]
    tensors = [(name, *_weight_bytes(name, weights[name])) for name in _sorted_names(weights, "weight")]

    # Offsets are absolute, so the table's length depends on the offsets it records: grow the
    # data start until the packed table fits in front of it (monotone, so this terminates).
    data_start = align(HEADER_SIZE + 1)
    while True:
        pos, p_entries, w_entries = data_start, [], []
        for name, stored, raw_len, crc in blobs:
            p_entries.append(PartEntry(name, pos, len(stored), raw_len, CODEC_ZSTD, crc))
            pos = align(pos + len(stored))
        for name, dtype, shape, raw, crc in tensors:
            w_entries.append(WeightEntry(name, dtype, shape, pos, len(raw), crc))
            pos = align(pos + len(raw))
        try:
            toc = pack_toc(man, p_entries, w_entries)
        except (ValueError, TypeError, OverflowError) as e:  # e.g. a lone surrogate in a str
            raise ArchiveError(f"cannot write archive: manifest does not encode as msgpack ({e})") from e
        if len(toc) > MAX_TOC_BYTES:
            raise ArchiveError(f"cannot write archive: table of contents is {len(toc)} bytes, over the "
                               f"{MAX_TOC_BYTES}-byte cap (keep large data in parts, not the manifest)")
        if align(HEADER_SIZE + len(toc)) <= data_start:
            break
        data_start = align(HEADER_SIZE + len(toc))

    items = [(e.offset, b[1]) for e, b in zip(p_entries, blobs)] + \
            [(e.offset, t[3]) for e, t in zip(w_entries, tensors)]
    size = items[-1][0] + len(items[-1][1]) if items else data_start
    chunks: list = []
    at = 0
    for offset, buf in [(0, pack_header(toc, size)), (HEADER_SIZE, toc)] + items:
        if offset > at:
            chunks.append(bytes(offset - at))  # zero padding up to the next aligned start
        chunks.append(buf)
        at = offset + len(buf)
    if at < size:
        chunks.append(bytes(size - at))  # no items: pad the table out to the data start
    return chunks, size


def _sorted_names(mapping, kind: str) -> list:
    if not isinstance(mapping, dict):
        raise ArchiveError(f"cannot write archive: {kind}s must be a dict, got {type(mapping).__name__}")
    bad = [k for k in mapping if type(k) is not str or not k]
    if bad:
        raise ArchiveError(f"cannot write archive: {kind} name {bad[0]!r} is not a non-empty string")
    return sorted(mapping)


def write_archive(manifest: dict, parts: dict[str, bytes], weights: dict[str, torch.Tensor]) -> bytes:
    """The archive as bytes. Same inputs give identical bytes (sorted names, fixed zstd level)."""
    chunks, _ = _plan(manifest, parts, weights)
    return b"".join(chunks)


def save_archive(path, manifest: dict, parts: dict[str, bytes], weights: dict[str, torch.Tensor]) -> int:
    """Write atomically (temp file in the same directory, fsync, os.replace); returns the size.

    A reader that has the old file mapped keeps seeing the old inode, so replacing an archive in
    use never changes bytes under a live mapping. Chunks are streamed: no whole-file buffer.
    """
    chunks, size = _plan(manifest, parts, weights)
    write_atomically(path, chunks)
    return size


def write_atomically(path, chunks) -> None:
    """Write `chunks` to `path` through a temp file in the same directory, fsync, os.replace.

    The one atomic file write (archives here, `BuildResult.save`): a reader that has the old file
    mapped keeps its inode, and a crash leaves the old file or the new one, never half of one."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    done = False
    try:
        # O_EXCL: never clobber a stranger's file; mode 0o666 lets the umask decide as for any new file.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        done = True
    except OSError as e:
        raise ArchiveError(f"cannot write archive {path!r}: {e.strerror or e}") from e
    finally:
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    with contextlib.suppress(OSError):  # persist the rename itself; not possible everywhere
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


# ---------------------------------------------------------------- reading

class Archive:
    """An open archive. Weights are views into the mapped file or the caller's buffer.

    close() drops this object's references; the mapping itself is unmapped once no weight tensor
    handed out still points into it (each tensor pins it), so a tensor can never dangle.
    """

    def __init__(self, *, view: memoryview, mm: mmap.mmap | None, header: Header, manifest: dict,
                 parts: Iterable[PartEntry], weights: dict[str, torch.Tensor],
                 weight_entries: Iterable[WeightEntry], verified: bool):
        self._view: memoryview | None = view
        self._mm = mm
        self._verified = verified
        self.format_version: int = header.version
        self.manifest: dict = manifest
        self.part_entries: dict[str, PartEntry] = {p.name: p for p in parts}
        self.weight_entries: dict[str, WeightEntry] = {w.name: w for w in weight_entries}
        self.part_names: tuple[str, ...] = tuple(self.part_entries)
        self.weights: dict[str, torch.Tensor] = weights
        self.weights_bytes: int = sum(w.nbytes for w in self.weight_entries.values())
        self.size: int = header.file_size
        self._sha256: str | None = None

    def sha256(self) -> str:
        """Hex SHA-256 of the archive's bytes (the whole file): what `aotfuse.load(..., sha256=)` pins."""
        if self._sha256 is None:
            if self._view is None:
                raise ArchiveError("cannot hash the archive: it is closed")
            self._sha256 = hashlib.sha256(self._view).hexdigest()
        return self._sha256

    def part(self, name: str) -> bytes:
        """The part's original bytes: checksum verified, decompression bounded by its raw length."""
        if self._view is None:
            raise ArchiveError(f"cannot read part {name!r}: archive is closed")
        entry = self.part_entries.get(name)
        if entry is None:
            have = ", ".join(map(repr, self.part_names)) or "none"
            raise ArchiveError(f"archive has no part {name!r} (parts: {have})")
        stored = self._view[entry.offset:entry.offset + entry.stored_len]
        if not self._verified:
            _check_crc("part", name, stored, entry.crc32)
        return _decompress(entry, stored)

    def close(self) -> None:
        view, mm = self._view, self._mm
        self._view, self._mm, self.weights = None, None, {}
        if view is not None:
            view.release()  # fine while weight slices exist: they hold their own export
        if mm is not None:
            with contextlib.suppress(BufferError):  # a weight tensor still uses it: GC unmaps later
                mm.close()

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Archive(version={self.format_version}, size={self.size}, parts={list(self.part_names)}, "
                f"weights={len(self.weight_entries)} ({self.weights_bytes} bytes))")


def _check_crc(kind: str, name: str, data: memoryview, stored: int) -> None:
    computed = zlib.crc32(data)
    if computed != stored:
        raise ArchiveError(f"checksum mismatch in {kind} {name!r} (stored crc32 {stored:#010x}, "
                           f"computed {computed:#010x}): file is corrupted")


def _decompress(entry: PartEntry, stored: memoryview) -> bytes:
    # python-zstandard allocates whatever the frame header declares, ignoring max_output_size, so
    # the declared size is checked against the (capped) table value before decompressing.
    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as e:
        raise ArchiveError(f"part {entry.name!r} is not a valid zstd frame ({e}): file is corrupted") from e
    if declared != entry.raw_len:
        raise ArchiveError(f"malformed archive: part {entry.name!r} frame declares {declared} bytes "
                           f"but the table records {entry.raw_len}")
    try:
        out = zstandard.ZstdDecompressor().decompress(stored, max_output_size=entry.raw_len,
                                                      allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise ArchiveError(f"part {entry.name!r} does not decompress ({e}): file is corrupted") from e
    if len(out) != entry.raw_len:
        raise ArchiveError(f"part {entry.name!r} decompressed to {len(out)} bytes, expected {entry.raw_len}")
    return out


def _tensor(entry: WeightEntry, region: memoryview) -> torch.Tensor:
    dtype = DTYPES[entry.dtype]
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)  # frombuffer refuses empty buffers
    with warnings.catch_warnings():
        # Only a caller's immutable bytes get here read-only; torch has no read-only tensors and
        # warns. Documented instead: weights read from bytes must not be written in place.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        t = torch.frombuffer(region, dtype=dtype)
    if t.data_ptr() % dtype.itemsize:
        t = t.clone()  # only a caller's odd memoryview can be misaligned; kernels assume alignment
    t = t.view(entry.shape)
    if dtype is torch.bool and int(t.view(torch.uint8).max()) > 1:
        # torch assumes bool bytes are 0 or 1; other values give nonsense results, so refuse them.
        raise ArchiveError(f"malformed archive: bool weight {entry.name!r} holds bytes other than 0 and 1")
    return t


def _map_file(path: str) -> tuple[memoryview, mmap.mmap | None]:
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
            raise ArchiveError(f"cannot read archive {path!r}: not a regular file")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return memoryview(b""), None  # mmap refuses empty files; parse_header explains
            # Private copy-on-write mapping: pages are shared with the page cache until written,
            # and an in-place op on a weight writes a private copy instead of faulting (a
            # read-only map would SIGSEGV) or reaching the file.
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise ArchiveError(f"cannot open archive {path!r}: {e.strerror or e}") from e
    return memoryview(mm), mm


def _pinned_digest(sha256) -> str:
    if not isinstance(sha256, str) or len(sha256) != 64 or any(c not in "0123456789abcdefABCDEF" for c in sha256):
        raise ArchiveError(f"sha256 pin must be 64 hex digits (as `aotfuse inspect` prints), got {sha256!r}")
    return sha256.lower()


def _check_sha256(view: memoryview, expected: str) -> str:
    actual = hashlib.sha256(view).hexdigest()
    if not hmac.compare_digest(actual, expected):
        raise ArchiveError(f"archive sha256 mismatch: expected {expected}, got {actual} "
                           f"(not the archive this deployment pinned; refusing to load it)")
    return actual


def read_archive(src: Source, *, verify: bool = True, sha256: str | None = None) -> Archive:
    """Open an archive from a path (memory-mapped) or from bytes (wrapped, not copied).

    verify=True checks the crc32 of every part and weight now; verify=False defers part checks to
    part() and skips weight checks (the header and table are always checked).

    sha256: the expected hex SHA-256 of the whole file. The bytes are hashed before anything in them
    is parsed (for a path: the mapped file, which is then what gets parsed), and a mismatch is an
    ArchiveError. crc32s only detect corruption; a pinned digest also refuses a substituted file.
    """
    _check_host()
    expected = None if sha256 is None else _pinned_digest(sha256)
    if isinstance(src, (bytes, bytearray, memoryview)):
        view = memoryview(src)
        if not view.c_contiguous:
            raise ArchiveError("cannot read archive from a non-contiguous memoryview")
        view, mm = view.cast("B"), None
    elif isinstance(src, (str, os.PathLike)):
        view, mm = _map_file(os.fspath(src))
    else:
        raise ArchiveError(f"cannot read an archive from a {type(src).__name__}: pass a path or bytes")
    try:
        digest = None if expected is None else _check_sha256(view, expected)
        archive = _open(view, mm, verify)
        archive._sha256 = digest
        return archive
    except BaseException:
        view.release()
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()
        raise


def _open(view: memoryview, mm: mmap.mmap | None, verify: bool) -> Archive:
    size = len(view)
    header = parse_header(bytes(view[:HEADER_SIZE]), size)
    if header.toc_end > size:
        raise ArchiveError(f"archive truncated: table of contents spans bytes {HEADER_SIZE}..{header.toc_end} "
                           f"but file is {size} bytes")
    toc = unpack_toc(view[HEADER_SIZE:header.toc_end], header)
    check_spans(toc, header, size)  # from here on every offset/length is known to be in bounds
    if verify:
        for p in toc.parts:
            _check_crc("part", p.name, view[p.offset:p.offset + p.stored_len], p.crc32)
    weights: dict[str, torch.Tensor] = {}
    for w in toc.weights:
        region = view[w.offset:w.offset + w.nbytes]
        if verify:
            _check_crc("weight", w.name, region, w.crc32)
        weights[w.name] = _tensor(w, region)
    return Archive(view=view, mm=mm, header=header, manifest=toc.manifest, parts=toc.parts,
                   weights=weights, weight_entries=toc.weights, verified=verify)
