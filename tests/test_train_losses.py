"""Cross-entropy in training as logsumexp - x[target] (joint/losses.py): every form it routes matches
F.cross_entropy's loss and gradients (class weights, ignore_index, each reduction, 1-d logits, bf16),
the forms it leaves to torch still build and match, and the routed backward reads the logits once
(a pointwise kernel, no row reduction)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.joint.losses import cross_entropy_lse, cross_entropy_mode

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Head(nn.Module):
    """A linear head and cross-entropy with the given keyword arguments."""

    def __init__(self, c=40, d=16, dtype=torch.float32, **ce):
        super().__init__()
        self.lin = nn.Linear(d, c).to(dtype)
        self.loss = nn.CrossEntropyLoss(**ce)  # a class weight is its buffer

    def forward(self, x, t):
        out = self.loss(self.lin(x), t)
        return out if out.dim() == 0 else (out * torch.linspace(0.5, 1.5, out.numel()).to(out)).sum()


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


CASES = {
    "mean": dict(),
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
    "ignore_index": dict(ignore_index=3),
    "weight": dict(weight=torch.rand(40) + 0.5),
    "weight_ignore_sum": dict(weight=torch.rand(40) + 0.5, ignore_index=0, reduction="sum"),
    "label_smoothing (torch's path)": dict(label_smoothing=0.1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cross_entropy_forms_match_eager(name):
    torch.manual_seed(0)
    model = Head(**CASES[name])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 16, generator=g)
    t = torch.randint(0, 40, (24,), generator=g)
    t[[2, 9]] = 3  # rows with the ignored class (ignore_index=3 cases)
    t[5] = 0
    res = aotfuse.build(model, (x, t), train=True, targets=("sm_90",))
    mod = aotfuse.load(res.data, device="cpu").as_module()
    x2 = torch.randn(24, 16, generator=g)  # fresh inputs
    t2 = torch.randint(0, 40, (24,), generator=g)
    t2[[1, 7]] = 3
    loss = mod(x2, t2)
    loss.backward()
    ref_model = copy.deepcopy(model)
    ref = ref_model(x2, t2)
    ref.backward()
    assert _rel(loss, ref) < 1e-5, (float(loss), float(ref))
    ours = dict(mod.named_parameters())
    for n, p in ref_model.named_parameters():
        assert _rel(ours[n].grad, p.grad) < 1e-5, n


def test_routed_formula_matches_torch_directly():
    g = torch.Generator().manual_seed(2)
    for shape, tshape in (((7, 11), (7,)), ((11,), ())):
        x = torch.randn(*shape, generator=g, requires_grad=True)
        t = torch.randint(0, 11, tshape, generator=g)
        w = torch.rand(11, generator=g) + 0.1
        for kw in (dict(), dict(weight=w), dict(reduction="none"), dict(reduction="sum", ignore_index=int(t.flatten()[0]))):
            a = cross_entropy_lse(x, t, kw.get("weight"), kw.get("ignore_index", -100), kw.get("reduction", "mean"))
            b = F.cross_entropy(x, t, **kw)
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            ga, = torch.autograd.grad(a.sum(), x)
            gb, = torch.autograd.grad(b.sum(), x)
            torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)


def test_mode_routes_the_common_form_and_keeps_the_rest():
    x = torch.randn(4, 5)
    t = torch.randint(0, 5, (4,))
    with cross_entropy_mode() as mode:
        F.cross_entropy(x, t)
        F.cross_entropy(x, t, label_smoothing=0.2)
        F.cross_entropy(x.view(2, 5, 2), t.view(2, 2) % 5)  # [N, C, d]: torch's path
    assert mode.routed == 1 and len(mode.kept) == 2


def test_bf16_logits_and_one_pass_backward():
    torch.manual_seed(3)
    model = Head(dtype=torch.bfloat16)
    x = torch.randn(32, 16).to(torch.bfloat16)
    t = torch.randint(0, 40, (32,))
    res = aotfuse.build(model, (x, t), train=True, targets=("sm_90",))
    # the backward's logits gradient is one pointwise pass: no reduction kernel reads the logits again
    # (the bias gradient is a column reduction of that gradient: allowed)
    big = [g for g in res.report.backward.groups if g.kernel and g.xnumel * g.rnumel >= 32 * 40]
    rows = [g for g in big if g.kind != "pointwise" and g.blocks["pattern"] != "outer"]
    assert big and not rows, [(g.kind, g.xnumel, g.rnumel, g.blocks["pattern"]) for g in big]
    mod = aotfuse.load(res.data, device="cpu").as_module()
    loss = mod(x, t)
    loss.backward()
    ref32 = copy.deepcopy(model).float()
    r = ref32(x.float(), t)
    r.backward()
    assert _rel(loss.float(), r) < 2e-2
    ours = dict(mod.named_parameters())
    for n, p in ref32.named_parameters():
        assert _rel(ours[n].grad.float(), p.grad) < 5e-2, n
