"""An inference build of a forward that updates its own parameters or buffers in place is refused before anything
runs, naming them (export/capture.py). The exported program returns such updates as extra outputs that the call's
structure has no place for: RWKV's archive built, then failed at its first call ("the program returned 4 more
output(s)"). An update made once (RWKV rescales its weights on its first eval call) builds after one forward."""
from __future__ import annotations

import pytest
import torch

import aotfuse
from aotfuse.errors import BuildError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class _Counter(torch.nn.Module):
    """A buffer updated on every call (as a static KV cache or a step counter is)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x) * self.calls


class _ScaleOnce(torch.nn.Module):
    """A parameter rescaled in place on the first call only (RWKV's eval-mode rescaling)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scaled = False

    def forward(self, x):
        if not self.scaled:
            with torch.no_grad():
                self.lin.weight.div_(2.0)
            self.scaled = True
        return self.lin(x)


def test_a_buffer_updated_every_call_is_refused_by_name():
    with pytest.raises(BuildError, match=r"updates buffer 'calls' in place") as err:
        aotfuse.build(_Counter().eval(), (torch.randn(2, 4),), targets=("sm_90",))
    assert "static KV cache" in str(err.value)


def test_a_parameter_updated_once_builds_after_one_forward():
    model = _ScaleOnce().eval()
    x = torch.randn(2, 4)
    with pytest.raises(BuildError, match=r"updates parameter 'lin.weight' in place") as err:
        aotfuse.build(model, (x,), targets=("sm_90",))
    assert "run one forward before building" in str(err.value)
    assert not model.scaled  # export traced a copy of the call: the model itself was not rescaled
    with torch.no_grad():
        model(x)
    res = aotfuse.build(model, (x,), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    y = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(art(y), model(y))


def test_rwkv_is_refused_then_builds_after_one_forward():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "RwkvForCausalLM"):
        pytest.skip("transformers without RWKV")
    cfg = transformers.RwkvConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                                  intermediate_size=64, context_length=32, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.RwkvForCausalLM(cfg).eval()
    ids = torch.randint(3, 128, (2, 16))
    with pytest.raises(BuildError, match="rwkv.blocks.0.attention.output.weight"):
        aotfuse.build(model, (), example_kwargs={"input_ids": ids}, targets=("sm_90",))
    with torch.no_grad():
        model(input_ids=ids)
    res = aotfuse.build(model, (), example_kwargs={"input_ids": ids}, targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    fresh = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = art(input_ids=fresh), model(input_ids=fresh)
    for a, b in zip([got["logits"], *got["state"]], [want.logits, *want.state]):
        assert float((a - b).norm() / b.norm()) < 1e-5
