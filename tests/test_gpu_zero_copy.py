"""GPU tier (skipped without CUDA): zero-copy graph calls (runtime/graphs.py) under real CUDA graphs.

Outputs alias the graph's buffers and stay valid while held; a held set makes the next call take
another graph; training keeps grads and saved tensors in graph memory (held grads across steps,
gradient accumulation, two forwards before one backward); two streams; and a call moves no bytes
besides the program's own kernels."""
from __future__ import annotations

import copy

import pytest
import torch

import aotfuse
from aotfuse.specs import load_spec, random_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _arch():
    major, minor = torch.cuda.get_device_capability()
    return (f"sm_{major}{minor}",)


@pytest.fixture(scope="module")
def demo():
    model, inputs = load_spec("aotfuse.examples.gpt:demo")
    data = aotfuse.build(model, inputs, targets=_arch()).data
    return model.cuda().eval(), data


@pytest.fixture(scope="module")
def demo_train():
    model, inputs = load_spec("aotfuse.examples.gpt:demo_train(dropout=0.0)")
    return model, aotfuse.build(model, inputs, train=True, targets=_arch(), step="split").data


@pytest.fixture(scope="module")
def demo_step():
    model, inputs = load_spec("aotfuse.examples.gpt:demo_train(dropout=0.0)")
    return model, aotfuse.build(model, inputs, train=True, targets=_arch(), step="auto").data


def _entries(gp):
    return [e for fam in gp._families.values() for e in fam.cache.entries]


def test_held_outputs_stay_valid_and_take_another_graph(demo):
    model, data = demo
    art = aotfuse.load(data, device="cuda")
    gp = art._forward_graph
    xs = [random_inputs(art.input_specs, device="cuda", seed=s) for s in range(3)]
    with torch.no_grad():
        want = [model(*x) for x in xs]
        y0 = art(*xs[0])
        bufs = [t.data_ptr() for e in _entries(gp) for t in e.outputs.outs if t is not None]
        assert y0.data_ptr() in bufs  # the graph's own buffer, handed out: no clone
        y1 = art(*xs[1])  # y0 held: another graph, y0 untouched
        assert y1.data_ptr() != y0.data_ptr() and gp.stats["captures"] == 2
        assert rel(y0, want[0]) < 1e-4 and rel(y1, want[1]) < 1e-4
        addr0 = y0.data_ptr()
        del y0
        y2 = art(*xs[2])  # set 0 free again: replayed in place
        assert y2.data_ptr() == addr0 and gp.stats["captures"] == 2
        assert rel(y2, want[2]) < 1e-4 and rel(y1, want[1]) < 1e-4
    assert gp.stats["eager_calls"] == 0


