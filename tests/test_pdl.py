"""Programmatic dependent launch (emit/pdl.py, runtime/launch_pdl.py): where the wait and the release go,
which binaries get them, how the archive records them, and (GPU) that launching so changes no result."""
from __future__ import annotations

import ctypes

import msgpack
import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.archive import read_archive
from aotfuse.contract.kernels import Binary
from aotfuse.contract.program import PDL_VERSION
from aotfuse.emit.pdl import RELEASE, WAIT, with_grid_dependency
from aotfuse.errors import ArchiveError
from aotfuse.knobs import knobs, override
from aotfuse.runtime.interpret import check_source
from aotfuse.runtime.launch_pdl import LaunchAttribute, LaunchConfig


def _part(data: bytes, name: str):
    p = read_archive(data).part(name)
    return msgpack.unpackb(p, raw=False) if isinstance(p, (bytes, bytearray, memoryview)) else p


def test_wait_first_release_before_the_first_top_level_store():
    body = "\n".join(["    x = tl.program_id(0)",
                      "    for r in range(4):",
                      "        tl.store(out_ptr0 + r, x)",
                      "    v = tl.load(in_ptr0 + x)",
                      "    tl.store(out_ptr1 + x, v)",
                      "    tl.store(out_ptr2 + x, v)"])
    params, out = with_grid_dependency("in_ptr0, out_ptr0, out_ptr1, out_ptr2", body)
    lines = out.split("\n")
    assert params.endswith("out_ptr2, AOTF_PDL: tl.constexpr = False")
    assert lines[:2] == ["    if AOTF_PDL:", f"        {WAIT}"]  # before anything touches memory
    assert lines.count(f"        {RELEASE}") == 1
    i = lines.index(f"        {RELEASE}")
    # after the loop's stores (nested: no release inside a loop), just before the first top-level store
    assert lines[i + 1] == "    tl.store(out_ptr1 + x, v)" and lines[i - 2] == "    v = tl.load(in_ptr0 + x)"


def test_only_nested_stores_release_at_exit():
    body = "    for t in range(0, 8, 1):\n        c_desc.store([t, 0], acc)"
    _, out = with_grid_dependency("a", body)
    assert WAIT in out and RELEASE not in out


def test_descriptor_store_and_atomics_count_as_stores():
    for store in ("    c_desc.store([0, 0], acc)", "    tl.atomic_add(out_ptr0 + x, v)"):
        _, out = with_grid_dependency("a", f"    x = 1\n{store}")
        assert out.split("\n")[-2] == f"        {RELEASE}"


def test_stored_source_check_accepts_exactly_the_pdl_parameter():
    ok = ("import triton\nimport triton.language as tl\n"
          "from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait\n"
          "@triton.jit\ndef k(in_ptr0, out_ptr0, AOTF_PDL: tl.constexpr = False):\n    pass\n")
    check_source("k", ok, ["in_ptr0", "out_ptr0"])
    for bad in (ok.replace("= False", "= True"), ok.replace("AOTF_PDL: tl.constexpr", "AOTF_PDL"),
                ok.replace("AOTF_PDL: tl.constexpr = False", "AOTF_PDL: tl.constexpr = print('x')"),
                ok.replace("out_ptr0, AOTF_PDL", "out_ptr0: tl.constexpr = 1, AOTF_PDL"),
                # the switch anywhere but last would shift the launch's arguments
                ok.replace("k(in_ptr0, out_ptr0, AOTF_PDL: tl.constexpr = False)",
                           "k(in_ptr0, AOTF_PDL: tl.constexpr = False, out_ptr0)")):
        with pytest.raises(ArchiveError):
            check_source("k", bad, ["in_ptr0", "out_ptr0"])


def test_launch_structs_match_cuda_h():
    # cuda.h (CUDA 12): CUlaunchAttribute is 72 bytes (id, 4 bytes of padding, a 64-byte union);
    # CUlaunchConfig has hStream at 32, attrs at 40, numAttrs at 48
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert (LaunchConfig.hStream.offset, LaunchConfig.attrs.offset, LaunchConfig.numAttrs.offset) == (32, 40, 48)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 48), nn.LayerNorm(48)).eval()


