"""A tanh GELU written as its formula (GPT-2's gelu_new) becomes one gelu at export (export/gelu_formula.py), and
then fuses into its matmul's cuBLASLt epilogue (export/mm_gelu.py); any arrangement of the formula matches, nothing
else does; the numbers are eager's (CPU path)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.knobs import override

K = math.sqrt(2.0 / math.pi)


def gpt2_gelu(x):  # transformers' NewGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def rearranged(x):  # the same function, written otherwise
    return (torch.tanh((x * x * x * 0.044715 + x) * K) + 1.0) * x * 0.5


def wrong_constant(x):
    return 0.5 * x * (1.0 + torch.tanh(K * (x + 0.04 * x ** 3)))


def tanh_only(x):
    return torch.tanh(x) * x


class MLP(nn.Module):
    def __init__(self, act, d=64, h=256):
        super().__init__()
        self.fc, self.proj, self.act = nn.Linear(d, h), nn.Linear(h, d), act

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


def _records(res, key):
    return [d for d in res.report.lowering if key in d]


def _close(art, model, ins, dtype):
    out = art(*ins)
    with torch.no_grad():
        ref32 = copy.deepcopy(model).float()(*[t.float() for t in ins])
        eager = model(*ins)
    err = float((out.double() - ref32.double()).norm() / ref32.double().norm())
    if dtype == torch.float32:
        assert err < 1e-5, err
    else:
        eerr = float((eager.double() - ref32.double()).norm() / ref32.double().norm())
        assert err <= max(2e-2, 2 * eerr), (err, eerr)


@pytest.mark.parametrize("act", [gpt2_gelu, rearranged], ids=["gpt2", "rearranged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_formula_becomes_a_gelu_fused_into_the_matmul(act, dtype):
    torch.manual_seed(0)
    model = MLP(act).to(dtype).eval()
    x = torch.randn(2, 16, 64, dtype=dtype)
    res = aotfuse.build(model, (x,))
    (rec,) = _records(res, "gelu_formula")
    assert rec["fused"] and "241 points" in rec["why"], rec
    (mm,) = _records(res, "mm_gelu")
    assert mm["fused"] and mm["approximate"] == "tanh", mm
    _close(aotfuse.load(res.data, device="cpu"), model, (torch.randn(2, 16, 64, dtype=dtype),), dtype)


@pytest.mark.parametrize("act", [wrong_constant, tanh_only], ids=["wrong_constant", "tanh_only"])
def test_other_functions_are_not_taken_for_a_gelu(act):
    torch.manual_seed(0)
    model = MLP(act).eval()
    res = aotfuse.build(model, (torch.randn(2, 16, 64),))
    assert not _records(res, "gelu_formula") and not _records(res, "mm_gelu")
    _close(aotfuse.load(res.data, device="cpu"), model, (torch.randn(2, 16, 64),), torch.float32)


def test_a_formula_that_is_an_output_stays_and_the_knob():
    class Out(nn.Module):
        def forward(self, x):
            return gpt2_gelu(x)

    res = aotfuse.build(Out().eval(), (torch.randn(8, 32),))
    (rec,) = _records(res, "gelu_formula")
    assert not rec["fused"] and "graph output" in rec["why"]
    model = MLP(gpt2_gelu).eval()
    with override(gelu_formula=False):
        res = aotfuse.build(model, (torch.randn(2, 16, 64),))
    assert not _records(res, "gelu_formula") and not _records(res, "mm_gelu")


def test_gpt2_inference_gelus_fuse_into_cublaslt():
    """transformers' GPT-2 (tiny config): every MLP's gelu_new becomes a GELU in its c_fc matmul's epilogue."""
    pytest.importorskip("transformers")
    from aotfuse.testing.zoo import ZOO

    (entry,) = [e for e in ZOO if e.name == "gpt2"]
    ex = entry.tiny(train=False)
    res = aotfuse.build(ex.model, ex.args, example_kwargs=ex.kwargs)
    formula = _records(res, "gelu_formula")
    fused = [d for d in _records(res, "mm_gelu") if d["fused"]]
    layers = ex.model.config.n_layer
    assert len(formula) == layers and all(d["fused"] for d in formula), formula
    assert len(fused) == layers, _records(res, "mm_gelu")
