"""Dynamic dims, the contract and runtime side (issue 10): size expressions, version 5 programs,
manifest dims, the guards that bind dims, per-shape executors, load-time validation, inspect.

The compiler does not emit dynamic archives yet, so the end-to-end tests write one by hand
(`_payload`): two Triton kernels that take their sizes as int32 arguments, an allow-listed matmul
extern and an arena whose offsets are expressions of the rows `s0`, run on the CPU path at several
shapes against eager (shapes that are not multiples of the block, and the range ends).
"""
from __future__ import annotations

import copy
import time

import msgpack
import pytest
import torch

import aotfuse
from aotfuse.archive import read_archive, write_archive
from aotfuse.contract.program import PDL_VERSION
from aotfuse.contract import (DIMS_VERSION, PROGRAM_VERSION, Alloc, DimSpec, Extern, Free, InputSpec, KernelArg,
                              KernelEntry, Launch, Manifest, OutputSpec, Program, ProgramInput, Return, TensorRef,
                              WeightSpec, check_size, compile_size, evaluate, free_dims, kernels_from_dict,
                              kernels_to_dict, program_dims, specialize, specialize_kernel)
from aotfuse.contract.kernels import Binary
from aotfuse.errors import AotfuseError, ArchiveError, GuardError
from aotfuse.knobs import knobs, override
from aotfuse.runtime.dims import bind_dims, dims_env, shape_at

_UNPACK = dict(raw=False, strict_map_key=False)


# ---------------------------------------------------------------- size expressions

@pytest.mark.parametrize("text,env,want", [
    ("s0", {"s0": 7}, 7),
    ("cdiv(s0 * 4, 16)", {"s0": 17}, 5),
    ("cdiv(s0, 16) * 16", {"s0": 16}, 16),
    ("max(s0, s1, 3) - min(s0, s1)", {"s0": 2, "s1": 9}, 7),
    ("s0 // 3 + s0 % 3", {"s0": 11}, 5),
    ("-s0 + 2 * (s1 + 1)", {"s0": 4, "s1": 5}, 8),
    ("(s0 * s1) // 2", {"s0": 3, "s1": 3}, 4),
    ("12", {}, 12),
])
def test_size_expressions_evaluate(text, env, want):
    assert evaluate(text, env) == want
    assert compile_size(text)(env) == want
    assert check_size(text) == text
    assert evaluate(5, env) == 5 and compile_size(5)({}) == 5


def test_size_expressions_are_compiled_once_per_string():
    assert compile_size("s0 * 3 + 1") is compile_size("s0 * 3 + 1")
    assert free_dims("cdiv(s0 * s12, 4) + max(s3, 1)") == {"s0", "s3", "s12"} and free_dims(4) == frozenset()


@pytest.mark.parametrize("bad,why", [
    ("__import__('os')", "calls '__import__'"),
    ("s0.real", "Attribute"),
    ("(1).bit_length()", "calls"),
    ("1.5", "float literal"),
    ("s0 * 0.5", "float literal"),
    ("True", "bool literal"),
    ("s0 ** 2", "Pow"),
    ("s0 / 2", "Div"),
    ("x + 1", "names 'x'"),
    ("s", "names 's'"),
    ("s0 < s1", "Compare"),
    ("s0 if s1 else 2", "IfExp"),
    ("[s0][0]", "Subscript"),
    ("lambda: 1", "Lambda"),
    ("max(*s0)", "max"),
    ("cdiv(s0)", "cdiv with 1 arguments"),
    ("max(s0, key=s1)", "only max"),
    ("~s0", "Invert"),
    ("s0 +", "does not parse"),
    ("", "0 characters"),
    ("-" * 900 + "s0", "nested too deeply"),
])
def test_size_expressions_refuse_anything_else(bad, why):
    with pytest.raises(ArchiveError, match="size expression") as e:
        check_size(bad, "launch grid")
    assert why in str(e.value) and "launch grid" in str(e.value) and e.value.remedy


@pytest.mark.parametrize("bad", [1.0, True, None, [1], b"s0"])
def test_a_size_is_an_int_or_a_string(bad):
    with pytest.raises(ArchiveError, match="expected an integer or a size expression"):
        check_size(bad)


