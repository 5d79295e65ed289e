"""Training through the ops real models need: overlapping max-pool (the ResNet stem), padded average
pooling, adaptive average pooling, scans (cumsum / cumprod) and gathers on inputs that need no
gradient, each built with train=True and checked against eager autograd (loss and every gradient)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class Stem(nn.Module):
    """conv -> relu -> MaxPool2d(3, 2, padding=1) (overlapping windows) -> padded avg / adaptive avg pools."""

    def __init__(self, ceil_mode=False, ties=False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.ceil_mode, self.ties = ceil_mode, ties

    def forward(self, x, t):
        y = torch.relu(self.conv(x))
        if self.ties:  # many equal values in a window: the gradient must go to ATen's first maximum
            y = torch.round(y * 2) / 2
        y = F.max_pool2d(y, 3, 2, 1, ceil_mode=self.ceil_mode)
        a = F.avg_pool2d(y, 3, 2, 1, ceil_mode=True, count_include_pad=False)
        b = F.adaptive_avg_pool2d(y, (3, 2))
        c = F.avg_pool2d(y, 2, 1, 1)
        return ((a - t[..., :a.shape[-2], :a.shape[-1]]) ** 2).mean() + (b * b).sum() + c.sum() * 0.1


class Scans(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 13) * 0.5)

    def forward(self, x, mask):
        pos = torch.cumsum(mask, -1) - 1  # the causal-mask helper: position ids from a padding mask
        z = torch.cumsum(x * self.w, 1) + pos.float()
        p = torch.cumprod(1 + 0.1 * torch.tanh(x), 1)  # no gradient through cumprod (its backward uses argmax)
        return (z * z).mean() + (p * self.w).sum()


class Gathers(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))

    def forward(self, x, idx):
        rows = x[:, idx]  # gathers of an input (no gradient flows into the gather itself)
        g = torch.gather(x, 1, idx[None].expand(x.shape[0], -1))
        return ((rows @ self.w) ** 2).mean() + (g * g * self.w.sum()).sum()


class ChannelsLastHead(nn.Module):
    """A channels-last conv into adaptive_avg_pool2d to 1 x 1 (the ResNet head): its composite form is a
    mean plus an as_strided_, whose gradient is an as_strided_scatter; the joint trace routes it to
    _adaptive_avg_pool2d (joint/pooling.py)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x, t):
        y = torch.relu(self.conv(x.contiguous(memory_format=torch.channels_last)))
        return F.mse_loss(self.fc(F.adaptive_avg_pool2d(y, 1).flatten(1)), t) + F.adaptive_avg_pool2d(y, (2, None)).mean()


def _stem_inputs():
    return torch.randn(2, 3, 13, 11), torch.randn(2, 4, 5, 5)


CASES = {
    "stem": (lambda: Stem(), _stem_inputs),
    "stem_ceil_ties": (lambda: Stem(ceil_mode=True, ties=True), _stem_inputs),
    "channels_last_head": (ChannelsLastHead, lambda: (torch.randn(2, 3, 7, 7), torch.randn(2, 5))),
    "scans": (Scans, lambda: (torch.randn(5, 13), torch.randint(0, 2, (5, 13)))),
    "gathers": (Gathers, lambda: (torch.randn(5, 9), torch.tensor([3, 0, 8, 8, 1, 2]))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_train_ops_match_eager(name):
    make, inputs = CASES[name]
    torch.manual_seed(0)
    model = make().train()
    example = inputs()
    res = aotfuse.build(model, example, train=True, targets=("sm_90",))
    mod = aotfuse.load(res.data, device="cpu").as_module()
    torch.manual_seed(1)
    fresh = inputs()
    loss = mod(*fresh)
    loss.backward()
    ref_model = copy.deepcopy(model)
    ref = ref_model(*fresh)
    ref.backward()
    assert rel(loss, ref) < 1e-5, (float(loss), float(ref))
    ours = dict(mod.named_parameters())
    for n, p in ref_model.named_parameters():
        assert ours[n].grad is not None, n
        assert rel(ours[n].grad, p.grad) < 1e-4, f"{name}: grad of {n}: {rel(ours[n].grad, p.grad):.2e}"


def test_resnet_stem_backward_is_not_decomposed_and_keeps_indices():
    """k3 s2 p1 windows overlap: the backward is lowered as a gather over the forward's indices."""
    from aotfuse.joint.decomp_train import _max_pool2d_with_indices_backward

    g, x = torch.randn(1, 1, 3, 3), torch.randn(1, 1, 6, 6)
    assert _max_pool2d_with_indices_backward(g, x, [3, 3], [2, 2], [1, 1], [1, 1], False, None) is NotImplemented


class Pooler(nn.Module):
    """Swin's pooler (adaptive_avg_pool1d over tokens), F.normalize of the embedding (CLIP), vector norms and a
    segment sum by scatter_add, into one loss."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, seg):
        y = self.lin(x)  # [B, T, 16]
        pooled = F.adaptive_avg_pool1d(y.transpose(1, 2), 1).flatten(1)  # [B, 16]
        emb = F.normalize(pooled, dim=-1)
        p3 = F.adaptive_avg_pool1d(y.transpose(1, 2), 3)  # uneven windows over T = 7
        sums = torch.zeros(4, 16).scatter_add(0, seg[:, None].expand(-1, 16), y[0])
        return (emb @ emb.t()).sum() + torch.linalg.vector_norm(y, ord=3, dim=-1).mean() + \
            torch.linalg.vector_norm(p3) + sums.square().mean()


def test_pool1d_norms_and_scatter_add_train():
    torch.manual_seed(0)
    model = Pooler()
    x, seg = torch.randn(2, 7, 16, requires_grad=True), torch.randint(0, 4, (7,))
    mod = aotfuse.load(aotfuse.build(model, (x, seg), train=True, targets=("sm_90",)).data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    x2, seg2 = torch.randn(2, 7, 16) * 2, torch.tensor([3, 3, 0, 1, 3, 0, 2])
    xa, xb = x2.clone().requires_grad_(), x2.clone().requires_grad_()
    loss, want = mod(xa, seg2), ref(xb, seg2)
    loss.backward()
    want.backward()
    assert rel(loss, want) < 1e-6
    assert rel(xa.grad, xb.grad) < 1e-5
    grads = dict(mod.named_parameters())
    for name, p in ref.named_parameters():
        assert rel(grads[name].grad, p.grad) < 1e-5, name
