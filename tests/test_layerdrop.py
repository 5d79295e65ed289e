"""LayerDrop checks (`torch.rand([]) < p`) in the training trace: decided by the draw's range when it decides them
(aotfuse/joint/layerdrop.py), refused naming the model's line when it does not."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.errors import BuildError
from aotfuse.joint.layerdrop import decide
from test_lifted_constants import _check as _train_check  # build, one step, loss and gradients vs eager


class LayerDropNet(nn.Module):
    def __init__(self, layerdrop: float, reflected: bool = False):
        super().__init__()
        self.layerdrop, self.reflected = layerdrop, reflected
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            p = torch.rand([])
            skip = (self.layerdrop > p) if self.reflected else (p < self.layerdrop)
            if self.training and skip:
                continue
            x = torch.tanh(layer(x))
        return (x * x).mean()


def test_decide_by_range():
    assert decide("lt", 0.0) is False and decide("lt", 1.0) is True and decide("lt", 0.5) is None
    assert decide("le", -0.1) is False and decide("le", 0.0) is None
    assert decide("gt", -1) is True and decide("gt", 1.0) is False and decide("gt", 0.0) is None
    assert decide("ge", 0.0) is True and decide("ge", 1.0) is False


@pytest.mark.parametrize("reflected", [False, True])
def test_layerdrop_zero_trains_like_eager(reflected):
    torch.manual_seed(0)
    _train_check(LayerDropNet(0.0, reflected).train(), (torch.randn(4, 16),), (torch.randn(4, 16) * 2,))


def test_layerdrop_that_can_skip_is_refused_with_the_line():
    model = LayerDropNet(0.5).train()
    with pytest.raises(BuildError, match=r"test_layerdrop.py:\d+: if self.training and skip"):
        aotfuse.build(model, (torch.randn(4, 16),), train=True)


def test_model_line_under_a_folder_named_torch():
    """A venv under /opt/torch/ (the GPU machine's): the model's frame is still found, by package directory."""
    from aotfuse.joint.trace import model_line

    where = "/opt/torch/.venv/lib/python3.12/site-packages/transformers/models/m.py"
    try:
        exec(compile("\n\nraise ValueError('data')", where, "exec"))
    except ValueError as exc:
        assert model_line(exc) == f"{where}:3: "
