"""Numerics tier: whole models built to archives and run on the CPU path (Triton interpreter) vs eager."""
from __future__ import annotations

import copy

import pytest
import torch

import aotfuse
from aotfuse.specs import load_spec, random_inputs

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}

CASES = [
    ("aotfuse.examples.gpt:demo", torch.float32),
    ("aotfuse.examples.gpt:demo_bf16", torch.bfloat16),
    ("aotfuse.examples.gpt:demo(dtype='float16')", torch.float16),
    ("aotfuse.examples.llama:block", torch.float32),
    ("aotfuse.examples.llama:block_bf16", torch.bfloat16),
    ("aotfuse.examples.llama:block_fp16", torch.float16),
    ("aotfuse.examples.cnn:cnn", torch.float32),
    ("aotfuse.examples.cnn:cnn_bf16", torch.bfloat16),
    ("aotfuse.examples.cnn:cnn_fp16", torch.float16),
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(spec):
        if spec not in cache:
            model, inputs = load_spec(spec)
            cache[spec] = (model, aotfuse.build(model, inputs, targets=("sm_90",)))
        return cache[spec]
    return get


@pytest.mark.parametrize("spec,dtype", CASES, ids=[c[0].split(":")[1] for c in CASES])
def test_model_matches_eager_on_cpu(built, spec, dtype):
    model, res = built(spec)
    art = aotfuse.load(res.data, device="cpu")
    for seed in (11, 12):
        inputs = random_inputs(art.input_specs, device="cpu", seed=seed)
        out = art(*inputs)
        with torch.no_grad():
            ref = model(*inputs)
        assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
        # Half-precision eager rounds after every op; we keep fp32 in registers. Judge both against fp32.
        if dtype != torch.float32:
            ref32 = copy.deepcopy(model).float()(*[t.float() if t.is_floating_point() else t for t in inputs])
            err, eager_err = rel_err(out, ref32), rel_err(ref, ref32)
            assert err <= max(TOL[dtype], 2 * eager_err), f"{spec}: {err:.2e} vs fp32 (eager {dtype}: {eager_err:.2e})"
        else:
            err = rel_err(out, ref)
            assert err <= TOL[dtype], f"{spec}: rel err {err:.2e} > {TOL[dtype]:.0e}; repro: aotfuse verify '{spec}' --device cpu"


def test_demo_fuses_each_layernorm_and_gelu_into_one_kernel(built):
    _, res = built("aotfuse.examples.gpt:demo")  # default AOTFUSE_MM=extern: matmuls are cuBLAS calls
    groups = [g for g in res.report.groups if g.kind != "extern"]
    # 2 layers: embed-add+LN1, then per layer residual+LN2, GELU(+bias), residual+LN1'/LN_f.
    assert len(groups) == 7, [g.nodes for g in groups]
    reductions = [g for g in groups if g.kind == "reduction"]
    assert len(reductions) == 5
    for g in reductions:  # each holds both LayerNorm reductions and the normalizing pointwise
        kinds = [n[:3] for n in g.nodes]
        assert kinds.count("red") == 2 and len(g.nodes) >= 4
    s = res.report.fusion_summary
    assert s.unique_kernels < s.kernel_launches  # identical layers share one compiled kernel


def test_guard_errors_name_the_input(built):
    _, res = built("aotfuse.examples.llama:block")
    art = aotfuse.load(res.data, device="cpu")
    x = random_inputs(art.input_specs, device="cpu", seed=1)[0]
    with pytest.raises(aotfuse.GuardError, match=r"input 'x' \(#0\): expected shape \(2, 32, 128\), got \(2, 32, 64\)"):
        art(x[..., :64].contiguous())
    with pytest.raises(aotfuse.GuardError, match="expected dtype torch.float32, got torch.float64"):
        art(x.double())
    with pytest.raises(aotfuse.GuardError, match="contiguous"):
        art(x.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(aotfuse.GuardError, match="expected 1 inputs"):
        art(x, x)


def test_build_is_deterministic():
    model, inputs = load_spec("aotfuse.examples.llama:block")
    a = aotfuse.build(model, inputs, targets=("sm_80",))
    b = aotfuse.build(model, inputs, targets=("sm_80",))
    assert a.data == b.data


def test_cubins_carry_no_build_machine_paths(built):
    import msgpack
    import os

    from aotfuse.archive import read_archive

    _, res = built("aotfuse.examples.gpt:demo")
    with read_archive(res.data) as ar:
        kernels = msgpack.unpackb(ar.part("kernels"), raw=False)
    import sys

    import triton

    machine = {os.getcwd(), sys.prefix, os.path.realpath(sys.prefix), os.path.dirname(triton.__file__),
               os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.expanduser("~")}
    for name, k in kernels.items():
        cubin = k["binaries"]["sm_90"]["cubin"]
        for path in machine - {"/"}:
            assert path.encode() not in cubin, path
        assert b"/tmp/" not in cubin and b"site-packages" not in cubin
        assert f"{name}.py".encode() in cubin  # line info names the stable pseudo-path
