"""Recurrent layers (nn.LSTM / GRU / RNN) from their default zero state: the zero initial state makes a matmul
operand a constant, which a matmul template wrote as a rank-1 tile (a Triton compile error at build,
emit/template_mm._Operand). Inference and training against eager on the CPU path."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import aotfuse
import aotfuse.errors
from aotfuse.knobs import override
from aotfuse.testing.train_check import assert_training_matches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LAYERS = {"gru": nn.GRU, "rnn": nn.RNN}


class Loss(nn.Module):
    """The loss reads the output sequence and the final state."""

    def __init__(self, cls, final_state=True, bias=True):
        super().__init__()
        self.rnn = cls(8, 16, batch_first=True, bias=bias)
        self.final_state = final_state

    def forward(self, x):
        out, h = self.rnn(x)
        loss = out.square().mean()
        if self.final_state:
            for t in (h if isinstance(h, tuple) else (h,)):
                loss = loss + t.sin().sum()
        return loss


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_recurrent_layer_trains_from_the_zero_state(kind):
    torch.manual_seed(0)
    model = Loss(LAYERS[kind]).train()
    res = aotfuse.build(model, (torch.randn(2, 5, 8),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(2, 5, 8),), grad_rtol=1e-4, grad_atol=1e-5)


@pytest.mark.parametrize("kind", ["gru", "rnn"])
def test_loss_over_the_output_sequence_alone_trains(kind):
    torch.manual_seed(0)
    model = Loss(LAYERS[kind], final_state=False).train()
    res = aotfuse.build(model, (torch.randn(2, 5, 8),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(2, 5, 8),), grad_rtol=1e-4, grad_atol=1e-5)


class Stacked(nn.Module):
    """Two bidirectional LSTM layers (with biases), optionally projected, the loss over both outputs."""

    def __init__(self, proj_size=0):
        super().__init__()
        self.rnn = nn.LSTM(8, 16, num_layers=2, bidirectional=True, batch_first=True, proj_size=proj_size)

    def forward(self, x):
        out, (h, c) = self.rnn(x)
        return out.square().mean() + h.sin().sum() + c.cos().mean()


def test_lstm_with_biases_trains():
    """bias_ih and bias_hh: torch's fused LSTM layer gives both one gradient node, which aot_export_module cannot map
    to parameters; the trace routes nn.LSTM through its per-op form (joint/rnn.py), each bias its own gradient."""
    torch.manual_seed(0)
    model = Loss(nn.LSTM).train()
    res = aotfuse.build(model, (torch.randn(2, 5, 8),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(2, 5, 8),), grad_rtol=1e-4, grad_atol=1e-5)


@pytest.mark.parametrize("proj_size", [0, 4])
def test_stacked_bidirectional_lstm_trains(proj_size):
    torch.manual_seed(0)
    model = Stacked(proj_size).train()
    res = aotfuse.build(model, (torch.randn(3, 6, 8),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(3, 6, 8),), grad_rtol=1e-4, grad_atol=1e-5)


def test_lstm_inference_matches():
    torch.manual_seed(0)
    model = nn.LSTM(8, 16, num_layers=2, batch_first=True).eval()
    res = aotfuse.build(model, (torch.randn(2, 5, 8),), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    x = torch.randn(2, 5, 8)
    got, want = art(x), model(x)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