def test_two_streams_keep_their_own_graphs(demo):
    model, data = demo
    art = aotfuse.load(data, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    outs = []
    with torch.no_grad():
        for i, s in enumerate((s1, s2, s1, s2)):
            with torch.cuda.stream(s):
                x = random_inputs(art.input_specs, device="cuda", seed=10 + i)
                outs.append((x, art(*x)))  # held: each stream rotates its own sets
        torch.cuda.synchronize()
        for x, y in outs:
            assert rel(y, model(*x)) < 1e-4
    assert len(art._forward_graph._families) == 2
    assert art._forward_graph.stats["captures"] == 4


def test_a_large_input_and_output_move_no_bytes():
    class Softmax(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x, dim=-1)

    x = torch.randn(1024, 4096, dtype=torch.bfloat16)
    art = aotfuse.load(aotfuse.build(Softmax(), (x,), targets=_arch()).data, device="cuda")
    x = x.cuda()
    assert art._forward_graph.keyed == (0,)  # read in place, by address
    for _ in range(3):
        y = art(x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            y = art(x)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any(n.startswith("aotf_") for n in names), names
    assert not [n for n in names if "memcpy" in n.lower() or "copy" in n.lower()], names
    assert rel(y, torch.softmax(x.float(), -1)) < 3e-2


def _step(m, batches, params):
    for p in params:
        p.grad = None
    for b in batches:
        m(*b).backward()


def _grads(m):
    return {n: p.grad for n, p in m.named_parameters()}


def _check_grads(pm, ref, tag):
    """pm's grads against ref's. A function, so that no gradient stays referenced by a loop variable
    (a kept gradient keeps its graph's output set, and the next backward would take another)."""
    want = _grads(ref)
    for n, g in _grads(pm).items():
        assert rel(g, want[n]) < 1e-3, (tag, n)


def test_training_grads_held_across_steps_and_saved_tensors_read_in_place(demo_train):
    model, data = demo_train
    pm = aotfuse.load(data, device="cuda").as_module()
    ref = copy.deepcopy(model).cuda()
    batch = random_inputs(pm._art.input_specs, device="cuda", seed=0)
    _step(pm, [batch], list(pm.parameters()))
    _step(ref, [batch], list(ref.parameters()))
    kept = _grads(pm)  # held across the next steps, never cloned
    want_kept = {n: g.clone() for n, g in _grads(ref).items()}
    fwd, bwd = pm._graphs["forward"], pm._graphs["backward"]
    assert bwd.keyed and not fwd.keyed  # saved tensors keyed; token ids copied
    # a gradient autograd stored is the backward graph's buffer (small ones are clones)
    bufs = {t.data_ptr() for e in _entries(bwd) for t in e.outputs.outs if t is not None}
    large = [g for g in kept.values() if g.untyped_storage().nbytes() > bwd.copy_bytes]
    assert large and all(g.data_ptr() in bufs for g in large)
    for step in range(1, 4):
        batch = random_inputs(pm._art.input_specs, device="cuda", seed=step)
        _step(pm, [batch], list(pm.parameters()))
        _step(ref, [batch], list(ref.parameters()))
        _check_grads(pm, ref, step)
    for n, g in kept.items():
        assert rel(g, want_kept[n]) < 1e-3, n
    # the forward's saved tensors were read where its graph wrote them: the backward's key is
    # the forward set's addresses
    fsets = {tuple(t.data_ptr() for t in e.outputs.outs if t is not None) for e in _entries(fwd)}
    assert all(any(set(e.key) <= set(f) for f in fsets) for e in _entries(bwd))
    assert fwd.stats["captures"] == 1 and bwd.stats["captures"] == 2  # set 1 kept by `kept`
    assert fwd.stats["eager_calls"] == bwd.stats["eager_calls"] == 0


def test_gradient_accumulation_and_two_forwards_before_one_backward(demo_train):
    model, data = demo_train
    pm = aotfuse.load(data, device="cuda").as_module()
    ref = copy.deepcopy(model).cuda()
    for step in range(3):  # two micro-batches per step: the second backward adds into .grad
        batches = [random_inputs(pm._art.input_specs, device="cuda", seed=100 + 2 * step + i) for i in range(2)]
        _step(pm, batches, list(pm.parameters()))
        _step(ref, batches, list(ref.parameters()))
        _check_grads(pm, ref, step)
    b1, b2 = (random_inputs(pm._art.input_specs, device="cuda", seed=200 + i) for i in range(2))
    for m in (pm, ref):  # both forwards' saved tensors alive at once
        for p in m.parameters():
            p.grad = None
        (m(*b1) + 0.5 * m(*b2)).backward()
    _check_grads(pm, ref, "two forwards")
    fwd, bwd = pm._graphs["forward"], pm._graphs["backward"]
    assert fwd.stats["captures"] == 2  # a second output set only when two forwards were alive
    assert bwd.stats["captures"] == 3  # .grad holds set 1 during the 2nd micro-batch; 2nd forward's key
    assert fwd.stats["eager_calls"] == bwd.stats["eager_calls"] == 0


def test_fused_step_grads_held_accumulated_and_scaled(demo_step):
    """One fused-step program: gradients held across steps stay valid (a held set takes another graph),
    micro-batches accumulate, and two forwards alive before one backward of `a + 0.5 * b` get their
    gradients scaled in place by 1 and 0.5 (emit/scale.py)."""
    model, data = demo_step
    pm = aotfuse.load(data, device="cuda").as_module()
    assert pm._art.manifest.programs == ("step",)
    ref = copy.deepcopy(model).cuda()
    batch = random_inputs(pm._art.input_specs, device="cuda", seed=0)
    _step(pm, [batch], list(pm.parameters()))
    _step(ref, [batch], list(ref.parameters()))
    kept = _grads(pm)
    want_kept = {n: g.clone() for n, g in _grads(ref).items()}
    for step in range(1, 4):
        batches = [random_inputs(pm._art.input_specs, device="cuda", seed=10 * step + i) for i in range(2)]
        _step(pm, batches, list(pm.parameters()))
        _step(ref, batches, list(ref.parameters()))
        _check_grads(pm, ref, step)
    for n, g in kept.items():
        assert rel(g, want_kept[n]) < 1e-3, n
    b1, b2 = (random_inputs(pm._art.input_specs, device="cuda", seed=200 + i) for i in range(2))
    for m in (pm, ref):
        for p in m.parameters():
            p.grad = None
        (m(*b1) + 0.5 * m(*b2)).backward()
    _check_grads(pm, ref, "two forwards, scaled")
    st = pm._graphs["step"].stats
    assert st["eager_calls"] == 0 and st["captures"] >= 2


class _CrossEntropy(torch.nn.Module):
    def forward(self, logits, target):
        return torch.nn.functional.cross_entropy(logits.float(), target)


@pytest.mark.parametrize("step", ["split", "step"])
def test_a_large_batch_over_few_kernels_runs_without_graphs_and_copies_nothing(step):
    """A loss over 2048 x 8192 bf16 logits: a graph would copy the 32 MiB batch into its static buffer
    on every call (runtime/graphs.graphs_pay), more than the host time of the few launches it saves, so
    the module runs its programs without graphs: no device-to-device copy, gradients as eager's."""
    L = torch.randn(2048, 8192, dtype=torch.bfloat16).requires_grad_()
    t = torch.randint(0, 8192, (2048,))
    data = aotfuse.build(_CrossEntropy(), (L, t), train=True, targets=_arch(), step=step).data
    pm = aotfuse.load(data, device="cuda").as_module()
    assert pm._graphs is None and pm.graphs_why.startswith("no CUDA graphs: copying"), pm.graphs_why
    forced = aotfuse.load(data, device="cuda").as_module(cuda_graphs=True)
    assert forced._graphs is not None and "asked for" in forced.graphs_why
    for seed in range(2):
        torch.manual_seed(seed)
        x = torch.randn(2048, 8192, dtype=torch.bfloat16, device="cuda").requires_grad_()
        tc = torch.randint(0, 8192, (2048,), device="cuda")
        ref = torch.nn.functional.cross_entropy(x.float(), tc)
        (gref,) = torch.autograd.grad(ref, x)
        for m in (pm, forced):
            xs = x.detach().requires_grad_()
            loss = m(xs, tc)
            loss.backward()
            assert rel(loss, ref) < 1e-5 and rel(xs.grad, gref) < 1e-2
    from torch.profiler import ProfilerActivity, profile

    def memcpy_us(m):  # device time of the copies one step makes
        xs = x.detach().requires_grad_()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            m(xs, tc).backward()
            torch.cuda.synchronize()
        return sum(e.device_time for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" in e.name)

    # the graphed module copies the 32 MiB batch (~20 us at 3 TB/s); the other one at most the loss's 4 bytes
    assert memcpy_us(forced) > 10.0
    assert memcpy_us(pm) < 5.0


def test_staged_backward_under_graphs_matches_eager():
    """A staged backward (partition/stages.py): each stage a graphed program reading what the previous one
    carried in place (keyed); gradients as eager's over steps, each stage captured once and replayed."""
    model, inputs = load_spec("aotfuse.examples.gpt:demo_train(dropout=0.0)")
    data = aotfuse.build(model, inputs, train=True, targets=_arch(), step="split", backward_stages=3).data
    pm = aotfuse.load(data, device="cuda").as_module()
    assert pm._art.manifest.programs == ("forward", "backward", "backward_1", "backward_2")
    assert pm._graphs is not None and set(pm._graphs) == set(pm._art.manifest.programs)
    ref = copy.deepcopy(model).cuda()
    for step in range(4):
        batch = random_inputs(pm._art.input_specs, device="cuda", seed=step)
        _step(pm, [batch], list(pm.parameters()))
        _step(ref, [batch], list(ref.parameters()))
        _check_grads(pm, ref, step)
    for name, g in pm._graphs.items():
        st = g.stats
        assert st["eager_calls"] == 0 and st["replays"] == 4 and 1 <= st["captures"] <= 2, (name, st)
