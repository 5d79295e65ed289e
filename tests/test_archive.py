"""The .aotf archive: round trip, zero-copy, determinism, refusals, fuzzing, golden file.

The layout is re-parsed here with struct/msgpack directly (not through aotfuse) so the tests pin
the documented bytes of artifacts/FORMAT.md, not just writer/reader agreement.
"""
from __future__ import annotations

import gc
import importlib.util
import io
import os
import re
import struct
import zipfile
import zlib
from pathlib import Path

import msgpack
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aotfuse.archive import (
    FORMAT_VERSION, MIN_SUPPORTED_VERSION, Archive, read_archive, save_archive, write_archive,
)
from aotfuse.errors import ArchiveError

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "artifacts" / "golden" / "v1_small.aotf"
MAGIC = b"AOTF\r\n\x00\n"
HEADER = struct.Struct("<8sIIQQII20sI")


# ---------------------------------------------------------------- helpers

def sample() -> tuple[dict, dict[str, bytes], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    manifest = {"model": "tiny", "dims": [4, 8], "eps": 1e-5, "ok": True, "none": None,
                "blob": b"\x00\xff", "nested": {"z": [1, [2, {"k": "v"}]], "a": -7}}
    parts = {"program": b"program-bytes " * 40, "kernels": bytes(range(256)) * 3,
             "sources": "print('hi')\n".encode() * 10, "report": b""}
    weights = {
        "ln.weight": torch.randn(8, generator=g),
        "emb": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "half": torch.randn(2, 3, 2, generator=g).to(torch.float16),
        "ids": torch.tensor([-(2**63), 0, 2**63 - 1, 42]),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "f8": torch.tensor([0.5, -1.0, 2.0]).to(torch.float8_e4m3fn),
        "cplx": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
        "transposed": torch.arange(6.0).reshape(2, 3).t(),  # non-contiguous input
        "sliced": torch.arange(10.0, dtype=torch.float64)[3:7],  # storage offset > 0
        "param": torch.nn.Parameter(torch.ones(2, 2)),  # requires_grad: written detached
    }
    return manifest, parts, weights


def bits(t: torch.Tensor) -> bytes:
    """Exact bytes of a tensor (compares float8/NaN/-0.0 bitwise, where == would not)."""
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def assert_same_weights(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert bits(g) == bits(w), name
        if w.dtype not in (torch.float8_e4m3fn,):  # element-wise too, where torch supports it
            assert torch.equal(g, w), name


def raw_layout(data: bytes) -> tuple[tuple, dict, int]:
    """(header fields, decoded table, data start) parsed independently of aotfuse."""
    fields = HEADER.unpack(data[:64])
    toc_len = fields[3]
    toc = msgpack.unpackb(data[64:64 + toc_len], raw=False)
    return fields, toc, 64 + toc_len


def covered_spans(data: bytes) -> list[tuple[int, int]]:
    """Byte ranges protected by a checksum: header, table, every part and weight."""
    _, toc, toc_end = raw_layout(data)
    spans = [(0, toc_end)]
    spans += [(p["offset"], p["offset"] + p["stored_len"]) for p in toc["parts"]]
    spans += [(w["offset"], w["offset"] + w["nbytes"]) for w in toc["weights"]]
    return spans


def forge(original: bytes, toc: dict, file_size: int | None = None) -> bytes:
    """A hostile archive: table `toc` with valid checksums, data region of `original` kept.

    Models a writer that signs what it writes, so table validation (not the crc) must refuse.
    If the new table no longer fits before the data, everything moves up by 64-byte steps.
    """
    _, _, toc_end = raw_layout(original)
    data_start = (toc_end + 63) // 64 * 64
    shift = 0
    while True:
        shifted = _shift_offsets(toc, shift)
        packed = msgpack.packb(shifted, use_bin_type=True)
        if 64 + len(packed) <= data_start + shift:
            break
        shift += 64
    body = packed + bytes(data_start + shift - 64 - len(packed)) + original[data_start:]
    size = 64 + len(body) if file_size is None else file_size
    head = HEADER.pack(MAGIC, 1, 64, len(packed), size, zlib.crc32(packed), 0, bytes(20), 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(head)) + body


def _shift_offsets(toc, shift: int):
    if not shift or type(toc) is not dict:
        return toc
    out = dict(toc)
    for key in ("parts", "weights"):
        if type(out.get(key)) is list:
            out[key] = [dict(e, offset=e["offset"] + shift)
                        if type(e) is dict and type(e.get("offset")) is int and e["offset"] + shift < 2**64
                        else e for e in out[key]]
    return out


def exercise(src, verify: bool = True) -> str:
    """Open, read every part, touch every weight byte. 'ok' or 'refused' (ArchiveError only)."""
    try:
        with read_archive(src, verify=verify) as a:
            for name in a.part_names:
                a.part(name)
            for t in a.weights.values():
                int(t.contiguous().reshape(-1).view(torch.uint8).sum())
    except ArchiveError:
        return "refused"
    return "ok"


def refuse(src, match: str, **kw) -> ArchiveError:
    with pytest.raises(ArchiveError, match=match) as info:
        exercise_strict(src, **kw)
    return info.value


def exercise_strict(src, verify: bool = True) -> None:
    with read_archive(src, verify=verify) as a:
        for name in a.part_names:
            a.part(name)


def mappings_of(path: Path) -> list[tuple[int, int]]:
    """Address ranges where `path` is mapped into this process (Linux /proc)."""
    out = []
    target = str(path.resolve())
    for line in Path("/proc/self/maps").read_text().splitlines():
        cols = line.split(maxsplit=5)
        if len(cols) == 6 and cols[5] == target:
            lo, hi = (int(x, 16) for x in cols[0].split("-"))
            out.append((lo, hi))
    return out


needs_proc = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")


@pytest.fixture(scope="module")
def archive_bytes() -> bytes:
    return write_archive(*sample())


# ---------------------------------------------------------------- round trip

def test_version_constants():
    assert FORMAT_VERSION == 1 and MIN_SUPPORTED_VERSION == 1


@pytest.mark.parametrize("how", ["bytes", "bytearray", "memoryview", "path", "pathstr"])
def test_round_trip(tmp_path, how):
    manifest, parts, weights = sample()
    data = write_archive(manifest, parts, weights)
    path = tmp_path / "m.aotf"
    path.write_bytes(data)
    src = {"bytes": data, "bytearray": bytearray(data), "memoryview": memoryview(data),
           "path": path, "pathstr": str(path)}[how]
    with read_archive(src) as a:
        assert isinstance(a, Archive)
        assert a.format_version == 1
        assert a.size == len(data)
        want_manifest = dict(manifest, nested={"z": [1, [2, {"k": "v"}]], "a": -7})
        assert a.manifest == want_manifest
        assert list(a.manifest) == sorted(manifest)  # canonical key order
        assert a.part_names == tuple(sorted(parts))
        for name, blob in parts.items():
            got = a.part(name)
            assert type(got) is bytes and got == blob
        assert_same_weights(a.weights, weights)
        assert a.weights_bytes == sum(t.numel() * t.element_size() for t in weights.values())
        assert list(a.weights) == sorted(weights)


def test_layout_matches_spec(archive_bytes):
    """Header fields, table schema, alignment: parsed with struct + msgpack only."""
    data = archive_bytes
    magic, version, header_size, toc_len, file_size, toc_crc, flags, reserved, head_crc = raw_layout(data)[0]
    assert (magic, version, header_size, file_size, flags, reserved) == (MAGIC, 1, 64, len(data), 0, bytes(20))
    assert head_crc == zlib.crc32(data[:60])
    assert toc_crc == zlib.crc32(data[64:64 + toc_len])
    _, toc, toc_end = raw_layout(data)
    assert set(toc) == {"manifest", "parts", "weights"}
    names = [p["name"] for p in toc["parts"]]
    assert names == sorted(names)
    for p in toc["parts"]:
        assert set(p) == {"name", "offset", "stored_len", "raw_len", "codec", "crc32"}
        assert p["codec"] == "zstd" and p["offset"] % 64 == 0 and p["offset"] >= toc_end
        stored = data[p["offset"]:p["offset"] + p["stored_len"]]
        assert zlib.crc32(stored) == p["crc32"]
        assert len(zstandard.ZstdDecompressor().decompress(stored)) == p["raw_len"]
    names = [w["name"] for w in toc["weights"]]
    assert names == sorted(names)
    _, _, want = sample()
    for w in toc["weights"]:
        assert set(w) == {"name", "dtype", "shape", "offset", "nbytes", "crc32"}
        assert w["offset"] % 64 == 0, w  # aligned from the start of the file
        raw = data[w["offset"]:w["offset"] + w["nbytes"]]
        assert raw == bits(want[w["name"]])  # raw little-endian, row-major, uncompressed
        assert zlib.crc32(raw) == w["crc32"]
        assert w["dtype"] == str(want[w["name"]].dtype).removeprefix("torch.")
        assert w["shape"] == list(want[w["name"]].shape)
    spans = sorted(covered_spans(data))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
    assert max(end for _, end in spans) == len(data)  # nothing trails the last item


@needs_proc
def test_path_weights_are_views_of_the_mapping(tmp_path):
    manifest, parts, weights = sample()
    path = tmp_path / "m.aotf"
    save_archive(path, manifest, parts, weights)
    _, toc, _ = raw_layout(path.read_bytes())
    offsets = {w["name"]: w["offset"] for w in toc["weights"]}
    a = read_archive(path)
    maps = mappings_of(path)
    assert len(maps) == 1, maps  # one read-only mapping of the whole file, not a copy
    lo, hi = maps[0]
    for name, t in a.weights.items():
        if t.numel() == 0:
            continue
        ptr = t.untyped_storage().data_ptr()
        assert lo <= ptr < hi, name
        assert ptr - lo == offsets[name], name  # file offset == address offset: no copy anywhere
        assert ptr % 64 == 0
    del t  # the loop variable would otherwise pin the mapping (by design, see next test)
    a.close()
    assert mappings_of(path) == []  # no tensor escaped: close() unmaps at once


@needs_proc
def test_close_keeps_escaped_weights_valid(tmp_path):
    manifest, parts, weights = sample()
    path = tmp_path / "m.aotf"
    save_archive(path, manifest, parts, weights)
    with read_archive(path) as a:
        kept = a.weights["ln.weight"]
    assert a.weights == {}
    with pytest.raises(ArchiveError, match="archive is closed"):
        a.part("program")
    assert torch.equal(kept, weights["ln.weight"])  # still mapped: the tensor pins the mapping
    assert len(mappings_of(path)) == 1
    del kept
    gc.collect()
    assert mappings_of(path) == []


def test_in_place_write_to_mapped_weight_stays_private(tmp_path):
    path = tmp_path / "m.aotf"
    save_archive(path, *sample())
    before = path.read_bytes()
    with read_archive(path) as a:
        a.weights["ln.weight"].add_(1.0)  # copy-on-write page: no fault, file untouched
        a.weights["ln.weight"].zero_()
        assert float(a.weights["ln.weight"].abs().sum()) == 0.0
    assert path.read_bytes() == before
    assert exercise(path) == "ok"


def test_bytes_weights_are_views_of_the_buffer():
    data = bytearray(write_archive(*sample()))
    a = read_archive(data)
    t = a.weights["ln.weight"]
    _, toc, _ = raw_layout(bytes(data))
    off = next(w["offset"] for w in toc["weights"] if w["name"] == "ln.weight")
    data[off:off + 4] = struct.pack("<f", 123.0)  # visible through the tensor: shared memory
    assert t[0].item() == 123.0


def test_missing_part_is_named(archive_bytes):
    with read_archive(archive_bytes) as a:
        with pytest.raises(ArchiveError, match=r"archive has no part 'nope' \(parts: 'kernels', 'program'"):
            a.part("nope")


def test_empty_archive_round_trips():
    data = write_archive({}, {}, {})
    with read_archive(data) as a:
        assert (a.manifest, a.part_names, a.weights, a.weights_bytes) == ({}, (), {}, 0)


# ---------------------------------------------------------------- determinism and saving

def test_deterministic():
    m, p, w = sample()
    one = write_archive(m, p, w)
    two = write_archive(*sample())
    assert one == two
    reordered = write_archive(dict(reversed(list(m.items()))), dict(reversed(list(p.items()))),
                              {k: v.clone() for k, v in reversed(list(w.items()))})
    assert reordered == one  # insertion order of any dict does not matter


def test_save_is_atomic_and_replaces_a_mapped_file(tmp_path):
    path = tmp_path / "m.aotf"
    m, p, w = sample()
    size = save_archive(path, m, p, w)
    assert size == path.stat().st_size == len(write_archive(m, p, w))
    old = read_archive(path)
    before = old.weights["ln.weight"].clone()
    save_archive(str(path), m, p, {**w, "ln.weight": torch.zeros(8)})
    assert torch.equal(old.weights["ln.weight"], before)  # old inode still mapped, untouched
    assert torch.equal(read_archive(path).weights["ln.weight"], torch.zeros(8))
    assert sorted(os.listdir(tmp_path)) == ["m.aotf"]  # no temp files left


def test_save_failure_is_an_archive_error(tmp_path):
    with pytest.raises(ArchiveError, match="cannot write archive"):
        save_archive(tmp_path / "missing-dir" / "m.aotf", {}, {}, {})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args, match", [
    (({"k": {1, 2}}, {}, {}), r"manifest\['k'\] is a set"),
    (({1: 2}, {}, {}), "non-string key"),
    (({"k": 2**64}, {}, {}), "does not fit in 64 bits"),
    (({}, {"p": "text"}, {}), "part 'p' is a str"),
    (({}, {"": b""}, {}), "part name '' is not a non-empty string"),
    (({}, {}, {"w": [1.0]}), "weight 'w' is a list"),
    (({}, {}, {"w": torch.zeros(2).to_sparse()}), "dense CPU tensor"),
    (({}, {}, {"w": torch.zeros(2, device="meta")}), "dense CPU tensor"),
])
def test_writer_refuses_bad_input(args, match):
    with pytest.raises(ArchiveError, match=match):
        write_archive(*args)