def test_evaluation_errors_are_archive_errors():
    with pytest.raises(ArchiveError, match="divides by zero at s0=2, s1=2"):
        evaluate("s0 // (s1 - 2)", {"s0": 2, "s1": 2})
    with pytest.raises(ArchiveError, match="names a dim that is not bound"):
        evaluate("s0 + s4", {"s0": 1})


# ---------------------------------------------------------------- programs

def _ref(t, shape, stride, offset=0):
    return TensorRef(t, tuple(shape), tuple(stride), offset)


def _dyn_program() -> Program:
    """The program of the hand-written archive below: rows s0 of 4 features."""
    tmp_off, y_off = 0, "cdiv(s0 * 16, 256) * 256"
    return Program(PROGRAM_VERSION, (ProgramInput("in0", ("s0", 4), "float32"), ProgramInput("in1", ("s0", 3), "float32")),
                   {"w0": "w", "w1": "w2"}, {"w0": WeightSpec((4,), "float32"), "w1": WeightSpec((4, 3), "float32")},
                   "cdiv(s0 * 16, 256) * 256 + cdiv(s0 * 12, 256) * 256", None, (
                       Alloc("tmp", tmp_off, ("s0", 4), "float32"),
                       Launch("k_scale", ("cdiv(s0 * 4, 16)", 1, 1), ("in0", "w0", "tmp"), ("s0 * 4",)),
                       Alloc("sm", -1, ("s0", 4), "float32"),
                       Launch("k_softmax", ("s0", 1, 1), ("tmp", "sm"), ("s0",)),
                       Free(("tmp",)),
                       Alloc("y", y_off, ("s0", 3), "float32"),
                       Extern("aten.mm.out", (_ref("sm", ("s0", 4), (4, 1)), _ref("w1", (4, 3), (3, 1))), {}, "y",
                              _ref("y", ("s0", 3), (3, 1)), True, ("s0", 3), "float32"),
                       Alloc("out", -1, ("s0", 3), "float32"),
                       Launch("k_add", ("cdiv(s0 * 3, 16)", 1, 1), ("y", "in1", "out"), ("s0 * 3",)),
                       Return((_ref("out", ("s0", 3), (3, 1)), _ref("sm", ("s0 - 1", 4), (4, 1), 4))),
                   ))


def test_program_with_expressions_is_version_5_and_round_trips():
    p = _dyn_program()
    assert p.version == DIMS_VERSION  # raised from PROGRAM_VERSION by the expressions
    d = p.to_dict()
    assert d["version"] == DIMS_VERSION and d["instructions"][1]["sizes"] == ["s0 * 4"]
    assert "sizes" not in d["instructions"][0]
    back = Program.from_dict(msgpack.unpackb(msgpack.packb(d, use_bin_type=True), **_UNPACK))
    assert back == p and back.to_dict() == d
    assert program_dims(p) == {"s0"}


def test_specialize_gives_a_static_program():
    s = specialize(_dyn_program(), {"s0": 17})
    assert program_dims(s) == frozenset()
    assert s.arena_bytes == 512 + 256 and s.inputs[0].shape == (17, 4)
    launch = s.instructions[1]
    assert launch.grid == (5, 1, 1) and launch.sizes == (68,)
    assert s.instructions[5].offset == 512 and s.instructions[6].out_view.shape == (17, 3)
    assert s.instructions[6].args[0].shape == (17, 4)
    assert s.returned[1].shape == (16, 4) and s.returned[1].offset == 4
    assert all(type(v) is int for v in _all_sizes(s))


def _all_sizes(p: Program):
    from aotfuse.contract.program import sizes_of

    return list(sizes_of(p))


def test_static_program_stays_version_4_with_unchanged_bytes():
    p = Program(PROGRAM_VERSION, (ProgramInput("in0", (3, 4), "float32"),), {}, {}, 0, None,
                (Alloc("o", -1, (3, 4), "float32"), Launch("k", (3, 1, 1), ("in0", "o")),
                 Return((_ref("o", (3, 4), (4, 1)),))))
    assert p.version == PROGRAM_VERSION == 4 and program_dims(p) == frozenset()
    d = p.to_dict()
    assert d["version"] == 4 and "sizes" not in d["instructions"][1]
    assert list(d["instructions"][1]) == ["op", "kernel", "grid", "args"]
    assert specialize(p, {}) == p


