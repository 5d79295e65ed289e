"""Tensors a training forward makes from Python values (`torch.tensor(2.0)`, the value written by `t[:, 0] = 1`,
T5's and Whisper's shift of the labels) reach the joint graph as get_attr constants: joint/trace.py lifts them
to fixed buffers of the train archive. Loss and gradients against eager on the CPU path."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.testing.opcases import TRAIN_CASES

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class ShiftRight(nn.Module):
    """Decoder inputs from the labels as seq2seq models make them: shifted right, a start token written in."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, labels):
        dec = labels.new_zeros(labels.shape)
        dec[:, 1:] = labels[:, :-1].clone()
        dec[:, 0] = 3
        return F.cross_entropy(self.head(self.emb(dec)).view(-1, 32), labels.view(-1))


class Consts(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return (torch.maximum(self.lin(x), torch.tensor(0.25)) * torch.tensor([2.0, -1.0]).repeat(8)).square().mean()


def _check(model, inputs, fresh):
    res = aotfuse.build(model, inputs, train=True, targets=("sm_90",))
    mod = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    loss, want = mod(*fresh), ref(*fresh)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    grads = dict(mod.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    return res


def test_shifted_labels_train():
    torch.manual_seed(0)
    _check(ShiftRight(), (torch.randint(0, 32, (2, 8)),), (torch.randint(0, 32, (2, 8)),))


def test_tensor_constants_train():
    torch.manual_seed(0)
    _check(Consts(), (torch.randn(4, 16),), (torch.randn(4, 16) * 2,))


def test_setitem_on_an_activation_train():
    torch.manual_seed(0)
    case = next(c for c in TRAIN_CASES if c.name == "setitem_train")
    model, inputs = case.make(torch.float32)
    _check(model, inputs, (torch.randn(4, 6) * 3 + 1,))
