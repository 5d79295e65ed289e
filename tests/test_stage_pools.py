"""A staged backward's graphs share memory pools (graph_cache.PoolChain, issue 12.2), on the CPU: the module's
CUDA graphs with the capture replaced by tests/graph_standin.py's stand-in, whose replays overwrite (NaN) every
output of every stage graph captured after them in their pool. The stages of a plain step capture once, into
one pool; gradients follow eager's when a later stage's gradients are held while an earlier stage runs again
(gradient accumulation with the first stage frozen, a retain_graph second backward)."""
from __future__ import annotations

import copy

import pytest
import torch

import aotfuse
from aotfuse.runtime import graphs
from aotfuse.specs import random_inputs

import graph_standin

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class _MLP(torch.nn.Module):
    """Four Linear + GELU layers, MSE loss: a staged backward in three programs, fast in the interpreter. Weight
    gradients of 16 KiB: above knobs.graph_copy_bytes, so handed out in place (held while in .grad)."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU())
                                          for _ in range(4))

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.mse_loss(x, y)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = _MLP()
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    data = aotfuse.build(model, (x, y), train=True, targets=("sm_90",), step="split", backward_stages=3).data
    assert len(aotfuse.load(data, device="cpu").manifest.train.stages) == 3
    return model, data


@pytest.fixture
def graphed(gpt, monkeypatch):
    """(module with stand-in graphs, eager copy, the stand-in's pools)."""
    model, data = gpt
    pools = graph_standin.Pools()
    graph_standin.patch(monkeypatch, pools.record)
    monkeypatch.setattr(graphs, "_new_pool", pools.new_pool)
    pm = aotfuse.load(data, device="cpu").as_module()
    pm._graphs_asked = True  # kept whatever graphs_pay would say of the stand-in
    pm._graphs, _ = pm._make_graphs(pm._art.executors)
    pm._static.graphs = pm._graphs
    return pm, copy.deepcopy(model), pools


def _check(pm, ref, tag):
    want = dict(ref.named_parameters())
    for n, p in pm.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and _rel(p.grad, want[n].grad) < 1e-4, (tag, n)


def _backward(pm, ref, seeds, retain=False):
    for seed in seeds:
        batch = random_inputs(pm._art.input_specs, device="cpu", seed=seed)
        for m in (pm, ref):
            loss = m(*batch)
            if retain:
                loss.backward(retain_graph=True)
                (0.5 * loss).backward()
            else:
                loss.backward()


def _zero(*ms):
    for m in ms:
        m.zero_grad(set_to_none=True)


def _stages(pm):
    return [g for name, g in pm._graphs.items() if name != "forward"]


def test_plain_steps_capture_each_stage_once_into_one_pool(graphed):
    pm, ref, pools = graphed
    for step in range(2):
        _zero(pm, ref)
        _backward(pm, ref, [step])
        _check(pm, ref, step)
    assert [g.stats["captures"] for g in _stages(pm)] == [1, 1, 1]
    assert [g.stats["replays"] for g in _stages(pm)] == [2, 2, 2]
    assert len(pools.captured) == 1 and len(pools.captured[("pool", 0)]) == 3  # the forward's pool is its own


def test_an_earlier_stage_never_replays_over_a_later_stages_held_gradients(graphed):
    """The first stage's parameters frozen (its gradients dropped by autograd, its output set free again)
    while the later stages' gradients accumulate over micro-batches in .grad, which is their output sets: the
    first stage's graph must not replay in that pool, whose later members' outputs it may overwrite."""
    pm, ref, pools = graphed
    frozen = {pm._names[i] for i in pm._stage_params[0]}
    for m in (pm, ref):
        for n, p in m.named_parameters():
            p.requires_grad_(n not in frozen)
    _zero(pm, ref)
    _backward(pm, ref, [1, 2])  # two micro-batches: the second adds into the first's .grad
    want = dict(ref.named_parameters())
    for n, p in pm.named_parameters():
        if n in frozen:
            assert p.grad is None and want[n].grad is None
        else:
            assert torch.isfinite(p.grad).all() and _rel(p.grad, want[n].grad) < 1e-4, n
    assert _stages(pm)[0].stats["captures"] == 2 and len(pools.captured) == 2
    _zero(pm, ref)
    _backward(pm, ref, [3], retain=True)  # a second backward through one forward adds into .grad
    for n, p in pm.named_parameters():
        assert n in frozen or _rel(p.grad, want[n].grad) < 1e-4, n
    assert all(g.stats["eager_calls"] == 0 for g in _stages(pm))