def test_a_real_static_build_writes_the_same_bytes(static_archive):
    ar = read_archive(static_archive)
    raw = ar.part("program.forward")
    d = msgpack.unpackb(raw, **_UNPACK)
    p = Program.from_dict(d, "forward")
    assert p.version == 4 and msgpack.packb(p.to_dict(), use_bin_type=True) == raw
    m = Manifest.from_dict(ar.manifest)
    assert m.dims == () and "dims" not in m.to_dict()
    assert write_archive(m.to_dict(), {}, {}) == write_archive(ar.manifest, {}, {})
    kraw = msgpack.unpackb(ar.part("kernels"), **_UNPACK)
    k = kernels_from_dict(kraw)
    assert kernels_to_dict(k) == kraw and all("size_args" not in v for v in kraw.values())


def test_a_version_4_program_with_expressions_is_refused():
    d = _dyn_program().to_dict()
    d["version"] = 4
    with pytest.raises(ArchiveError, match="a version 4 program has size expressions"):
        Program.from_dict(d, "forward")


def test_program_decoding_checks_every_size():
    d = _dyn_program().to_dict()
    bad = copy.deepcopy(d)
    bad["instructions"][0]["shape"] = ["s0", "os.system('x')"]
    with pytest.raises(ArchiveError, match="alloc shape"):
        Program.from_dict(bad)
    bad = copy.deepcopy(d)
    bad["instructions"][1]["sizes"] = [1.5]
    with pytest.raises(ArchiveError, match="launch sizes"):
        Program.from_dict(bad)
    bad = copy.deepcopy(d)
    bad["arena_bytes"] = "s0 ** 9"
    with pytest.raises(ArchiveError, match="arena_bytes"):
        Program.from_dict(bad)


# ---------------------------------------------------------------- kernels and manifest

def _kernels() -> dict:
    fake = {"sm_90": Binary(b"not-a-cubin", "k", 1, 0, 0, 0)}
    return {
        "k_scale": KernelEntry("pointwise", ("pw0",), ("cdiv(s0 * 4, 16)", 1, 1), 1, 16, 1, "s0 * 4", 1,
                               (KernelArg("in_ptr0", "float32", "in", "s0 * 4"), KernelArg("in_ptr1", "float32", "in", 4),
                                KernelArg("out_ptr0", "float32", "out", "s0 * 4")), fake, 1, ("xnumel",)),
        "k_softmax": KernelEntry("persistent_reduction", ("red0",), ("s0", 1, 1), 1, 1, 4, "s0", 4,
                                 (KernelArg("in_ptr0", "float32", "in", "s0 * 4"),
                                  KernelArg("out_ptr0", "float32", "out", "s0 * 4")), fake, 1, ("xnumel",)),
        "k_add": KernelEntry("pointwise", ("pw1",), ("cdiv(s0 * 3, 16)", 1, 1), 1, 16, 1, "s0 * 3", 1,
                             (KernelArg("in_ptr0", "float32", "in", "s0 * 3"), KernelArg("in_ptr1", "float32", "in", "s0 * 3"),
                              KernelArg("out_ptr0", "float32", "out", "s0 * 3")), fake, 1, ("xnumel",)),
    }