# ---------------------------------------------------------------- refusals

def test_truncated_at_every_length(archive_bytes, tmp_path):
    data = archive_bytes
    for n in range(1, len(data)):
        with pytest.raises(ArchiveError, match="archive truncated") as info:
            read_archive(data[:n])
        if n > 64 + HEADER.unpack(data[:64])[3]:
            assert re.search(r"(part|weight) '[^']+' spans bytes \d+\.\.\d+ but file is %d bytes" % n,
                             str(info.value)) or "header records" in str(info.value), (n, info.value)
    path = tmp_path / "t.aotf"
    for n in (3, 63, 64, 200, len(data) - 1):  # the mmap path reports the same
        path.write_bytes(data[:n])
        refuse(path, "archive truncated")


def test_truncated_message_names_the_item(archive_bytes):
    _, toc, _ = raw_layout(archive_bytes)
    last = max(toc["weights"], key=lambda w: w["offset"] + w["nbytes"])
    end = last["offset"] + last["nbytes"]
    refuse(archive_bytes[:end - 1],
           rf"archive truncated: weight '{re.escape(last['name'])}' spans bytes {last['offset']}\.\.{end} "
           rf"but file is {end - 1} bytes")


def _zip_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a.txt", "hello")
    return buf.getvalue()


def _torch_save_bytes() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, buf)
    return buf.getvalue()


