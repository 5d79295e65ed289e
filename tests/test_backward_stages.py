"""A staged backward (partition/stages.py, runtime/training.py): the backward cut into programs that hand
their gradients to autograd in turn. CPU path: gradients and buffer updates as eager's, each stage's
parameter gradients reach autograd (hooks, hence DDP's buckets) before the next stage runs, a
retain_graph second backward, the build's record, and the refusals."""
from __future__ import annotations

import copy

import pytest
import torch

import aotfuse
from aotfuse.errors import BuildError
from aotfuse.runtime.explain import explain_report
from aotfuse.specs import load_spec, random_inputs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def gpt():
    model, inputs = load_spec("aotfuse.examples.gpt:demo_train(dropout=0.0)")
    res = aotfuse.build(model, inputs, train=True, targets=("sm_90",), step="split", backward_stages=3)
    return model, res


def test_stages_cover_the_gradients_and_the_build_says_why(gpt):
    _, res = gpt
    info = res.manifest.train
    assert res.manifest.programs == ("forward", "backward", "backward_1", "backward_2") == info.programs
    assert sorted(i for st in info.stages for i in st) == list(range(len(info.grads)))
    assert all(info.stages) and info.carries[-1] == 0 and all(c > 0 for c in info.carries[:-1])
    rec = res.report.partition["stages"]
    assert rec["programs"] == ["backward", "backward_1", "backward_2"] and "3 backward stages" in rec["why"]
    assert "backward programs backward, backward_1, backward_2: 3 backward stages" in explain_report(res.report)
    # every program's decisions are in the report, and survive the archive
    assert len(res.report.stages) == 2
    from aotfuse.runtime.explain import explain
    text = explain(res.data, program="backward_2")
    assert text.startswith("== backward_2 program ==") and "kernel launches" in text
    assert "== backward_1 program ==" in explain(res.data)


def test_gradients_match_eager_and_reach_autograd_stage_by_stage(gpt):
    model, res = gpt
    pm = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    events = []
    run = pm._run
    pm._run = lambda progs, name, ins, **kw: (events.append(name), run(progs, name, ins, **kw))[1]
    for n, p in pm.named_parameters():
        p.register_post_accumulate_grad_hook(lambda t, n=n: events.append(n))
    info = res.manifest.train
    for seed in (1, 2):
        events.clear()
        for m in (pm, ref):
            m.zero_grad(set_to_none=True)
        batch = random_inputs(pm._art.input_specs, device="cpu", seed=seed)
        lo, lr = pm(*batch), ref(*batch)
        lo.backward()
        lr.backward()
        assert _rel(lo, lr) < 1e-6
        want = dict(ref.named_parameters())
        for n, p in pm.named_parameters():
            assert _rel(p.grad, want[n].grad) < 1e-4, n
        # each stage's parameters: their hooks ran after that stage's program and before the next one
        assert [e for e in events if e.startswith(("forward", "backward"))] == list(info.programs)
        for k, (name, st) in enumerate(zip(info.programs[1:], info.stages)):
            after = events.index(name)
            before = events.index(info.programs[2 + k]) if 2 + k < len(info.programs) else len(events)
            names = {info.grads[i][1] for i in st if info.grads[i][0] == "param"}
            assert names == set(events[after + 1:before]), (name, events)


def test_retain_graph_runs_the_stages_again(gpt):
    model, res = gpt
    pm = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    batch = random_inputs(pm._art.input_specs, device="cpu", seed=5)
    for m in (pm, ref):
        loss = m(*batch)
        loss.backward(retain_graph=True)
        (0.5 * loss).backward()
    want = dict(ref.named_parameters())
    for n, p in pm.named_parameters():
        assert _rel(p.grad, want[n].grad) < 1e-4, n