SOURCES = {
    "k_scale": '''import triton
import triton.language as tl

@triton.jit
def k_scale(in_ptr0, in_ptr1, out_ptr0, xnumel):
    xindex = tl.program_id(0) * 16 + tl.arange(0, 16)
    xmask = xindex < xnumel
    t1 = tl.load(in_ptr0 + xindex, xmask, other=0)
    t2 = tl.load(in_ptr1 + (xindex % 4), xmask, other=0)
    tl.store(out_ptr0 + xindex, t1 * 2.0 + t2, xmask)
''',
    "k_softmax": '''import triton
import triton.language as tl

@triton.jit
def k_softmax(in_ptr0, out_ptr0, xnumel):
    xindex = tl.program_id(0) * 1 + tl.arange(0, 1)[:, None]
    xmask = xindex < xnumel
    rindex = tl.arange(0, 4)[None, :]
    rmask = rindex < 4
    t1 = tl.load(in_ptr0 + (rindex + 4 * xindex), xmask & rmask, other=0)
    t2 = tl.where(xmask & rmask, t1, float("-inf"))
    t3 = tl.max(t2, 1)[:, None]
    t4 = tl.exp(t1 - t3)
    t5 = tl.where(xmask & rmask, t4, 0)
    t6 = tl.sum(t5, 1)[:, None]
    tl.store(out_ptr0 + (rindex + 4 * xindex), t4 / t6, xmask & rmask)
''',
    "k_add": '''import triton
import triton.language as tl

@triton.jit
def k_add(in_ptr0, in_ptr1, out_ptr0, xnumel):
    xindex = tl.program_id(0) * 16 + tl.arange(0, 16)
    xmask = xindex < xnumel
    t1 = tl.load(in_ptr0 + xindex, xmask, other=0)
    t2 = tl.load(in_ptr1 + xindex, xmask, other=0)
    tl.store(out_ptr0 + xindex, t1 + t2, xmask)
''',
}

DIMS = (DimSpec(sym="s0", name="x.0", lo=1, hi=40, hint=3),)


def _manifest(dims=DIMS) -> Manifest:
    return Manifest(format="aotfuse", aotfuse_version=aotfuse.__version__, torch_version="2.13.0", targets=("sm_90",),
                    programs=("forward",), inputs=(InputSpec("x", ("s0", 4), "torch.float32", "float"),
                                                   InputSpec("b", ("s0", 3), "torch.float32", "float")),
                    outputs=(OutputSpec(("s0", 3), "torch.float32"), OutputSpec(("s0 - 1", 4), "torch.float32")),
                    single_output=False, kernels=("k_add", "k_scale", "k_softmax"), dims=dims)


def test_kernel_entries_with_sizes_round_trip():
    ks = _kernels()
    d = kernels_to_dict(ks)
    assert d["k_scale"]["size_args"] == ["xnumel"] and d["k_scale"]["args"][0]["numel"] == "s0 * 4"
    assert kernels_from_dict(msgpack.unpackb(msgpack.packb(d, use_bin_type=True), **_UNPACK)) == ks
    k = specialize_kernel(ks["k_scale"], {"s0": 5})
    assert k.grid == (2, 1, 1) and k.xnumel == 20 and [a.numel for a in k.args] == [20, 4, 20]


def test_manifest_with_dims_round_trips():
    m = _manifest()
    d = m.to_dict()
    assert d["dims"] == [{"sym": "s0", "name": "x.0", "lo": 1, "hi": 40, "hint": 3}]
    assert d["inputs"][0]["shape"] == ["s0", 4] and d["outputs"][1]["shape"] == ["s0 - 1", 4]
    back = Manifest.from_dict(msgpack.unpackb(msgpack.packb(d), **_UNPACK))
    assert back == m and back.dim("s0") == DIMS[0] and back.dim("s9") is None


@pytest.mark.parametrize("kw,match", [
    (dict(sym="x0"), "a dim symbol is s0"),
    (dict(lo=5, hint=3), "not 0 <= lo <= hint <= hi"),
    (dict(hint=50), "not 0 <= lo <= hint <= hi"),
    (dict(lo=-1, hint=0), "not 0 <= lo"),
    (dict(hi=2.5), "must be integers"),
    (dict(name=""), "non-empty"),
])
def test_dim_spec_checks_its_range(kw, match):
    base = dict(sym="s0", name="x.0", lo=1, hi=40, hint=3)
    with pytest.raises(ArchiveError, match=match):
        DimSpec(**{**base, **kw})
    with pytest.raises(ArchiveError, match=match):
        DimSpec.from_dict({**base, **kw})


def test_input_spec_axes_are_ints_or_plain_symbols():
    with pytest.raises(ArchiveError, match="not an integer or a dim symbol"):
        Manifest.from_dict({**_manifest().to_dict(), "inputs": [{"name": "x", "shape": ["s0 + 1", 4],
                                                               "dtype": "torch.float32"}]})
    with pytest.raises(ArchiveError, match="declare a symbol twice"):
        _manifest(dims=DIMS + DIMS)


# ---------------------------------------------------------------- guards