def _safetensors_bytes() -> bytes:
    from safetensors.torch import save
    return save({"w": torch.zeros(2)})


@pytest.mark.parametrize("blob, match", [
    (b"", r"not an aotfuse archive \(file is empty\)"),
    (_zip_bytes(), r"not an aotfuse archive \(bad magic b'PK\\x03\\x04.*zip file.*expected a \.aotf file"),
    (_torch_save_bytes(), r"bad magic b'PK\\x03\\x04.*torch\.save"),
    (b"\x89PNG\r\n\x1a\n" + bytes(100), "bad magic.*PNG"),
    (b"just some text\n" * 20, r"not an aotfuse archive \(bad magic b'just som'\)"),
    (b"hi", r"not an aotfuse archive \(bad magic b'hi'\)"),
    (_safetensors_bytes(), "bad magic.*safetensors"),
])
def test_foreign_files(blob, match, tmp_path):
    refuse(blob, match)
    path = tmp_path / "f.bin"
    path.write_bytes(blob)
    refuse(path, match)


def test_text_mode_copies_are_diagnosed(archive_bytes):
    refuse(archive_bytes.replace(b"\r\n", b"\n"), "CRLF bytes were turned into LF: it was copied in text mode")
    refuse(re.sub(rb"(?<!\r)\n", b"\r\n", archive_bytes), "LF bytes were turned into CRLF")


