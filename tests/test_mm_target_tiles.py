"""Matmul templates with each target's own tiles: an archive for sm_80 and sm_90 (the default targets)
compiles a template from one source per distinct tile configuration (emit/mm_configs.target_configs), the
sm_90 binary records its own grid and programs per SM (contract/kernels.Binary, program version 6), the
cost model prices the newest target, and the CPU path runs the lowest target's source with eager's numbers."""
from __future__ import annotations

import msgpack
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.archive import read_archive
from aotfuse.contract.kernels import Binary, KernelEntry
from aotfuse.contract.program import PDL_VERSION, TILES_VERSION
from aotfuse.errors import ArchiveError
from aotfuse.knobs import knobs, override
from aotfuse.runtime.validate import validate_program
from aotfuse.runtime.validate_kernels import validate_kernels
from aotfuse.testing.train_check import assert_half_training_close


class MLP(nn.Module):
    def __init__(self, d=48, hidden=136):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(x), approximate="tanh"))
        return (y.float() * y.float()).mean()


def _part(data: bytes, name: str):
    p = read_archive(data).part(name)
    return msgpack.unpackb(p, raw=False) if isinstance(p, (bytes, bytearray, memoryview)) else p


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_each_target_its_own_tiles():
    """A persistent AOTFUSE_MM_CONFIG (two programs per SM) on sm_90 is one program per tile on sm_80: two
    sources under one kernel name, the sm_90 binary with its own persistence, every program version 6, and the
    CPU path (sm_80's source) gives eager's loss and gradients."""
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    x = torch.randn(2, 40, 48, dtype=torch.bfloat16)
    with override(mm="template", mm_config="64,64,32,8,4,3,2"):
        res = aotfuse.build(model, (x,), train=True, targets=("sm_80", "sm_90"))
    kernels = _part(res.data, "kernels")
    sources = _part(res.data, "sources")
    tmpl = {n: k for n, k in kernels.items() if k["kind"] == "template_mm"}
    assert tmpl
    for name, k in tmpl.items():
        b80, b90 = k["binaries"]["sm_80"], k["binaries"]["sm_90"]
        assert "persistent" not in k and "persistent" not in b80  # the entry is sm_80's: one program per tile
        assert b90["persistent"] == 2, b90.keys()
        # sm_90's function has its own name (its text is not the stored one, so it never takes its pseudo-path)
        assert b80["name"] == name and b90["name"] == f"{name}_sm_90"
        # the stored source (the CPU path's) is sm_80's: a program per tile, no tile loop
        assert "tl.program_id(0)" in sources[name] and "num_programs" not in sources[name]
    for prog in ("forward", "backward"):
        assert _part(res.data, f"program.{prog}")["version"] == (PDL_VERSION if knobs.pdl else TILES_VERSION)
    whys = [(g.blocks or {}).get("why", "") for g in res.report.groups if g.kind == "template"]
    assert whys and all(w.startswith("sm_80: ") and "; sm_90: " in w and "persistent" in w for w in whys), whys
    # the CPU path
    assert_half_training_close(res.data, model, (torch.randn(2, 40, 48, dtype=torch.bfloat16),))


def test_own_grid():
    """Wide N: sm_90's warp-specialized 128 x 256 tiles give half sm_80's 128 x 128 grid; the sm_90 binary
    records its grid (the launch's is sm_80's) and the CPU path matches eager."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 4096).to(torch.bfloat16)
    x = torch.randn(2048, 64, dtype=torch.bfloat16)
    with override(mm="template"):
        res = aotfuse.build(lin, (x,), targets=("sm_80", "sm_90"))
    (k,) = [k for k in _part(res.data, "kernels").values() if k["kind"] == "template_mm"]
    assert k["grid"] == [16 * 32, 1, 1] and "persistent" not in k
    b90 = k["binaries"]["sm_90"]
    assert b90["grid"] == [16 * 16, 1, 1] and b90["persistent"] == 1 and b90["num_warps"] == 12
    xs = torch.randn(2048, 64, dtype=torch.bfloat16)
    got = aotfuse.load(res.data, device="cpu")(xs)
    want, want32 = lin(xs), lin.float()(xs.float())
    assert _rel(got, want32) <= max(1e-2, 2 * _rel(want, want32))


def test_one_config_one_source():
    """Targets whose configurations agree share one source and binaries without their own tiles: the archive
    keeps its version (fp32 takes the table on both)."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(2, 40, 48)
    with override(mm="template"):
        res = aotfuse.build(model, (x,), targets=("sm_80", "sm_90"))
    kernels = _part(res.data, "kernels")
    assert any(k["kind"] == "template_mm" for k in kernels.values())
    for k in kernels.values():
        assert all("grid" not in b and "persistent" not in b for b in k["binaries"].values())
    # not raised for tiles (to 6); an sm_90 cubin with the PDL wait raises it to 7 (emit/pdl.py)
    pdl = any(b.get("pdl") for k in kernels.values() for b in k["binaries"].values())
    v = _part(res.data, "program.forward")["version"]
    assert v == PDL_VERSION if pdl else v < TILES_VERSION