SPECS = (InputSpec("tokens", ("s0", "s1"), "torch.int64", "int"), InputSpec("mask", ("s0", 1, "s1"), "torch.bool", "bool"))
GDIMS = (DimSpec(sym="s0", name="tokens.0", lo=1, hi=8, hint=2), DimSpec(sym="s1", name="tokens.1", lo=1, hi=64, hint=16))


def _t(*shape):
    return torch.empty(shape, device="meta")


def test_bind_dims_binds_each_symbol_once():
    assert bind_dims(SPECS, GDIMS, (_t(3, 17), _t(3, 1, 17))) == {"s0": 3, "s1": 17}
    assert bind_dims(SPECS, GDIMS, (_t(8, 64), _t(8, 1, 64))) == {"s0": 8, "s1": 64}  # the range ends
    assert bind_dims(SPECS, GDIMS, (_t(1, 1), _t(1, 1, 1))) == {"s0": 1, "s1": 1}
    hints = dims_env(GDIMS)  # example shapes for a dynamic archive's inputs
    assert hints == {"s0": 2, "s1": 16} and shape_at(SPECS[1].shape, hints) == (2, 1, 16)
    assert bind_dims(SPECS, GDIMS, [_t(*shape_at(s.shape, dims_env(GDIMS, "hi"))) for s in SPECS]) == {"s0": 8, "s1": 64}


def test_bind_dims_out_of_range_names_input_dim_and_range():
    with pytest.raises(GuardError) as e:
        bind_dims(SPECS, GDIMS, (_t(2, 100), _t(2, 1, 100)))
    assert str(e.value.message) == "input 'tokens' (#0) dim 1 = 100 is outside s1 (tokens.1) range 1..64"
    assert e.value.remedy == "rebuild with a wider range: --dynamic tokens.1=LO..HI"
    with pytest.raises(GuardError, match=r"dim 0 = 0 is outside s0 \(tokens.0\) range 1..8"):
        bind_dims(SPECS, GDIMS, (_t(0, 4), _t(0, 1, 4)))


def test_bind_dims_relation_between_dims():
    with pytest.raises(GuardError) as e:
        bind_dims(SPECS, GDIMS, (_t(2, 16), _t(2, 1, 15)))
    msg = e.value.message
    assert "input 'mask' (#1) dim 2 = 15 differs from input 'tokens' (#0) dim 1 = 16" in msg
    assert "both are s1 (tokens.1)" in msg and e.value.remedy


def test_bind_dims_rank_and_static_axes():
    with pytest.raises(GuardError, match=r"input 'mask' \(#1\): expected 3 dims \(s0, 1, s1\), got shape \(2, 16\)"):
        bind_dims(SPECS, GDIMS, (_t(2, 16), _t(2, 16)))
    with pytest.raises(GuardError, match=r"expected shape \(s0, 1, s1\), got \(2, 2, 16\): dim 1 is static \(1\)") as e:
        bind_dims(SPECS, GDIMS, (_t(2, 16), _t(2, 2, 16)))
    assert "--dynamic mask.1=LO..HI" in e.value.remedy


# ---------------------------------------------------------------- a dynamic archive, end to end (CPU)

def _payload():
    return (_manifest().to_dict(), kernels_to_dict(_kernels()), {"forward": _dyn_program().to_dict()})


def _weights():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, generator=g), "w2": torch.randn(4, 3, generator=g)}


def _report() -> dict:
    return {"fusion_summary": {"loop_ir_nodes": 3, "inlined": 0, "groups": 3, "kernel_launches": 3,
                               "unique_kernels": 3, "externs": 1, "fused_pairs": 0, "refusals": {}},
            "fusion": [], "inline": [], "lowering": [], "groups": [],
            "memory": {"arena_bytes": "cdiv(s0 * 16, 256) * 256", "naive_bytes": 0, "buffers": 2,
                       "bound_extern_results": 0}}


def _archive(manifest, kernels, programs, sources=None, weights=None) -> bytes:
    parts = {f"program.{n}": msgpack.packb(p, use_bin_type=True) for n, p in programs.items()}
    parts["kernels"] = msgpack.packb(kernels, use_bin_type=True)
    parts["sources"] = msgpack.packb(sources or SOURCES, use_bin_type=True)
    parts["report"] = msgpack.packb(_report(), use_bin_type=True)
    return write_archive(manifest, parts, weights or _weights())