def _with_version(data: bytes, version: int) -> bytes:
    return data[:8] + struct.pack("<I", version) + data[12:]  # header crc left stale on purpose


def test_future_version_is_refused_before_anything_else(archive_bytes):
    err = refuse(_with_version(archive_bytes, 7),
                 r"archive format version 7 is newer than this aotfuse supports \(1\.\.1\) \(upgrade aotfuse\)")
    assert err.remedy == "upgrade aotfuse"


def test_old_version_is_refused(archive_bytes):
    refuse(_with_version(archive_bytes, 0), r"archive format version 0 is older than this aotfuse supports \(1\.\.1\)")


def test_implausible_version_is_called_corruption(archive_bytes):
    refuse(_with_version(archive_bytes, 0x01000000), "corrupted aotfuse archive: format version field reads 16777216")


def test_bit_flip_in_header(archive_bytes):
    data = bytearray(archive_bytes)
    data[40] ^= 0x10  # a reserved byte
    refuse(bytes(data), r"checksum mismatch in archive header \(stored crc32 0x[0-9a-f]{8}, computed 0x[0-9a-f]{8}\)")


def test_bit_flip_in_table(archive_bytes):
    data = bytearray(archive_bytes)
    data[64 + 20] ^= 0x01
    refuse(bytes(data), r"checksum mismatch in table of contents \(stored crc32 0x[0-9a-f]{8}, computed 0x[0-9a-f]{8}\): file is corrupted")