def test_default_build_prices_sm90():
    """The defaults (AOTFUSE_MM=heavy, targets sm_80 and sm_90) at the anchor's MLP sizes: the dgrad with the
    GELU backward and fc1 with its GELU are templates, priced for sm_90; sm_90's binaries run two programs per
    SM, sm_80's one per tile (before per-target tiles the sm_80 pricing kept cuBLAS)."""
    model = MLP(768, 3072).to(torch.bfloat16)
    x = torch.randn(8, 1024, 768, dtype=torch.bfloat16)
    res = aotfuse.build(model, (x,), train=True, targets=("sm_80", "sm_90"))
    recs = [d for r in (res.report, res.report.backward) for d in r.lowering if d.get("choice") == "template"]
    assert len(recs) == 2 and all("priced for sm_90" in d["config_why"] for d in recs), recs
    kernels = _part(res.data, "kernels")
    tmpl = [k for k in kernels.values() if k["kind"] == "template_mm"]
    assert len(tmpl) == 2
    for k in tmpl:
        assert "persistent" not in k and k["binaries"]["sm_90"]["persistent"] == 2
        assert "grid" not in k["binaries"]["sm_90"] and k["grid"] == [64 * 24, 1, 1]  # 128 x 128 tiles on both


def test_own_tiles_round_trip_and_checks():
    b = Binary(b"\x01", "k", 12, 1024, 128, 0, grid=(264, 1, 1), persistent=2)
    assert Binary.from_dict(b.to_dict()) == b and b.own_tiles
    plain = Binary(b"\x01", "k", 8, 1024, 0, 0)
    assert set(plain.to_dict()) == {"cubin", "name", "num_warps", "shared", "global_scratch", "profile_scratch"}

    def entry(kind: str, bins: dict) -> dict:
        return KernelEntry(kind, ("mm",), (384, 1, 1), 8, 16384, 64, 384 * 16384, 1,
                           (), {a: x for a, x in bins.items()}).to_dict() | {
            "args": [{"name": "out_ptr0", "dtype": "bfloat16", "role": "out", "numel": 384 * 16384}]}

    ok = {"k": entry("template_mm", {"sm_80": plain, "sm_90": b})}
    validate_kernels(ok)  # 12 warps: three warpgroups of 4 (its own warp-specialized tiles)
    with pytest.raises(ArchiveError, match="only a matmul template's binary may have its own tiles"):
        validate_kernels({"k": entry("pointwise", {"sm_90": b})})
    bad = Binary(b"\x01", "k", 8, 1024, 0, 0, persistent=9)
    with pytest.raises(ArchiveError, match="persistent"):
        validate_kernels({"k": entry("template_mm", {"sm_90": bad})})
    prog = {"version": TILES_VERSION - 1, "inputs": [], "weights": {}, "arena_bytes": 0, "instructions": []}
    with pytest.raises(ArchiveError, match="has its own tiles"):
        validate_program("forward", prog, ok, {})


@pytest.mark.gpu
def test_default_targets_run_sm90_tiles_on_gpu():
    """The default targets (sm_80, sm_90) on a Hopper GPU: the MLP's heavy-epilogue templates at the anchor's
    sizes run sm_90's own tiles (persistent, two programs per SM) and give eager's loss and gradients."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90 rules")
    torch.manual_seed(0)
    model = MLP(768, 3072).to(torch.bfloat16)
    x = torch.randn(8, 1024, 768, dtype=torch.bfloat16)
    res = aotfuse.build(model, (x,), train=True, targets=("sm_80", "sm_90"))
    kernels = _part(res.data, "kernels")
    own = [k["binaries"]["sm_90"] for k in kernels.values() if k["kind"] == "template_mm"]
    assert own and all(b.get("persistent") == 2 for b in own), own
    xs = torch.randn(8, 1024, 768, dtype=torch.bfloat16, device="cuda")
    assert_half_training_close(res.data, model, (xs,), device="cuda")