@pytest.fixture(scope="module")
def dyn_archive() -> bytes:
    return _archive(*_payload())


def _eager(x, b):
    w = _weights()
    sm = torch.softmax(x * 2 + w["w"], dim=-1)
    return sm @ w["w2"] + b, sm[1:]


def _inputs(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 3, generator=g)


def test_one_archive_runs_many_shapes_on_cpu(dyn_archive):
    art = aotfuse.load(dyn_archive, device="cpu")
    assert art.dims == DIMS and art.executors == {}
    for rows in (3, 1, 17, 40, 5, 3):  # the hint, the range ends, and rows that are not multiples of 16
        x, b = _inputs(rows, rows)
        out, sm = art(x, b)
        want_out, want_sm = _eager(x, b)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(sm, want_sm)
    st = art.shape_stats()["forward"]
    assert st["cached"] == 5 and st["linked"] == 5 and st["calls"] == 6 and st["evictions"] == 0
    by_rows = {s["dims"]["s0"]: s for s in st["shapes"]}
    assert by_rows[3]["calls"] == 2 and by_rows[40]["calls"] == 1 and by_rows[3]["captures"] == 0
    assert [s["dims"]["s0"] for s in st["shapes"]] == [1, 17, 40, 5, 3]  # least recently used first
    ex = art.shapes["forward"].executor({"s0": 17})
    assert ex.program.arena_bytes == 768 and ex.program.inputs[0].shape == (17, 4)


def test_shape_cache_is_bounded_lru(dyn_archive):
    with override(shape_cache=2):
        art = aotfuse.load(dyn_archive, device="cpu")
    for rows in (2, 3, 2, 4):
        art(*_inputs(rows))
    st = art.shape_stats()["forward"]
    assert st["capacity"] == 2 and st["cached"] == 2 and st["evictions"] == 1 and st["linked"] == 3
    assert sorted(s["dims"]["s0"] for s in st["shapes"]) == [2, 4] and st["calls"] == 4
    out, _ = art(*_inputs(3, 7))  # evicted: linked again, never compiled
    torch.testing.assert_close(out, _eager(*_inputs(3, 7))[0])
    assert art.shape_stats()["forward"]["linked"] == 4
    art.close()
    with pytest.raises(AotfuseError, match="closed"):
        art(*_inputs(2))


def test_guards_of_a_dynamic_archive(dyn_archive):
    art = aotfuse.load(dyn_archive, device="cpu")
    x, b = _inputs(41)
    with pytest.raises(GuardError, match=r"input 'x' \(#0\) dim 0 = 41 is outside s0 \(x.0\) range 1..40"):
        art(x, b)
    x, b = _inputs(5)
    with pytest.raises(GuardError, match=r"input 'b' \(#1\) dim 0 = 4 differs from input 'x' \(#0\) dim 0 = 5"):
        art(x, b[:4])
    with pytest.raises(GuardError, match=r"dim 1 is static \(4\)"):
        art(torch.randn(5, 5), b)
    with pytest.raises(GuardError, match="expected dtype torch.float32"):
        art(x.double(), b)
    with pytest.raises(GuardError, match="expected a contiguous tensor"):
        art(torch.randn(4, 5)[:, :4], torch.randn(5, 3)[:4])
    with pytest.raises(GuardError, match="expected a tensor"):
        art(x, 3)
    assert art.shape_stats()["forward"]["linked"] == 0  # nothing linked for refused calls


def test_per_shape_link_cost_is_reported(dyn_archive):
    art = aotfuse.load(dyn_archive, device="cpu")
    t0 = time.perf_counter()
    art.shapes["forward"].executor({"s0": 9})  # specialize + validate + link, no kernel run
    link_s = time.perf_counter() - t0
    shape = art.shape_stats()["forward"]["shapes"][0]
    assert shape["dims"] == {"s0": 9} and 0 < shape["link_ms"] <= link_s * 1e3
    assert link_s < 1.0, f"linking one shape took {link_s:.3f} s"


# ---------------------------------------------------------------- validation at load

def _load(manifest, kernels, programs, **kw):
    return aotfuse.load(_archive(manifest, kernels, programs, **kw), device="cpu")