def _item(data: bytes, kind: str, name: str) -> dict:
    return next(e for e in raw_layout(data)[1][kind] if e["name"] == name)


def test_bit_flip_in_part(archive_bytes):
    p = _item(archive_bytes, "parts", "kernels")
    data = bytearray(archive_bytes)
    data[p["offset"] + 5] ^= 0x04
    msg = r"checksum mismatch in part 'kernels' \(stored crc32 0x[0-9a-f]{8}, computed 0x[0-9a-f]{8}\): file is corrupted"
    refuse(bytes(data), msg)
    a = read_archive(bytes(data), verify=False)  # deferred: opening works, reading that part does not
    assert a.part("program") == sample()[1]["program"]
    with pytest.raises(ArchiveError, match=msg):
        a.part("kernels")


def test_bit_flip_in_weight(archive_bytes):
    w = _item(archive_bytes, "weights", "ln.weight")
    data = bytearray(archive_bytes)
    data[w["offset"] + 3] ^= 0x80
    refuse(bytes(data), r"checksum mismatch in weight 'ln\.weight' \(stored crc32 0x[0-9a-f]{8}, "
                        r"computed 0x[0-9a-f]{8}\): file is corrupted")
    a = read_archive(bytes(data), verify=False)  # verify=False trusts weight bytes as they are
    assert a.weights["ln.weight"][0].item() == -sample()[2]["ln.weight"][0].item()


def test_appended_bytes(archive_bytes):
    refuse(archive_bytes + b"\x00", "archive has 1 unexpected bytes after its recorded end")


def test_not_a_regular_file_or_missing(tmp_path):
    refuse(tmp_path, "not a regular file")
    refuse(tmp_path / "absent.aotf", "cannot open archive .*absent.aotf")
    fifo = tmp_path / "fifo"
    if hasattr(os, "mkfifo"):
        os.mkfifo(fifo)
        refuse(fifo, "not a regular file")  # and does not block waiting for a writer
    with pytest.raises(ArchiveError, match="cannot read an archive from a int"):
        read_archive(3)


# ---------------------------------------------------------------- hostile (re-signed) tables

def _toc(data: bytes) -> dict:
    return raw_layout(data)[1]


def _edit(data: bytes, kind: str, which: str, **fields) -> bytes:
    toc = _toc(data)
    for e in toc[kind]:
        if e["name"] == which:
            e.update(fields)
    return forge(data, toc)


def test_forge_helper_round_trips(archive_bytes):
    assert forge(archive_bytes, _toc(archive_bytes)) == archive_bytes


@pytest.mark.parametrize("kind, name, fields, match", [
    ("weights", "ln.weight", {"dtype": "object"}, r"weight 'ln\.weight' has dtype 'object', not one of"),
    ("weights", "ln.weight", {"dtype": 5}, "has dtype 5"),
    ("weights", "ln.weight", {"shape": [3]}, r"is float32\[3\] = 12 bytes but records nbytes=32"),
    ("weights", "ln.weight", {"shape": [-8]}, "has shape"),
    ("weights", "ln.weight", {"shape": [True] * 8}, "has shape"),
    ("weights", "empty", {"shape": [0] + [2**40] * 3}, "too many elements"),
    ("weights", "ln.weight", {"offset": 65}, "not 64-byte aligned"),
    ("weights", "ln.weight", {"offset": 0}, "overlaps the header/table of contents"),
    ("weights", "ln.weight", {"offset": 2**62}, r"archive truncated: weight 'ln\.weight' spans bytes"),
    ("weights", "ln.weight", {"offset": -64}, "expected an integer in 0"),
    ("weights", "ln.weight", {"nbytes": 2**64 - 1}, "field 'nbytes' is 18446744073709551615"),
    ("weights", "ln.weight", {"crc32": 2**32}, "field 'crc32'"),
    ("weights", "ln.weight", {"name": ""}, "expected a non-empty string"),
    ("weights", "ln.weight", {"name": "emb"}, "two weights named 'emb'"),
    ("weights", "ln.weight", {"extra": 1}, r"unknown fields \['extra'\]"),
    ("parts", "kernels", {"codec": "pickle"}, "uses codec 'pickle'"),
    ("parts", "kernels", {"raw_len": 2**40}, "over the 1073741824-byte cap"),
    ("parts", "kernels", {"raw_len": 5}, "frame declares 768 bytes but the table records 5"),
    ("parts", "kernels", {"stored_len": 2**20}, "archive truncated: part 'kernels'"),
])
def test_hostile_table_fields(archive_bytes, kind, name, fields, match):
    refuse(_edit(archive_bytes, kind, name, **fields), match)


