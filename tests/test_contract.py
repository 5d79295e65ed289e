"""The typed contracts (aotfuse/contract): what the build writes is what the runtime reads.

Real builds (a small GPT, and its train variant) round-trip exactly: `from_dict(to_dict(x)) == x`
and `to_dict(from_dict(d)) == d` for the dicts stored in the archive, so the dataclasses are the
schema. A program newer than this aotfuse supports is refused at load with both versions named.
"""
from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest
import torch

import aotfuse
from aotfuse.archive import read_archive, write_archive
from aotfuse.contract import (MAX_SUPPORTED_VERSION, InputSpec, PROGRAM_VERSION, Alloc, Extern, Free, Launch, Manifest, Program,
                              Report, Return, TensorRef, TrainInfo, check_program_version, kernels_from_dict,
                              kernels_to_dict)
from aotfuse.errors import ArchiveError

_UNPACK = dict(raw=False, strict_map_key=False)


def _fake_compile(kernels, targets, workers, progress=None):
    """Round trips need the metadata, not real cubins: skip Triton's compiler."""
    from aotfuse.emit.compile import Binary

    return {k.name: {"sm_90": Binary("sm_90", b"not-a-cubin", k.name, k.num_warps, 0, 0, 0)} for k in kernels}


@pytest.fixture(scope="module")
def archives():
    from aotfuse.examples.gpt import GPT, GPTConfig, GPTWithLoss, _init

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("aotfuse.pipeline.compile_all", _fake_compile)
        for train in (False, True):
            cfg = GPTConfig(vocab=32, seq=4, dim=16, heads=2, layers=1, dropout=0.0)
            model = _init((GPTWithLoss if train else GPT)(cfg), seed=0)
            ids = torch.randint(0, 32, (2, 4), generator=torch.Generator().manual_seed(0))
            kw = {"step": "split"} if train else {}
            res = aotfuse.build(model.train(train), (ids, ids) if train else (ids,), train=train, targets=("sm_90",),
                                **kw)
            out["train" if train else "infer"] = res
            if train:
                out["step"] = aotfuse.build(model, (ids, ids), train=True, targets=("sm_90",), step="auto")
    return out


def _parts(data: bytes) -> tuple[dict, dict]:
    ar = read_archive(data)
    return ar.manifest, {n: msgpack.unpackb(ar.part(n), **_UNPACK) for n in ar.part_names if n != "sources"}


@pytest.mark.parametrize("which", ["infer", "train", "step"])
def test_real_build_round_trips(archives, which):
    res = archives[which]
    manifest, parts = _parts(res.data)
    m = Manifest.from_dict(manifest)
    assert Manifest.from_dict(m.to_dict()) == m
    assert write_archive(m.to_dict(), {}, {}) == write_archive(manifest, {}, {})  # the same canonical manifest
    assert (m.train is not None) == (which != "infer")
    if m.train is not None:
        assert isinstance(m.train, TrainInfo) and TrainInfo.from_dict(m.train.to_dict()) == m.train
        assert m.train.user_inputs == m.inputs and m.programs == m.train.programs
        assert m.programs == (("step",) if which == "step" else ("forward", "backward"))
        assert m.train.mode == ("step" if which == "step" else "split")
        assert len(m.train.scale_kernels) == (len(m.train.grads) if which == "step" else 0)
    for name in m.programs:
        d = parts[f"program.{name}"]
        p = Program.from_dict(d, name)
        assert p.to_dict() == d and Program.from_dict(p.to_dict()) == p
        assert msgpack.packb(p.to_dict(), use_bin_type=True) == read_archive(res.data).part(f"program.{name}")
        assert p.version == PROGRAM_VERSION and isinstance(p.instructions[-1], Return)
        assert {type(i) for i in p.instructions} >= {Alloc, Launch, Extern, Return}
    k = kernels_from_dict(parts["kernels"])
    assert kernels_to_dict(k) == parts["kernels"] and sorted(k) == list(m.kernels)
    assert msgpack.packb(kernels_to_dict(k), use_bin_type=True) == read_archive(res.data).part("kernels")
    rep = Report.from_dict(parts["report"])
    assert rep == res.report and rep.to_dict() == parts["report"] and Report.from_dict(rep.to_dict()) == rep
    assert (rep.backward is not None) == (which == "train") and (rep.partition is not None) == (which != "infer")


def test_loaded_artifact_exposes_the_typed_payload(archives):
    art = aotfuse.load(archives["train"].data, device="cpu")
    assert isinstance(art.manifest, Manifest) and art.manifest.train.n_saved >= 0
    assert set(art.programs) == {"forward", "backward"} and all(isinstance(p, Program) for p in art.programs.values())
    assert len(art.input_specs) == 2 and all(isinstance(s, InputSpec) for s in art.input_specs)
    assert art.input_specs == art.manifest.train.user_inputs


def _with_version(data: bytes, version) -> bytes:
    ar = read_archive(data)
    parts = {n: ar.part(n) for n in ar.part_names}
    prog = msgpack.unpackb(parts["program.forward"], **_UNPACK)
    prog["version"] = version
    prog["a_field_from_the_future"] = 1
    parts["program.forward"] = msgpack.packb(prog, use_bin_type=True)
    return write_archive(ar.manifest, parts, dict(ar.weights))


def test_a_newer_program_is_refused_naming_both_versions(archives):
    newer = MAX_SUPPORTED_VERSION + 1
    data = _with_version(archives["infer"].data, newer)
    for read in (lambda: aotfuse.load(data, device="cpu"), lambda: aotfuse.inspect_archive(data)):
        with pytest.raises(ArchiveError) as e:
            read()
        msg = str(e.value)
        assert f"program version {newer} is newer than this aotfuse supports (1..{MAX_SUPPORTED_VERSION})" in msg
        assert e.value.remedy == "upgrade aotfuse to read it" and "program 'forward'" in msg


@pytest.mark.parametrize("v,match", [(0, "older than this aotfuse supports"), ("2", "not a version number"),
                                     (True, "not a version number"), (None, "not a version number")])
def test_bad_program_versions(v, match):
    with pytest.raises(ArchiveError, match=match):
        check_program_version(v)


def test_malformed_dicts_are_archive_errors_not_key_errors():
    good = Program(2, (), {}, {}, 0, None, (Free(("a",)), Return((TensorRef("a", (1,), (1,), 0),))))
    d = good.to_dict()
    assert Program.from_dict(d) == good
    for bad in ({**d, "instructions": [{"op": "free"}]},            # missing field
                {**d, "instructions": [{"op": "free", "bufs": 3}]},  # wrong type
                {**d, "instructions": [{"op": "exec"}]},             # unknown op
                {**d, "extra": 1},                                   # unknown field
                {**d, "inputs": [[1, 2]]}):
        with pytest.raises(ArchiveError):
            Program.from_dict(bad)
    for bad in ({"format": "aotfuse"}, {"format": "aotfuse", "programs": 1, "inputs": [], "outputs": []}, []):
        with pytest.raises(ArchiveError):
            Manifest.from_dict(bad)
    with pytest.raises(ArchiveError):
        kernels_from_dict({"k": {"kind": "pointwise"}})
    with pytest.raises(ArchiveError, match="part 'report': missing field 'fusion'"):
        Report.from_dict({"fusion_summary": {}, "surprise": 1})


def test_contract_is_stdlib_only():
    code = ("import sys, aotfuse.contract; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'msgpack', 'sympy')); "
            "print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
