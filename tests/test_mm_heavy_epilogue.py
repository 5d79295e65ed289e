"""Matmul templates with heavy epilogues in training (issue 11.4): the MLP's dgrad with the GELU backward, fc1
with its bias and GELU storing both the pre-activation and the activation. Lowering looks through the fp32
upcast to the epilogue (lower/epilogue.epilogue_region), counts what would run in it and what it saves; the
template runs such an epilogue in two column halves on a persistent tile configuration with two programs per
SM; the numbers are eager's (CPU path through Triton's interpreter; a GPU test at the anchor's sizes)."""
from __future__ import annotations

import copy

import msgpack
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.archive import read_archive
from aotfuse.knobs import override
from aotfuse.schedule import templates
from aotfuse.testing.train_check import assert_half_training_close


class MLP(nn.Module):
    """GPT's MLP and a loss: fc2(gelu_tanh(fc1(x)))."""

    def __init__(self, d=48, hidden=136):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(x), approximate="tanh"))
        return (y.float() * y.float()).mean()


def _sources(data: bytes) -> dict:
    src = read_archive(data).part("sources")
    return msgpack.unpackb(src, raw=False) if isinstance(src, (bytes, bytearray, memoryview)) else src


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gelu_backward_in_the_dgrad_template(dtype):
    """Every matmul a template, every epilogue treated as heavy, a persistent two-programs-per-SM config whose
    tiles divide neither M nor N: the GELU backward (and the GELU itself, for fc2's weight gradient) runs in
    the dgrad's epilogue, in two column halves; loss and gradients match eager."""
    torch.manual_seed(0)
    model = MLP().to(dtype)
    x = torch.randn(2, 40, 48, dtype=dtype)
    with override(mm="template", mm_config="64,64,32,8,4,3,2", mm_epilogue_heavy_nodes=0):
        res = aotfuse.build(model, (x,), train=True, targets=("sm_90",))
    srcs = _sources(res.data)
    halves = [s for s in srcs.values() if "acc_h0, acc_h1 = tl.split" in s]
    assert halves, "no template ran its epilogue in halves"
    # the dgrad of fc2 (K = d = 48) with the GELU backward: loads the saved pre-activation, stores two values
    dgrad = [s for s in halves if "range(0, 48, 32)" in s and s.count("tl.store") >= 4]
    assert dgrad, [s[:200] for s in halves]
    whys = [(g.blocks or {}).get("why", "") for g in res.report.groups if g.kind == "template"]
    assert any("two column halves" in w for w in whys), whys
    mod = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    xs = torch.randn(2, 40, 48, dtype=dtype)
    loss, want = mod(xs), ref(xs)
    loss.backward()
    want.backward()
    got = dict(mod.named_parameters())
    if dtype == torch.float32:
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
        return
    ref32 = copy.deepcopy(model).float()
    ref32(xs.float()).backward()
    for (name, p), p32 in zip(ref.named_parameters(), ref32.parameters()):
        ours, eager = _rel(got[name].grad, p32.grad), _rel(p.grad, p32.grad)
        assert ours <= max(2e-2, 2 * eager), (name, ours, eager)


def test_anchor_training_decisions():
    """AOTFUSE_MM=auto, sm_90, the anchor GPT's training step (8 x 1024): per layer the MLP's dgrad is a
    template with the GELU backward in its epilogue (the round trip of its 8192 x 3072 product saved) and fc1 a
    template storing the pre-activation and the GELU (the GELU kernel's read saved), both heavy (persistent,
    two programs per SM); the LM head's product is read only by the loss's reductions and the LayerNorm
    backward's dgrads by their sums (cuBLAS by the estimates): cuBLAS, with the reason."""
    from aotfuse.examples.gpt import anchor_train

    model, inputs = anchor_train()
    with override(mm="auto"):
        res = aotfuse.build(model, inputs, train=True, targets=("sm_90",))
    reports = (res.report, res.report.backward)
    recs = [d for r in reports for d in r.lowering if "matmul" in d and "choice" in d]
    tmpl = [d for d in recs if d["choice"] == "template"]
    shapes = sorted((d["op"], d["shape"]["N"], d["shape"]["K"]) for d in tmpl)
    assert shapes == [("addmm", 3072, 768)] * 4 + [("mm", 3072, 768)] * 4, shapes
    for d in tmpl:
        assert d["heavy_epilogue"] and d["config"]["persistent"] == 2 and not d["config"]["warp_spec"], d
    fc1 = [d for d in tmpl if d["op"] == "addmm"]
    assert all("saves a pass over" in d["why"] and "stores it as well" in d["why"] for d in fc1)
    dgrad = [d for d in tmpl if d["op"] == "mm"]
    assert all("saves a round trip" in d["why"] for d in dgrad)
    head = [d for d in recs if d["shape"]["N"] == 8192 and d["shape"]["M"] == 8192]
    assert head and all(d["choice"] == "extern" and "read only by reductions" in d["why"] for d in head), head
    ln = [d for d in recs if d["op"] == "mm" and d["shape"]["M"] == 8192 and d["shape"]["N"] == 768]
    assert len(ln) >= 8 and all(d["choice"] == "extern" and d["why"] for d in ln), [d["why"] for d in ln]
    whys = [(g.blocks or {}).get("why", "") for r in reports for g in r.groups if g.kind == "template"]
    assert len(whys) == 8 and all("two column halves" in w and "persistent" in w for w in whys), whys


