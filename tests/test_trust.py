"""Trust model: a deployment pins the archive it loads by SHA-256 (artifacts/FORMAT.md, "Trust model").

The digest covers the whole file and is checked before any byte of it is parsed.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import aotfuse
from aotfuse.archive import format as archive_format
from aotfuse.archive import read_archive
from aotfuse.cli import app
from aotfuse.errors import ArchiveError

GOLDEN = Path(__file__).resolve().parents[1] / "artifacts" / "golden"
MODEL = GOLDEN / "v1_model.aotf"
# Golden files are never regenerated in place (FORMAT.md), so their digest is fixed too.
MODEL_SHA256 = "e40fcc2718e03cb1e8b8fea124ee017447f8ede73a5bd7684eb8450403ff78cb"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _ids():
    return torch.tensor(json.loads((GOLDEN / "v1_model.json").read_text())["input"])


def test_golden_digest_is_pinned():
    assert digest(MODEL) == MODEL_SHA256


@pytest.mark.parametrize("as_bytes", [False, True], ids=["path", "bytes"])
def test_load_with_the_right_digest(as_bytes):
    src = MODEL.read_bytes() if as_bytes else MODEL
    art = aotfuse.load(src, device="cpu", sha256=digest(MODEL))
    ref = aotfuse.load(MODEL, device="cpu")
    for a, b in zip(art(_ids()), ref(_ids())):
        assert torch.equal(a, b)
    art = aotfuse.load(src, device="cpu", sha256=digest(MODEL).upper())  # hex digits, either case
    assert art.archive.sha256() == digest(MODEL)


def test_wrong_digest_is_refused_before_parsing(monkeypatch, tmp_path):
    def no_parsing(*a, **k):
        raise AssertionError("parsed an archive whose digest does not match")

    monkeypatch.setattr(archive_format, "parse_header", no_parsing)
    monkeypatch.setattr(archive_format, "unpack_toc", no_parsing)
    wrong = hashlib.sha256(b"another archive").hexdigest()
    with pytest.raises(ArchiveError, match=f"sha256 mismatch: expected {wrong}, got {digest(MODEL)}"):
        aotfuse.load(MODEL, device="cpu", sha256=wrong)
    with pytest.raises(ArchiveError, match="sha256 mismatch"):
        aotfuse.load(MODEL.read_bytes(), device="cpu", sha256=wrong)
    # A substituted file refused whatever it holds (here: not even an archive).
    junk = tmp_path / "m.aotf"
    junk.write_bytes(b"\x7fELF not an archive")
    with pytest.raises(ArchiveError, match="sha256 mismatch"):
        aotfuse.load(junk, device="cpu", sha256=digest(MODEL))


def test_one_flipped_byte_is_refused(tmp_path):
    data = bytearray(MODEL.read_bytes())
    data[len(data) // 2] ^= 1
    with pytest.raises(ArchiveError, match="sha256 mismatch"):
        read_archive(bytes(data), sha256=digest(MODEL))


@pytest.mark.parametrize("pin", ["", "abc", "z" * 64, 123, b"\x00" * 32, digest(MODEL) + "0"])
def test_malformed_pin_is_refused(pin):
    with pytest.raises(ArchiveError, match="sha256 pin must be 64 hex digits"):
        read_archive(MODEL, sha256=pin)


def test_inspect_prints_the_digest():
    info = aotfuse.inspect_archive(MODEL)
    assert info["sha256"] == digest(MODEL)
    runner = CliRunner()
    r = runner.invoke(app, ["inspect", str(MODEL), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["sha256"] == hashlib.sha256(MODEL.read_bytes()).hexdigest()
    r = runner.invoke(app, ["inspect", str(MODEL)])
    assert r.exit_code == 0, r.output
    assert f"sha256: {digest(MODEL)}" in r.stdout.splitlines()


def test_cli_run_refuses_a_wrong_pin():
    runner = CliRunner()
    r = runner.invoke(app, ["run", str(MODEL), "--device", "cpu", "--sha256", "0" * 64])
    assert r.exit_code == 2
    assert "sha256 mismatch" in r.output
    r = runner.invoke(app, ["run", str(MODEL), "--device", "cpu", "--sha256", digest(MODEL)])
    assert r.exit_code == 0, r.output
