"""Training tier on the CPU path: packaged forward/backward programs vs eager autograd."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.examples.gpt import GPTConfig, GPTWithLoss, _init
from aotfuse.specs import load_spec, random_inputs


def small_gpt(dropout: float = 0.0):
    cfg = GPTConfig(vocab=64, seq=8, dim=32, heads=2, layers=1, dropout=dropout)
    model = _init(GPTWithLoss(cfg), seed=0).train()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g))


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


CASES = {
    "gpt_small": small_gpt,
    "llama_block": lambda: load_spec("aotfuse.examples.llama:block_train"),
    "cnn": lambda: load_spec("aotfuse.examples.cnn:cnn_train"),
}


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(name, step="split"):
        if (name, step) not in cache:
            model, inputs = CASES[name]()
            cache[name, step] = (model, aotfuse.build(model, inputs, train=True, targets=("sm_90",), step=step))
        return cache[name, step]
    return get


@pytest.mark.parametrize("step", ["split", "auto"])
@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_every_gradient_match_eager(built, name, step):
    """Both packagings: forward + backward programs, and one fused step program (partition/step.py)."""
    model, res = built(name, step)
    assert res.manifest.programs == (("step",) if step == "auto" else ("forward", "backward"))
    art = aotfuse.load(res.data, device="cpu")
    mod = art.as_module()
    inputs = random_inputs(art.input_specs, device="cpu", seed=21)
    loss = mod(*inputs)
    loss.backward()
    ref_model = copy.deepcopy(model)
    ref = ref_model(*inputs)
    ref.backward()
    assert rel(loss, ref) < 1e-5, (float(loss), float(ref))
    ours = dict(mod.named_parameters())
    assert set(ours) == {n for n, _ in ref_model.named_parameters()}
    for n, p in ref_model.named_parameters():
        assert ours[n].grad is not None, n
        assert rel(ours[n].grad, p.grad) < 1e-4, f"{name}: grad of {n}: {rel(ours[n].grad, p.grad):.2e}"


def test_optimizer_steps_follow_eager(built):
    model, res = built("llama_block")
    art = aotfuse.load(res.data, device="cpu")
    mod = art.as_module()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (mod, ref))
    for step in range(3):
        inputs = random_inputs(art.input_specs, device="cpu", seed=100 + step)
        for m, o in ((mod, opt), (ref, ref_opt)):
            o.zero_grad()
            loss = m(*inputs)
            loss.backward()
            o.step()
        assert rel(mod(*inputs), ref(*inputs)) < 1e-4


def test_two_live_graphs_and_tangent_scaling(built):
    model, res = built("llama_block")
    mod = aotfuse.load(res.data, device="cpu").as_module()
    a = random_inputs(mod._art.input_specs, device="cpu", seed=1)
    b = random_inputs(mod._art.input_specs, device="cpu", seed=2)
    la, lb = mod(*a), mod(*b)  # two forwards before either backward
    (la + 2.0 * lb).backward()
    ref = copy.deepcopy(model)
    (ref(*a) + 2.0 * ref(*b)).backward()
    ours = dict(mod.named_parameters())
    for n, p in ref.named_parameters():
        assert rel(ours[n].grad, p.grad) < 1e-4, n


def test_saved_tensors_are_freed_after_backward():
    import gc
    import weakref

    model, inputs = CASES["llama_block"]()
    res = aotfuse.build(model, inputs, train=True, targets=("sm_90",), step="split")
    assert res.manifest.programs == ("forward", "backward")
    mod = aotfuse.load(res.data, device="cpu").as_module()
    loss = mod(*random_inputs(mod._art.input_specs, device="cpu", seed=3))
    saved = [weakref.ref(t) for t in loss.grad_fn.saved_tensors]
    assert saved
    loss.backward()
    del loss
    gc.collect()
    assert all(r() is None for r in saved)


def test_fused_step_holds_only_gradients_and_hands_them_over(built):
    """A fused step keeps the gradients from the forward to the backward (no saved tensors), hands them to
    autograd once, and frees them when the loss is dropped without a backward."""
    import gc
    import weakref

    _, res = built("llama_block", "auto")
    assert res.manifest.programs == ("step",) and res.manifest.train.mode == "step"
    mod = aotfuse.load(res.data, device="cpu").as_module()
    inputs = random_inputs(mod._art.input_specs, device="cpu", seed=3)
    loss = mod(*inputs)
    assert loss.grad_fn.saved_tensors == ()
    held = [weakref.ref(g) for g in loss.grad_fn.grads]
    assert len(held) == len(res.manifest.train.grads)
    loss.backward()
    assert loss.grad_fn.grads is None
    assert all(p.grad is not None for p in mod.parameters())
    loss = mod(*inputs)
    held = [weakref.ref(g) for g in loss.grad_fn.grads]
    del loss
    gc.collect()
    assert all(r() is None for r in held)


class _Dropout(nn.Module):
    def __init__(self, n: int, p: float):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))
        self.p = p

    def forward(self, x):
        return F.dropout(x * self.w, self.p, training=True).sum()


@pytest.mark.parametrize("step", ["split", "auto"])
def test_dropout_same_mask_in_backward_and_right_keep_rate(step):
    p, n = 0.25, 1 << 16
    model = _Dropout(n, p)
    res = aotfuse.build(model, (torch.ones(n),), train=True, targets=("sm_90",), step=step)
    part = res.report.partition
    mod = aotfuse.load(res.data, device="cpu").as_module()
    torch.manual_seed(0)
    loss = mod(torch.ones(n))
    loss.backward()
    g = mod._param_list[0].grad
    # d loss / d w = mask / (1 - p): summing it gives the loss only if the backward saw the forward's mask.
    assert torch.allclose(g.sum(), loss.detach(), rtol=1e-5)
    vals = torch.unique(g).tolist()
    assert len(vals) == 2 and vals[0] == 0.0 and vals[1] == pytest.approx(1 / (1 - p))
    keep = float((g != 0).float().mean())
    assert abs(keep - (1 - p)) < 0.01, keep
    # a fresh seed per call: another forward draws another mask
    g2 = torch.autograd.grad(mod(torch.ones(n)), mod._param_list[0])[0]
    assert not torch.equal(g2 != 0, g != 0)
    # the mask is saved bit-packed between two programs; one fused step program keeps it in its arena
    masks = [s for s in part["saved"] if s.get("packed")]
    assert masks and all(s["nbytes"] == n // 8 for s in masks), part["saved"]
    if step == "auto":
        from aotfuse.joint import trace_joint
        from aotfuse.packops import PACK, UNPACK
        from aotfuse.partition import partition
        from aotfuse.partition.step import step_graph

        assert res.manifest.programs == ("step",)
        gm = step_graph(partition(trace_joint(model, (torch.ones(n),))))
        targets = {nd.target for nd in gm.graph.nodes if nd.op == "call_function"}
        assert PACK not in targets and UNPACK not in targets  # unpack(pack(mask)) is the mask itself


@pytest.fixture(scope="module")
def split_gpt():
    model, inputs = small_gpt()
    return aotfuse.build(model, inputs, train=True, targets=("sm_90",), step="split")


def test_inspect_shows_partition(built, split_gpt, tmp_path):
    path = tmp_path / "t.aotf"
    split_gpt.save(path)
    info = aotfuse.inspect_archive(path)
    assert set(info["programs"]) == {"forward", "backward"} and info["train"]["mode"] == "split"
    part = info["partition"]
    assert part["saved_bytes"] > 0 and part["saved"] and "recomputed" in part
    assert part["step"]["mode"] == "split" and "step='split'" in part["step"]["why"]
    _, res = built("gpt_small", "auto")
    res.save(path)
    info = aotfuse.inspect_archive(path)
    assert set(info["programs"]) == {"step"} and info["train"]["mode"] == "step" and info["train"]["n_saved"] == 0
    assert info["partition"]["step"] == {"mode": "step", "why": res.report.partition["step"]["why"]}
    assert "the loss is a scalar" in info["partition"]["step"]["why"]


def test_gradient_for_an_input_that_requires_grad():
    model, (x, t) = load_spec("aotfuse.examples.llama:block_train")
    res = aotfuse.build(model, (x.clone().requires_grad_(True), t), train=True, targets=("sm_90",))
    mod = aotfuse.load(res.data, device="cpu").as_module()
    x2 = torch.randn_like(x).requires_grad_(True)
    t2 = torch.randn_like(t)
    mod(x2, t2).backward()
    x3 = x2.detach().clone().requires_grad_(True)
    model(x3, t2).backward()
    assert rel(x2.grad, x3.grad) < 1e-5


def test_input_requiring_grad_without_packaged_gradient_is_refused(built):
    _, res = built("llama_block")
    mod = aotfuse.load(res.data, device="cpu").as_module()
    x, t = random_inputs(mod._art.input_specs, device="cpu", seed=4)
    with pytest.raises(aotfuse.GuardError, match=r"input 'x' \(#0\) requires grad"):
        mod(x.requires_grad_(True), t)


@pytest.mark.slow
def test_full_demo_loss_and_gradients_match_eager():
    model, inputs = load_spec("aotfuse.examples.gpt:demo_train(dropout=0.0)")
    res = aotfuse.build(model, inputs, train=True, targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    mod = art.as_module()
    batch = random_inputs(art.input_specs, device="cpu", seed=9)
    loss = mod(*batch)
    loss.backward()
    ref = copy.deepcopy(model)
    ref_loss = ref(*batch)
    ref_loss.backward()
    assert rel(loss, ref_loss) < 1e-5
    ours = dict(mod.named_parameters())
    worst = max(rel(ours[n].grad, p.grad) for n, p in ref.named_parameters())
    assert worst < 1e-4, worst


def test_explain_lists_every_decision(built, split_gpt, tmp_path):
    from typer.testing import CliRunner

    from aotfuse.cli import app

    res = split_gpt
    path = tmp_path / "t.aotf"
    res.save(path)
    out = CliRunner().invoke(app, ["explain", str(path)]).output
    assert "== forward program ==" in out and "== backward program ==" in out
    assert "FUSED" in out and "refused" in out and "saved " in out and "recomputed in the backward" in out
    fused = sum(d.fused for d in res.report.fusion)
    assert out.count("FUSED") >= fused
    _, res = built("gpt_small", "auto")
    res.save(path)
    out = CliRunner().invoke(app, ["explain", str(path)]).output
    assert "== step program ==" in out and "== backward program ==" not in out
    assert "one program (fused step): the loss is a scalar" in out
    assert out.count("FUSED") >= sum(d.fused for d in res.report.fusion)
