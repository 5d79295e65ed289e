"""Training a model whose loss does not depend on some parameters (an unused head, a pooler the loss skips): eager
leaves their .grad None; aot_autograd refuses to trace them with a gradient, so joint/trace.py traces them frozen.
An example input that requires grad without the loss depending on it is refused with a remedy."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.errors import BuildError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.unused = nn.Linear(8, 3)  # e.g. a pooler the loss never reads
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        h = torch.tanh(self.body(x))
        k = self.scale.argmax().reshape(1)  # read, but not differentiably
        return (self.head(h).index_select(1, k) ** 2).mean()


def test_unused_parameters_get_no_gradient_like_eager():
    torch.manual_seed(0)
    model = Heads()
    res = aotfuse.build(model, (torch.randn(5, 8),), train=True, targets=("sm_90",))
    mod = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    x = torch.randn(5, 8)
    loss, want = mod(x), ref(x)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    grads = dict(mod.named_parameters())
    for name, p in ref.named_parameters():
        if p.grad is None:
            assert grads[name].grad is None, name
        else:
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert ref.unused.weight.grad is None and ref.scale.grad is None


def test_an_input_that_gets_no_gradient_is_refused():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, other):
            return self.lin(x).square().sum()

    with pytest.raises(BuildError, match="'other' require grad but the loss does not depend"):
        aotfuse.build(M(), (torch.randn(2, 4), torch.randn(2, 4, requires_grad=True)), train=True, targets=("sm_90",))