def test_an_undeclared_dim_is_an_archive_error_at_load():
    m, k, p = _payload()
    p["forward"]["instructions"][3]["grid"] = ["s1", 1, 1]
    with pytest.raises(ArchiveError, match=r"program 'forward' uses dim s1, which manifest.dims does not declare"):
        _load(m, k, p)
    m, k, p = _payload()
    k["k_add"]["args"][0]["numel"] = "s0 * s2"
    with pytest.raises(ArchiveError, match="kernel k_add uses dim s2"):
        _load(m, k, p)
    m, k, p = _payload()
    m["outputs"][0]["shape"] = ["s5", 3]
    with pytest.raises(ArchiveError, match="names s5, which manifest.dims does not declare"):
        _load(m, k, p)


def test_a_bad_expression_is_an_archive_error_at_load():
    m, k, p = _payload()
    p["forward"]["instructions"][0]["shape"] = ["s0", "__import__('os').getpid()"]
    with pytest.raises(ArchiveError, match="size expression"):
        _load(m, k, p)
    m, k, p = _payload()
    k["k_scale"]["grid"] = ["cdiv(s0 * 4, 0)", 1, 1]
    with pytest.raises(ArchiveError, match="divides by zero"):
        _load(m, k, p)


def test_sizes_are_checked_at_the_range_ends():
    m, k, p = _payload()
    # an output buffer one row short at every shape: caught at the first range end checked
    p["forward"]["instructions"][2]["shape"] = ["s0 - 1", 4]
    with pytest.raises(ArchiveError, match=r"at s0 = 1 \(x.0\): program 'forward', instruction 3 \(launch k_softmax\)"):
        _load(m, k, p)
    m, k, p = _payload()
    # an arena too small only beyond 16 rows: the hi end finds it
    p["forward"]["arena_bytes"] = "cdiv(s0 * 16, 256) * 256 + 256"
    with pytest.raises(ArchiveError, match=r"at s0 = 40 \(x.0\): .* lie outside the arena"):
        _load(m, k, p)


def test_a_shape_is_checked_before_its_first_launch():
    m, k, p = _payload()
    # right at s0 = 1, 3 and 40, wrong at 7: only the per-shape check can see it
    p["forward"]["instructions"][1]["grid"] = ["cdiv(s0 * 4, 16) + min(s0 % 7, 1) - 1", 1, 1]
    art = _load(m, k, p)
    art(*_inputs(8))
    with pytest.raises(ArchiveError, match="grid"):
        art(*_inputs(7))


def test_launch_sizes_must_match_the_kernel():
    m, k, p = _payload()
    p["forward"]["instructions"][1]["sizes"] = ["s0 * 4", 3]
    with pytest.raises(ArchiveError, match=r"sizes: expected 1\.\.1 entries, got 2"):
        _load(m, k, p)
    m, k, p = _payload()
    k["k_scale"]["size_args"] = ["in_ptr0"]
    with pytest.raises(ArchiveError, match="reuse an argument's"):
        _load(m, k, p)
    m, k, p = _payload()
    p["forward"]["instructions"][1]["sizes"] = ["s0 * 4 * 100000000"]
    with pytest.raises(ArchiveError, match=r"size 0 \(xnumel\)"):
        _load(m, k, p)


def test_cpu_source_must_take_the_size_arguments():
    m, k, p = _payload()
    src = dict(SOURCES, k_add=SOURCES["k_add"].replace(", xnumel)", ")").replace("< xnumel", "< 12"))
    with pytest.raises(ArchiveError, match=r"takes \(in_ptr0, in_ptr1, out_ptr0\), the archive's launches pass "
                                           r"\(in_ptr0, in_ptr1, out_ptr0, xnumel\)"):
        _load(m, k, p, sources=src)


def test_manifest_dims_are_validated():
    m, k, p = _payload()
    m["dims"][0]["hi"] = 2**31
    with pytest.raises(ArchiveError, match=r"manifest.dims\[0\].hi"):
        _load(m, k, p)
    m, k, p = _payload()
    m["dims"].append({"sym": "s1", "name": "x.1", "lo": 1, "hi": 4, "hint": 2})
    with pytest.raises(ArchiveError, match="s1 appear in no input shape"):
        _load(m, k, p)
    m, k, p = _payload()
    m["inputs"][0]["stride"] = [1, 4]
    with pytest.raises(ArchiveError, match="dynamic dims with a non-contiguous layout .* not supported yet"):
        _load(m, k, p)