def test_hostile_overlapping_items(archive_bytes):
    a, b = _toc(archive_bytes)["weights"][:2]
    refuse(_edit(archive_bytes, "weights", b["name"], offset=a["offset"]), "overlaps weight")


def test_hostile_decompression_is_bounded(archive_bytes):
    # A tiny frame that expands to 1 MiB while the table claims 100 bytes: python-zstandard would
    # allocate what the frame declares, so the reader must refuse before decompressing.
    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(1 << 20))
    toc = _toc(archive_bytes)
    p = next(e for e in toc["parts"] if e["name"] == "kernels")
    assert len(bomb) <= p["stored_len"]  # fits where the kernels part was
    data = bytearray(archive_bytes)
    data[p["offset"]:p["offset"] + len(bomb)] = bomb
    p.update(stored_len=len(bomb), crc32=zlib.crc32(bomb), raw_len=100)
    refuse(forge(bytes(data), toc), "frame declares 1048576 bytes but the table records 100")


def test_hostile_garbage_frame_and_bool_bytes(archive_bytes):
    p = _item(archive_bytes, "parts", "sources")
    data = bytearray(archive_bytes)
    data[p["offset"]:p["offset"] + 4] = b"\x00\x00\x00\x00"
    toc = _toc(archive_bytes)
    next(e for e in toc["parts"] if e["name"] == "sources")["crc32"] = zlib.crc32(
        bytes(data[p["offset"]:p["offset"] + p["stored_len"]]))
    refuse(forge(bytes(data), toc), "part 'sources' is not a valid zstd frame")
    w = _item(archive_bytes, "weights", "mask")
    data = bytearray(archive_bytes)
    data[w["offset"]] = 2
    toc = _toc(archive_bytes)
    next(e for e in toc["weights"] if e["name"] == "mask")["crc32"] = zlib.crc32(
        bytes(data[w["offset"]:w["offset"] + w["nbytes"]]))
    refuse(forge(bytes(data), toc), "bool weight 'mask' holds bytes other than 0 and 1")


@pytest.mark.parametrize("toc, match", [
    ([], "table of contents is a list, expected a map"),
    ({"manifest": {}, "parts": []}, r"missing fields \['weights'\]"),
    ({"manifest": [], "parts": [], "weights": []}, "manifest is not a map"),
    ({"manifest": {}, "parts": {}, "weights": []}, "'parts' in table of contents is not a list"),
    ({"manifest": {1: 2}, "parts": [], "weights": []}, "int is not allowed for map key"),
    ({"manifest": {b"k": 2}, "parts": [], "weights": []}, "map key b'k' in table of contents is not a string"),
    ({"manifest": {}, "parts": [7], "weights": []}, "part #0 is a int, expected a map"),
])
def test_hostile_table_shapes(archive_bytes, toc, match):
    refuse(forge(archive_bytes, toc), match)


@pytest.mark.parametrize("packed, match", [
    (b"\xc1", "does not decode"),  # the one reserved msgpack byte
    (b"\xd4\x01\x00", "does not decode"),  # an ext type: never allowed in a table
    (b"\xd6\xff\x00\x00\x00\x00", "does not decode"),  # msgpack timestamp ext
    (msgpack.packb({"a": 1}) + b"\x00", "does not decode"),  # trailing data
    (b"\xa2\xff\xfe", "does not decode"),  # invalid UTF-8 string
    (b"\x83\xa8manifest\x80\xa8manifest\x80\xa5parts\x90", "duplicate key 'manifest'"),
    (b"\x91" * 5000 + b"\x90", "does not decode"),  # nesting past msgpack's stack
    (b"\xdd\xff\xff\xff\xff", "does not decode"),  # array claiming 4G elements in 5 bytes
])
def test_hostile_table_bytes(packed, match):
    refuse(_resign_raw_table(packed), match)


