"""Empty intermediate values (a zero-size dim): nothing to compute; a concatenation leaves them out (Phi-3's
rotary embedding: q[..., rotary_dim:] is empty when rotary_dim == head_dim, and so is its gradient's slice),
any other reader is refused naming the op, before anything runs."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.testing.train_check import assert_training_matches
from aotfuse.errors import UnsupportedOpError


class PartialRotary(nn.Module):
    def __init__(self, d=16, rot=16):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.rot = rot

    def forward(self, x):
        q = self.lin(x)
        r, p = q[..., :self.rot], q[..., self.rot:]
        return torch.cat([r.sin() * 2 + r, p], dim=-1)


class Loss(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).square().mean()


def test_empty_half_in_inference():
    torch.manual_seed(0)
    model = PartialRotary()
    res = aotfuse.build(model, (torch.randn(2, 5, 16),), targets=("sm_90",))
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(aotfuse.load(res.data, device="cpu")(x), model(x), rtol=1e-5, atol=1e-6)


def test_empty_half_in_training():
    torch.manual_seed(0)
    model = Loss(PartialRotary())
    res = aotfuse.build(model, (torch.randn(2, 5, 16),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(2, 5, 16),), grad_rtol=1e-5)


class SumOfEmpty(nn.Module):
    def forward(self, x):
        return x * 2 + x[..., 16:].sum()


def test_empty_read_elsewhere_is_refused():
    with pytest.raises(UnsupportedOpError, match=r"at node 'slice.*': its result is empty \(shape \[2, 5, 0\]\) and "
                                                 r"sum.* reads it"):
        aotfuse.build(SumOfEmpty(), (torch.randn(2, 5, 16),), targets=("sm_90",))


def test_an_op_without_a_rule_is_named_before_its_empty_output():
    """EmbeddingBag with offsets: `_embedding_bag` has no rule and one of its outputs is empty; the error names
    the op as unsupported, not an "empty computation" the user never wrote."""
    import aotfuse
    from aotfuse.errors import UnsupportedOpError

    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e = torch.nn.EmbeddingBag(10, 4, mode="sum")

        def forward(self, x, o):
            return self.e(x, o)

    with pytest.raises(UnsupportedOpError, match="_embedding_bag") as info:
        aotfuse.build(Bag(), (torch.randint(0, 10, (8,)), torch.tensor([0, 3, 5])), targets=("sm_90",))
    assert "result is empty" not in str(info.value)


def test_a_refusal_names_the_models_line_not_torch_nn():
    """The innermost frame outside torch and aotfuse: the model's own line, not torch.nn's module code."""
    import aotfuse
    from aotfuse.errors import UnsupportedOpError

    class Pool(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pool = torch.nn.AdaptiveMaxPool2d(3)

        def forward(self, x):
            return self.pool(x) * 2

    with pytest.raises(UnsupportedOpError, match="adaptive_max_pool2d") as info:
        aotfuse.build(Pool(), (torch.randn(1, 2, 8, 8),), targets=("sm_90",))
    assert "test_empty_values.py" in str(info.value) and "torch/nn" not in str(info.value)