class _BNStack(torch.nn.Module):
    """Four Linear + GELU + train-mode BatchNorm1d layers (running statistics updated by the forward), MSE loss."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU(),
                                                              torch.nn.BatchNorm1d(d)) for _ in range(4))

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.mse_loss(x, y)


def test_buffer_updates_and_input_gradients_with_stages():
    """Updated buffers (BatchNorm's running statistics) and an input that requires grad: the input's
    gradient comes from whichever stage computes it and is handed over with the last one."""
    torch.manual_seed(0)
    model = _BNStack().train()
    x, y = torch.randn(16, 32).requires_grad_(), torch.randn(16, 32)
    res = aotfuse.build(model, (x, y), train=True, targets=("sm_90",), step="split", backward_stages=2)
    assert len(res.manifest.train.stages) == 2 and res.manifest.train.mutated_buffers
    pm = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        xs, ys = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
        xa, xb = xs.clone().requires_grad_(), xs.clone().requires_grad_()
        for m in (pm, ref):
            m.zero_grad(set_to_none=True)
        lo, lr = pm(xa, ys), ref(xb, ys)
        lo.backward()
        lr.backward()
        assert _rel(lo, lr) < 1e-5 and _rel(xa.grad, xb.grad) < 1e-4
        want = dict(ref.named_parameters())
        for n, p in pm.named_parameters():
            assert _rel(p.grad, want[n].grad) < 1e-4, n
        bufs = dict(ref.named_buffers())
        for n, b in pm.named_buffers():
            assert _rel(b.float(), bufs[n].float()) < 1e-5, n


def test_one_stage_is_the_plain_backward_and_a_fused_step_is_refused():
    model, inputs = load_spec("aotfuse.examples.gpt:demo_train(dropout=0.0)")
    res = aotfuse.build(model, inputs, train=True, targets=("sm_90",), step="split", backward_stages=1)
    assert res.manifest.programs == ("forward", "backward") and res.manifest.train.stages == ()
    with pytest.raises(BuildError, match="backward_stages=2 with a fused step"):
        aotfuse.build(model, inputs, train=True, targets=("sm_90",), step="step", backward_stages=2)


def _sgd_in_backward(model, lr: float = 0.1):
    """An optimizer step in each parameter's gradient hook (ZeRO-style overlap): the parameter changes
    as soon as its gradient is out, while the rest of the backward still runs."""
    def step(p):
        with torch.no_grad():
            p.add_(p.grad, alpha=-lr)
        p.grad = None
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)


@pytest.mark.parametrize("stages", [2, 4])
def test_an_optimizer_step_in_a_gradient_hook_never_changes_what_a_later_stage_reads(stages):
    """dX = dY @ W reads W: no stage after the one that hands W's gradient over may read it."""
    torch.manual_seed(0)
    model = _BNStack().train()
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    res = aotfuse.build(model, (x, y), train=True, targets=("sm_90",), step="split", backward_stages=stages)
    assert len(res.manifest.train.stages) > 1
    pm = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    for m in (pm, ref):
        _sgd_in_backward(m)
    for seed in (1, 2, 3):
        g = torch.Generator().manual_seed(seed)
        xs, ys = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
        lo, lr = pm(xs, ys), ref(xs, ys)
        lo.backward()
        lr.backward()
        assert _rel(lo, lr) < 1e-5
    want = dict(ref.named_parameters())
    for n, p in pm.named_parameters():
        assert _rel(p, want[n]) < 1e-5, n


def test_loss_changed_in_place_then_backward(gpt):
    model, res = gpt
    pm = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    batch = random_inputs(pm._art.input_specs, device="cpu", seed=7)
    for m in (pm, ref):
        loss = m(*batch)
        loss /= 4  # gradient accumulation's scaling, in place
        loss.backward()
    want = dict(ref.named_parameters())
    for n, p in pm.named_parameters():
        assert _rel(p.grad, want[n].grad) < 1e-4, n


def test_a_second_backward_without_retain_graph_is_torchs_error_not_doubled_gradients(gpt):
    _, res = gpt
    pm = aotfuse.load(res.data, device="cpu").as_module()
    loss = pm(*random_inputs(pm._art.input_specs, device="cpu", seed=8))
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_a_partial_backward_then_a_full_one(gpt):
    """autograd.grad of the first stage's parameters runs stage 0 alone; the full backward after it starts over."""
    model, res = gpt
    pm = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    info = res.manifest.train
    first = [info.grads[i][1] for i in info.stages[0] if info.grads[i][0] == "param"]
    batch = random_inputs(pm._art.input_specs, device="cpu", seed=9)
    got = {}
    for tag, m in (("pm", pm), ("ref", ref)):
        params = dict(m.named_parameters())
        loss = m(*batch)
        got[tag] = torch.autograd.grad(loss, [params[n] for n in first], retain_graph=True)
        loss.backward()
    for a, b in zip(got["pm"], got["ref"]):
        assert _rel(a, b) < 1e-4
    want = dict(ref.named_parameters())
    for n, p in pm.named_parameters():
        assert _rel(p.grad, want[n].grad) < 1e-4, n


def test_carries_keep_their_buffers_and_gradients_are_unshared():
    """A stage's carries are read by the next stage's CUDA graph at the addresses this stage's graph
    wrote (keyed by address): they are never copied, even when two carries share one buffer; a gradient
    sharing a buffer with a carry or with another gradient gets its own copy (an in-place change to a
    `.grad` must not reach anything else)."""
    import torch

    from aotfuse.runtime.training import _unshared

    a, b = torch.randn(8), torch.randn(8)
    g0, g1, g2 = a, a, b  # two gradients on one buffer, one on its own
    c0, c1 = a, a  # two carries on that buffer too
    out = _unshared([g0, g1, g2, c0, c1], keep=3)
    assert out[3] is c0 and out[4] is c1
    assert out[2] is g2  # shares with nothing
    for g in out[:2]:
        assert g.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
        assert torch.equal(g, a)
    assert out[0].untyped_storage().data_ptr() != out[1].untyped_storage().data_ptr()
    # without carries (a single backward program): the first owner keeps the buffer, as before
    plain = _unshared([g0, g1, g2])
    assert plain[0] is g0 and plain[1] is not g1 and plain[2] is g2