def _resign_raw_table(packed: bytes) -> bytes:
    body = packed + bytes((-(64 + len(packed))) % 64)
    size = 64 + len(body)
    head = HEADER.pack(MAGIC, 1, 64, len(packed), size, zlib.crc32(packed), 0, bytes(20), 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(head)) + body


# ---------------------------------------------------------------- fuzzing

@pytest.fixture(scope="module")
def fuzz_base() -> bytes:
    m, p, w = sample()
    return write_archive({"k": [1, 2, "x"]}, {"program": p["program"][:64], "report": b""},
                         {k: w[k] for k in ("ln.weight", "emb", "mask", "scalar", "empty", "ids")})


_pos = st.integers(0, 1 << 16)
_mutation = st.one_of(
    st.tuples(st.just("flip"), _pos, st.integers(0, 7)),
    st.tuples(st.just("overwrite"), _pos, st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("truncate"), _pos, st.just(b"")),
    st.tuples(st.just("insert"), _pos, st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), _pos, st.integers(1, 64)),
    st.tuples(st.just("splice_head"), _pos, st.binary(min_size=1, max_size=32)),
    st.tuples(st.just("flip_head"), _pos, st.integers(0, 7)),
)


def _mutate(data: bytes, muts, head_len: int) -> bytes:
    b = bytearray(data)
    for op, pos, arg in muts:
        n = max(len(b), 1)
        if op == "flip" and b:
            b[pos % n] ^= 1 << arg
        elif op == "flip_head" and b:
            b[pos % min(n, head_len)] ^= 1 << arg
        elif op == "overwrite":
            b[pos % n:pos % n + len(arg)] = arg
        elif op == "truncate":
            del b[pos % n:]
        elif op == "insert":
            b[pos % n:pos % n] = arg
        elif op == "delete":
            del b[pos % n:pos % n + arg]
        elif op == "splice_head":  # header and table are where parsing logic lives
            at = pos % min(n, head_len)
            b[at:at + len(arg)] = arg
    return bytes(b)