def test_epilogue_saving_in_the_cost_model():
    """An epilogue that saves no pass over the product keeps cuBLAS, with the reason; one pass (the product is
    stored either way) is worth half a round trip in cuBLAS's estimate."""
    args = ("mm0", "mm", 1, 8192, 3072, 768, "bfloat16")
    kw = dict(epilogue=["_to_copy", "mul"], bias=False, operand_copy_us=0.0, operand_copies=[], targets=("sm_90",))
    with override(mm="auto"):
        none = templates.choose(*args, **kw, epilogue_saving=(0, "read only by reductions (sum)"))
        one = templates.choose(*args, **kw, epilogue_saving=(1, "the product is also read by output"))
        two = templates.choose(*args, **kw)
    assert none["choice"] == "extern" and "saves no pass" in none["why"] and "reductions" in none["why"]
    out_us = 8192 * 3072 * 2 / 3000e3
    assert two["cost_us"]["extern"] - one["cost_us"]["extern"] == pytest.approx(out_us, abs=0.02)
    assert one["cost_us"]["template"] == two["cost_us"]["template"]


@pytest.mark.gpu
def test_mlp_training_templates_on_gpu():
    """The anchor's MLP sizes (8192 tokens, 768 x 3072, bf16) on a Hopper GPU, AOTFUSE_MM=auto: the dgrad and
    fc1 templates (heavy epilogues, two programs per SM) give eager's loss and gradients."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90 rules")
    torch.manual_seed(0)
    model = MLP(768, 3072).to(torch.bfloat16)
    x = torch.randn(8, 1024, 768, dtype=torch.bfloat16)
    with override(mm="auto"):
        res = aotfuse.build(model, (x,), train=True, targets=("sm_90",))
    tmpl = [d for r in (res.report, res.report.backward) for d in r.lowering if d.get("choice") == "template"]
    assert len(tmpl) == 2 and all(d["heavy_epilogue"] for d in tmpl), [d.get("why") for d in res.report.lowering]
    xs = torch.randn(8, 1024, 768, dtype=torch.bfloat16, device="cuda")
    assert_half_training_close(res.data, model, (xs,), device="cuda")


class ErfMLP(MLP):
    """BERT's and ViT's MLP: the exact (erf) GELU."""

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(x)))
        return (y.float() * y.float()).mean()


class Residual(nn.Module):
    """A residual add whose other input also feeds a matmul: stored anyway, no heavy epilogue."""

    def __init__(self, d=768):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        h = torch.tanh(x) * torch.sigmoid(x) + x * x
        y = self.a(h) + h
        return (self.b(h).float() + y.float()).square().mean()


@pytest.mark.parametrize("mode", ["heavy", "auto"])
def test_heavy_mode_choices(mode):
    """AOTFUSE_MM=heavy weighs only heavy epilogues against cuBLAS; an epilogue holding erf (the exact GELU and
    its backward) is charged for it and keeps cuBLAS at these sizes in both modes, with the reason; a residual input that is stored anyway does not
    make its matmul's epilogue heavy."""
    x = torch.randn(8, 1024, 768, dtype=torch.bfloat16)
    with override(mm=mode):
        tanh = aotfuse.build(MLP(768, 3072).to(torch.bfloat16), (x,), train=True, targets=("sm_90",))
        erf = aotfuse.build(ErfMLP(768, 3072).to(torch.bfloat16), (x,), train=True, targets=("sm_90",))
        res = aotfuse.build(Residual().to(torch.bfloat16), (x,), train=True, targets=("sm_90",))

    def recs(r):
        return [d for rep in (r.report, r.report.backward) for d in rep.lowering if "matmul" in d and "choice" in d]

    assert sum(d["choice"] == "template" for d in recs(tanh)) == 2
    slow = [d for d in recs(erf) if "erf" in d["why"]]  # the dgrad (fc1's erf GELU is not heavy: 5 nodes)
    assert len(slow) == (1 if mode == "heavy" else 2) and all(d["choice"] == "extern" and "AOTFUSE_MM_SLOW_OP_US"
                                                              in d["why"] for d in slow), [d["why"] for d in recs(erf)]
    assert not any(d["choice"] == "template" for d in recs(erf))
    if mode == "heavy":
        assert not any(d.get("heavy_epilogue") for d in recs(res)), [d["why"] for d in recs(res)]
        assert all(d["choice"] == "extern" for d in recs(res))


class BatchedHeavy(nn.Module):
    def forward(self, a, b, r):
        y = torch.bmm(a, b)
        return torch.tanh(y) * torch.sigmoid(y + r) + y * y * 0.1 - torch.exp(-y * y) * r


@pytest.mark.parametrize("config", ["", "64,64,32,8,4,3,2"], ids=["rules", "persistent"])
def test_batched_heavy_epilogue_in_halves(config):
    """A bmm whose epilogue is heavy: in column halves over tiles that divide neither M nor N, one program per
    tile or persistent; eager's numbers."""
    torch.manual_seed(0)
    ins = (torch.randn(3, 70, 40), torch.randn(3, 40, 90), torch.randn(3, 70, 90))
    with override(mm="template", mm_epilogue_heavy_nodes=0, mm_config=config):
        res = aotfuse.build(BatchedHeavy(), ins, targets=("sm_90",))
    whys = [(g.blocks or {}).get("why", "") for g in res.report.groups if g.kind == "template"]
    assert len(whys) == 1 and "two column halves" in whys[0], whys
    art = aotfuse.load(res.data, device="cpu")
    fresh = tuple(torch.randn_like(t) for t in ins)
    torch.testing.assert_close(art(*fresh), BatchedHeavy()(*fresh), rtol=1e-5, atol=1e-4)
