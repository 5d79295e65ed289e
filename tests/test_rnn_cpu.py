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


def test_lstm_with_biases_is_refused_with_a_remedy():
    """torch's aot_export_module maps gradients to parameters by node name: an LSTM's bias_ih and bias_hh gradients
    are one node there. A clear BuildError with what to do, not torch's internal assertion."""
    with pytest.raises(aotfuse.errors.BuildError, match="bias_ih and bias_hh") as info:
        aotfuse.build(Loss(nn.LSTM).train(), (torch.randn(2, 5, 8),), train=True, targets=("sm_90",))
    assert "nn.Linear" in info.value.remedy