@settings(max_examples=1000, deadline=2000, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(muts=st.lists(_mutation, min_size=1, max_size=4), verify=st.booleans())
def test_fuzz_mutated_archives_raise_only_archive_error(fuzz_base, muts, verify):
    _, _, toc_end = raw_layout(fuzz_base)
    mutated = _mutate(fuzz_base, muts, toc_end)
    result = exercise(mutated, verify=verify)  # anything but ArchiveError propagates and fails
    if result == "ok" and mutated != fuzz_base:
        # Accepted only if every change hit unprotected padding (or, unverified, weight bytes).
        assert len(mutated) == len(fuzz_base)
        spans = covered_spans(fuzz_base)
        if not verify:
            _, toc, _ = raw_layout(fuzz_base)
            weight_spans = {(w["offset"], w["offset"] + w["nbytes"]) for w in toc["weights"]}
            spans = [s for s in spans if s not in weight_spans]
        changed = [i for i in range(len(mutated)) if mutated[i] != fuzz_base[i]]
        assert not any(lo <= i < hi for i in changed for lo, hi in spans), (muts, changed)


_msgpack_int = st.integers(-(2**63), 2**64 - 1)
_hostile_value = st.one_of(
    st.none(), st.booleans(), _msgpack_int,
    st.sampled_from([0, 1, 63, 64, 128, 2**31, 2**32, 2**62, 2**63 - 1]),
    st.floats(allow_nan=False), st.text(max_size=6), st.binary(max_size=6),
    st.lists(st.integers(-2, 2**40), max_size=4), st.lists(st.sampled_from([0, 1, 2, 3]), max_size=3),
    st.sampled_from(["float32", "bool", "bfloat16", "object", "float128", "", "zstd", "gzip"]),
    st.dictionaries(st.text(max_size=3), _msgpack_int, max_size=2),
)

@settings(max_examples=400, deadline=2000, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_hostile_signed_tables(fuzz_base, data):
    """Tables with valid checksums but hostile values: validation, not the crc, must refuse."""
    toc = _toc(fuzz_base)
    blob = bytearray(fuzz_base)
    for _ in range(data.draw(st.integers(1, 3))):
        # "set" dominates: replacing one field of a well-formed entry reaches the deepest checks.
        op = data.draw(st.sampled_from(["set"] * 6 + ["delete", "duplicate", "top", "rewrite_bytes"] * 1))
        kind = data.draw(st.sampled_from(["parts", "weights"]))
        entries = toc.get(kind) if type(toc) is dict else None
        if type(entries) is not list or not entries:
            continue
        i = data.draw(st.integers(0, len(entries) - 1))
        e = entries[i]
        if op == "set" and type(e) is dict:
            e[data.draw(st.sampled_from(sorted(e) * 4 + ["bogus"]))] = data.draw(_hostile_value)
        elif op == "delete" and type(e) is dict and e:
            e.pop(data.draw(st.sampled_from(sorted(e))))
        elif op == "duplicate":
            entries.append(dict(e) if type(e) is dict else e)
        elif op == "top":
            toc[data.draw(st.sampled_from(["manifest", "parts", "weights", "x"]))] = data.draw(_hostile_value)
        elif op == "rewrite_bytes" and type(e) is dict and {"offset", "crc32"} <= set(e):
            # Replace the item's bytes with random ones and sign them: decoders see garbage.
            n = e.get("stored_len", e.get("nbytes"))
            if type(n) is int and type(e["offset"]) is int and 0 < n and e["offset"] + n <= len(blob):
                junk = data.draw(st.binary(min_size=n, max_size=n))
                blob[e["offset"]:e["offset"] + n] = junk
                e["crc32"] = zlib.crc32(junk)
    forged = forge(bytes(blob), toc)
    exercise(forged, verify=True)
    exercise(forged, verify=False)


# ---------------------------------------------------------------- golden

GOLDEN_ZSTD = (1, 5, 7)  # libzstd that wrote the committed golden; compressed bytes may differ across versions


def test_golden_loads_with_exact_contents():
    with read_archive(GOLDEN) as a:
        assert a.format_version == 1
        assert a.size == GOLDEN.stat().st_size == 2180
        assert a.manifest == {
            "name": "golden-v1-small",
            "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1],
            "floats": [0.5, -2.25, 1e300],
            "flag": True,
            "nothing": None,
            "blob": b"\x00\x01\xfe\xff",
            "nested": {"a": "\u00fcnicode \u2713", "b": [1, {"c": "d"}]},
        }
        assert a.part_names == ("kernels", "program", "report", "sources")
        assert a.part("program") == b"PROGRAM v1\n" + bytes(range(256))
        assert a.part("kernels") == bytes(range(256)) * 8
        assert a.part("sources") == b"def kernel():\n    return 42\n" * 20
        assert a.part("report") == b""
        w = a.weights
        assert list(w) == ["codes", "emb.weight", "empty", "ln.bias", "ln.weight", "mask", "pos", "scale"]
        expect = {
            "codes": (torch.uint8, [4], [0, 1, 127, 255]),
            "emb.weight": (torch.float32, [3, 4], [[0.0, 0.25, 0.5, 0.75], [1.0, 1.25, 1.5, 1.75],
                                                   [2.0, 2.25, 2.5, 2.75]]),
            "empty": (torch.float32, [0, 4], []),
            "ln.bias": (torch.float16, [3], [0.25, -0.125, 65504.0]),
            "ln.weight": (torch.bfloat16, [4], [1.0, 0.5, -2.0, 3.0]),
            "mask": (torch.bool, [2, 2], [[True, False], [False, True]]),
            "pos": (torch.int64, [4], [-(2**63), -1, 0, 2**63 - 1]),
            "scale": (torch.float32, [], 0.125),
        }
        for name, (dtype, shape, values) in expect.items():
            assert w[name].dtype == dtype, name
            assert list(w[name].shape) == shape, name
            assert w[name].tolist() == values, name
        assert a.weights_bytes == 4 + 48 + 0 + 6 + 8 + 4 + 32 + 4


def test_golden_is_what_the_script_writes(tmp_path):
    """The writer's bytes for v1 must not drift; regenerate only with a format version bump."""
    if zstandard.ZSTD_VERSION[:3] != GOLDEN_ZSTD:
        pytest.skip(f"libzstd {zstandard.ZSTD_VERSION} may compress differently from {GOLDEN_ZSTD}")
    spec = importlib.util.spec_from_file_location("make_golden_archive", ROOT / "scripts" / "make_golden_archive.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "g.aotf"
    assert mod.main(["make_golden_archive.py", str(out)]) == 0
    assert out.read_bytes() == GOLDEN.read_bytes()
    assert mod.main(["make_golden_archive.py", str(out)]) == 0  # rerun: byte-identical
    assert out.read_bytes() == GOLDEN.read_bytes()
