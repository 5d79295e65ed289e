"""A model-style call of an archive (runtime/calling.py): keyword inputs, the model's output structure."""
from __future__ import annotations

import collections

import pytest
import torch

import aotfuse
from aotfuse.errors import GuardError


class Output(collections.OrderedDict):  # stands in for a transformers ModelOutput (a dict subclass)
    def __getattr__(self, k):
        return self[k]


# as transformers registers ModelOutput: a pytree node keyed by its fields
torch.utils._pytree.register_pytree_node(
    Output, lambda o: (list(o.values()), list(o.keys())), lambda values, keys: Output(zip(keys, values)))


class Model(torch.nn.Module):
    def __init__(self, cls=dict):
        super().__init__()
        self.lin = torch.nn.Linear(6, 5)
        self.cls = cls

    def forward(self, x, bias=None, labels=None, scale=1.0):
        logits = self.lin(x) * scale + bias
        return self.cls(loss=((logits - labels) ** 2).mean(), logits=logits, pair=(logits.sum(-1), x * 2))


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 6, generator=g), torch.randn(5, generator=g), torch.randn(3, 5, generator=g)


@pytest.fixture(scope="module")
def built():
    torch.manual_seed(0)
    model = Model(Output)
    x, b, lab = _inputs(0)
    res = aotfuse.build(model, (x,), example_kwargs={"bias": b, "labels": lab, "scale": 0.5}, targets=("sm_90",))
    return model, res


def test_keywords_in_model_structure_out(built):
    model, res = built
    assert res.manifest.call["inputs"] == {"positional": 1, "keywords": ["bias", "labels"], "constants": {"scale": 0.5}}
    art = aotfuse.load(res.data, device="cpu")
    x, b, lab = _inputs(1)  # fresh inputs, not the example's
    got = art(x, labels=lab, bias=b)  # keyword order does not matter
    want = model(x, bias=b, labels=lab, scale=0.5)
    assert type(got) is Output and list(got) == ["loss", "logits", "pair"] and isinstance(got.pair, tuple)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert art.run("forward", x, b, lab)[1].shape == (3, 5)  # flat program inputs still work
    flat = art(x, b, lab)  # every input positionally, in program order: the same call
    torch.testing.assert_close(flat.logits, got.logits, rtol=0, atol=0)


@pytest.mark.parametrize("call, match", [
    (lambda art, x, b, lab: art(x, bias=b), "missing keyword input.*labels"),
    (lambda art, x, b, lab: art(x, bias=b, labels=lab, scale=2.0), "scale=2.0, but the archive was built with "
                                                                   "scale=0.5"),
    (lambda art, x, b, lab: art(x, bias=b, labels=lab, scale=1), "scale=1, but .* built with scale=0.5"),
    (lambda art, x, b, lab: art(x, bias=b, labels=lab, shift=1.0), "unknown keyword input.*shift"),
    (lambda art, x, b, lab: art(x, b), "expected 1 positional"),
])
def test_bad_calls_name_the_input(built, call, match):
    art = aotfuse.load(built[1].data, device="cpu")
    with pytest.raises(GuardError, match=match):
        call(art, *_inputs(2))


def test_a_build_constant_may_be_passed_again_with_its_value(built):
    """transformers-style calls repeat their flags (CLIP's return_loss=True): the value the archive was built
    with is accepted, inference and training alike; another value is refused above (test_bad_calls_name_the_input)."""
    model, res = built
    art = aotfuse.load(res.data, device="cpu")
    x, b, lab = _inputs(5)
    got = art(x, bias=b, labels=lab, scale=0.5)
    torch.testing.assert_close(got.logits, model(x, bias=b, labels=lab, scale=0.5).logits, rtol=1e-5, atol=1e-6)
    res = aotfuse.build(Model(dict), (x,), example_kwargs={"bias": b, "labels": lab, "scale": 2.0}, train=True,
                        targets=("sm_90",))
    assert res.manifest.call["inputs"]["constants"] == {"scale": 2.0}
    mod = aotfuse.load(res.data, device="cpu").as_module()
    mod(x, bias=b, labels=lab, scale=2.0)["loss"].backward()


def test_constant_comparison_edge_cases():
    import enum

    from aotfuse.runtime.calling import _same_constant, plain_constant

    class Mode(enum.IntEnum):
        FAST = 3

    assert plain_constant(Mode.FAST) == 3 and type(plain_constant(Mode.FAST)) is int
    assert _same_constant(Mode.FAST, 3) and _same_constant(float("nan"), float("nan"))
    assert not _same_constant(True, 1) and not _same_constant(1, 1.0) and not _same_constant(-0.0, 0.0)
    assert _same_constant(None, None) and not _same_constant(None, False)


def test_train_module_called_like_the_model():
    torch.manual_seed(0)
    model = Model(dict)
    x, b, lab = _inputs(3)
    res = aotfuse.build(model, (x,), example_kwargs={"bias": b, "labels": lab}, train=True, targets=("sm_90",))
    mod = aotfuse.load(res.data, device="cpu").as_module()
    x, b, lab = _inputs(4)
    out = mod(x, bias=b, labels=lab)
    assert list(out) == ["loss"]  # a train archive returns the loss, in the model's output structure
    out["loss"].backward()
    want = model(x, bias=b, labels=lab)["loss"]
    want.backward()
    torch.testing.assert_close(out["loss"], want, rtol=1e-5, atol=1e-6)
    for (n, p), (_, q) in zip(mod.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)


Pair = collections.namedtuple("Pair", "doubled total")


class _ReturnsMax(torch.nn.Module):
    def forward(self, x):
        return torch.max(x, 1)


class _ReturnsPair(torch.nn.Module):
    def forward(self, x):
        return Pair(x * 2, x.sum(0))


@pytest.mark.parametrize("model", [_ReturnsMax(), _ReturnsPair()], ids=["structseq", "namedtuple"])
def test_structseq_and_namedtuple_outputs_come_back_as_the_models(model):
    """torch.return_types.max (a structseq) and a namedtuple: recorded by field names, rebuilt as the
    model's own class (it is loaded in this process)."""
    x = torch.randn(4, 6)
    res = aotfuse.build(model, (x,), targets=("sm_90",))
    assert res.manifest.call["outputs"]["kind"] == "dict"
    art = aotfuse.load(res.data, device="cpu")
    x2 = torch.randn(4, 6)
    got, want = art(x2), model(x2)
    assert type(got) is type(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