def test_a_static_archive_refuses_expressions(static_archive):
    ar = read_archive(static_archive)
    parts = {n: ar.part(n) for n in ar.part_names}
    prog = msgpack.unpackb(parts["program.forward"], **_UNPACK)
    prog["instructions"][0]["shape"] = ["s0", 4]
    parts["program.forward"] = msgpack.packb(prog, use_bin_type=True)
    with pytest.raises(ArchiveError, match="expected an integer"):
        aotfuse.load(write_archive(ar.manifest, parts, dict(ar.weights)), device="cpu")


# ---------------------------------------------------------------- launchers take the sizes

def test_gpu_launch_sites_pack_sizes_after_the_addresses():
    """The executor's GPU path without a GPU: a prepared launch whose buffers never change is filled
    once with its addresses then its int32 sizes; a per-call one gets them appended per launch."""
    from aotfuse.runtime.cuda_driver import _ArgPack
    from aotfuse.runtime.executor import _prepared, _sized

    calls = []

    class Prepared:
        def __init__(self, grid):
            self.pack = _ArgPack(("ptr", "ptr", "i32"))

        def fill(self, args):
            self.pack.fill(args)
            calls.append(("fill", list(args)))

        def launch(self, stream, args):
            self.fill(args)

        def launch_filled(self, stream):
            calls.append(("launch", self.pack.values()))

    class Bound:
        def prepare(self, grid):
            return Prepared(grid)

    launch = _sized(Bound(), (68,))
    fixed = _prepared(("launch", launch, (5, 1, 1), (0, 1)), [0x1000, 0x2000], set())
    assert fixed[0] == "fixed" and calls == [("fill", [0x1000, 0x2000, 68])]
    fixed[1](0)
    assert calls[-1] == ("launch", (0x1000, 0x2000, 68, 0, 0))
    per_call = _prepared(("launch", launch, (5, 1, 1), (0, 1)), [0x1000, 0x2000], {0})
    assert per_call[0] == "prepared"
    per_call[1](0, [0x3000, 0x2000])
    assert calls[-1] == ("fill", [0x3000, 0x2000, 68])


# ---------------------------------------------------------------- inspect

def test_inspect_shows_dims_and_symbolic_shapes(dyn_archive, tmp_path):
    from aotfuse.cli import render_inspect

    info = aotfuse.inspect_archive(dyn_archive)
    assert info["dims"] == [{"sym": "s0", "name": "x.0", "lo": 1, "hi": 40, "hint": 3}]
    assert info["inputs"][0]["shape"] == ["s0", 4] and info["programs"]["forward"]["version"] == (PDL_VERSION if knobs.pdl else DIMS_VERSION)
    text = render_inspect(info, tmp_path / "dyn.aotf")
    assert "s0 = x.0 in 1..40 (hint 3)" in text
    assert "x: (s0, 4) torch.float32" in text and "b: (s0, 3) torch.float32" in text
    assert "cdiv(s0 * 16, 256) * 256 + cdiv(s0 * 12, 256) * 256" in text


def test_inspect_of_a_static_archive_has_no_dims(static_archive, tmp_path):
    from aotfuse.cli import render_inspect

    info = aotfuse.inspect_archive(static_archive)
    assert "dims" not in info
    assert "dims:" not in render_inspect(info, tmp_path / "s.aotf")


# ---------------------------------------------------------------- a static build, for comparison

@pytest.fixture(scope="module")
def static_archive() -> bytes:
    from aotfuse.emit.compile import Binary as BuildBinary

    def fake_compile(kernels, targets, workers, progress=None):
        return {k.name: {"sm_90": BuildBinary("sm_90", b"not-a-cubin", k.name, k.num_warps, 0, 0, 0)} for k in kernels}

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            return torch.softmax(x * 2 + self.w, dim=-1)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("aotfuse.pipeline.compile_all", fake_compile)
        return aotfuse.build(M(), (torch.randn(3, 4),), targets=("sm_90",)).data