def test_sm90_binaries_have_the_wait_sm80_do_not():
    m, x = _mlp(), torch.randn(6, 48)
    with override(pdl=True):
        res = aotfuse.build(m, (x,), targets=("sm_80", "sm_90"))
    kernels = _part(res.data, "kernels")
    assert kernels
    for name, k in kernels.items():
        assert k["binaries"]["sm_90"].get("pdl") is True, name
        assert "pdl" not in k["binaries"]["sm_80"], name
    assert _part(res.data, "program.forward")["version"] == PDL_VERSION
    # the CPU path runs the stored source with the switch off (the interpreter has no griddepcontrol)
    art = aotfuse.load(res.data, device="cpu")
    torch.testing.assert_close(art(x), m(x), rtol=1e-5, atol=1e-5)


def test_default_builds_plain_kernels():
    """PDL is opt-in (knobs.pdl): a default build keeps plain kernels and its program version."""
    if knobs.pdl:
        pytest.skip("AOTFUSE_PDL=1 in the environment")
    m, x = _mlp(), torch.randn(6, 48)
    res = aotfuse.build(m, (x,), targets=("sm_90",))
    assert all("pdl" not in b for k in _part(res.data, "kernels").values() for b in k["binaries"].values())
    assert _part(res.data, "program.forward")["version"] == 4
    # the sources are the plain kernels an older runtime's source check accepts
    assert not any("AOTF_PDL" in src or "gdc_wait" in src for src in _part(res.data, "sources").values())


def test_pdl_sources_without_an_sm90_binary_still_raise_the_version():
    """sm_80 only with the knob on: no binary has the wait, but the sources take the PDL parameter, which an older
    runtime's source check would refuse: version 7 all the same."""
    m, x = _mlp(), torch.randn(6, 48)
    with override(pdl=True):
        res = aotfuse.build(m, (x,), targets=("sm_80",))
    assert all("pdl" not in b for k in _part(res.data, "kernels").values() for b in k["binaries"].values())
    assert any("AOTF_PDL" in src for src in _part(res.data, "sources").values())
    assert _part(res.data, "program.forward")["version"] == PDL_VERSION


def test_knob_off_builds_plain_kernels():
    m, x = _mlp(), torch.randn(6, 48)
    with override(pdl=False):
        res = aotfuse.build(m, (x,), targets=("sm_90",))
    kernels = _part(res.data, "kernels")
    assert all("pdl" not in b for k in kernels.values() for b in k["binaries"].values())
    assert _part(res.data, "program.forward")["version"] < PDL_VERSION


def test_binary_field_round_trips_and_is_checked():
    b = Binary(b"\x01", "k", 4, 0, 0, 0, pdl=True)
    d = b.to_dict()
    assert d["pdl"] is True and Binary.from_dict(d) == b
    assert "pdl" not in Binary(b"\x01", "k", 4, 0, 0, 0).to_dict()
    with pytest.raises(ArchiveError, match="pdl must be a boolean"):
        Binary.from_dict({**d, "pdl": 1})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_launches_match_plain_launches_bit_for_bit():
    """One archive run with PDL launches and with plain ones (graphs and no graphs): identical results."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    torch.manual_seed(0)
    # a matmul extern (cuBLAS) between kernels: "kernels" launches the kernel after it plainly
    m = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.LayerNorm(256),
                      nn.Linear(256, 256), nn.Softmax(-1)).eval()
    x = torch.randn(64, 128, 256)
    with override(pdl=True):
        res = aotfuse.build(m, (x,), targets=("sm_90",))
    assert any(b.get("pdl") for k in _part(res.data, "kernels").values() for b in k["binaries"].values())
    xs = [torch.randn(64, 128, 256, device="cuda") for _ in range(3)]
    outs = {}
    for launch in ("kernels", "all", "off"):
        for graphs in (True, False):
            with override(pdl_launch=launch):
                art = aotfuse.load(res.data, device="cuda", cuda_graphs=graphs)
                got = [art(xi).clone() for xi in xs]  # graph replays (or launches) on fresh inputs
                torch.cuda.synchronize()
            outs[launch, graphs] = got
    ref = outs["off", False]
    for key, got in outs.items():
        for a, b in zip(got, ref):
            assert torch.equal(a, b), key
    m = m.cuda()
    with torch.no_grad():
        for xi, r in zip(xs, ref):
            torch.testing.assert_close(r, m(xi), rtol=2e-3, atol=2e-3)


def test_unknown_launch_mode_is_refused_before_anything_runs():
    m, x = _mlp(), torch.randn(6, 48)
    with override(pdl=True):
        res = aotfuse.build(m, (x,), targets=("sm_90",))
    if not torch.cuda.is_available():
        pytest.skip("the launch mode is read where kernels are loaded, on CUDA")
    with override(pdl_launch="sometimes"), pytest.raises(Exception, match="AOTFUSE_PDL_LAUNCH"):
        aotfuse.load(res.data, device="cuda")
