"""Inputs laid out densely but not row-major (channels-last images) are read in place: the build records
the example's strides, kernels and externs index the input through them, the guard asks for that layout
(a typed error naming it otherwise), and random inputs for `aotfuse run`/`verify` follow it. Inference
and training, on the CPU path, against eager."""
from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.runtime.explain import explain_report
from aotfuse.contract.manifest import InputSpec, dense_strides
from aotfuse.errors import ArchiveError, GuardError
from aotfuse.specs import random_inputs

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
CL = torch.channels_last


class Net(nn.Module):
    def __init__(self, loss=False):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)  # as ResNet: BatchNorm cancels a bias (grad ~0)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)
        self.loss = loss

    def forward(self, x, t):
        y = torch.relu(self.bn(self.conv(x)))  # x into an extern (conv) ...
        z = self.fc(F.adaptive_avg_pool2d(y, 1).flatten(1)) + x.amax((1, 2, 3))[:, None]  # ... and a kernel
        return F.mse_loss(z, t) if self.loss else z


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _x(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 9, 7, generator=g).contiguous(memory_format=CL), torch.randn(2, 4, generator=g)


def test_channels_last_inference_reads_in_place_and_guards_the_layout():
    torch.manual_seed(0)
    model = Net().eval()
    res = aotfuse.build(model, _x(1), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    x, t = _x(2)
    assert art.input_specs[0].stride == tuple(x.stride()) and art.input_specs[1].stride is None
    with torch.no_grad():
        assert rel(art(x, t), model(x, t)) < 1e-5
        with pytest.raises(GuardError, match="channels_last"):
            art(x.contiguous(), t)
        rx, rt = random_inputs(art.input_specs, seed=3)
        assert rx.stride() == x.stride()
        assert rel(art(rx, rt), model(rx, rt)) < 1e-5


def test_channels_last_training_matches_eager():
    torch.manual_seed(0)
    model = Net(loss=True).train()
    res = aotfuse.build(model, _x(1), train=True, targets=("sm_90",))
    _step_matches_eager(aotfuse.load(res.data, device="cpu").as_module(), model)


def _step_matches_eager(mod, model, make=None) -> None:
    """One training step of the packaged module and of eager on fresh channels-last inputs (`make(seed)`,
    default _x): loss and grads."""
    x, t = (make or _x)(4)
    loss = mod(x, t)
    loss.backward()
    ref_model = copy.deepcopy(model)
    ref = ref_model(x, t)
    ref.backward()
    assert rel(loss, ref) < 1e-5
    ours = dict(mod.named_parameters())
    for n, p in ref_model.named_parameters():
        assert rel(ours[n].grad, p.grad) < 1e-4, n


def test_contiguous_example_keeps_no_stride_and_bad_strides_are_refused():
    model = Net().eval()
    g = torch.Generator().manual_seed(0)
    res = aotfuse.build(model, (torch.randn(2, 3, 9, 7, generator=g), torch.randn(2, 4, generator=g)),
                        targets=("sm_90",))
    assert aotfuse.load(res.data, device="cpu").input_specs[0].stride is None
    assert dense_strides((2, 3, 4), (12, 1, 3)) and not dense_strides((2, 3, 4), (12, 4, 2))
    d = InputSpec("x", (2, 3, 4), "torch.float32", "float", stride=(12, 4, 1)).to_dict()
    assert InputSpec.from_dict(d).stride == (12, 4, 1)
    d["stride"] = [24, 4, 1]  # would read past the tensor: a damaged archive
    with pytest.raises(ArchiveError, match="densely"):
        InputSpec.from_dict(d)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_channels_last_training_with_and_without_cuda_graphs(graphs):
    """The forward's CUDA graph copies the batch into static buffers: they keep the input's layout (a
    channels-last batch copied into a row-major buffer was read as channels-last: wrong gradients)."""
    torch.manual_seed(0)
    model = Net(loss=True).train()
    cap = torch.cuda.get_device_capability()
    res = aotfuse.build(model, _x(1), train=True, targets=(f"sm_{cap[0]}{cap[1]}",))
    art = aotfuse.load(res.data, device="cuda", cuda_graphs=graphs)
    mod = art.as_module()
    ref_model = copy.deepcopy(model).cuda()
    for step in range(3):  # fresh inputs each step: the copied batch changes, the graph is replayed
        x, t = (a.cuda() for a in _x(10 + step))
        for p in list(mod.parameters()) + list(ref_model.parameters()):
            p.grad = None
        loss = mod(x, t)
        loss.backward()
        ref = ref_model(x, t)
        ref.backward()
        assert rel(loss, ref) < 1e-4, step
        ours = dict(mod.named_parameters())
        for n, p in ref_model.named_parameters():
            assert rel(ours[n].grad, p.grad) < 1e-3, (step, n, rel(ours[n].grad, p.grad))


def test_transposed_example_means_a_contiguous_input():
    """Only channels-last examples fix the input layout; a transposed example (x.t()) keeps the old rule."""
    model = nn.Linear(6, 3).eval()
    x = torch.randn(6, 4).t()
    art = aotfuse.load(aotfuse.build(model, (x,), targets=("sm_90",)).data, device="cpu")
    assert art.input_specs[0].stride is None
    with torch.no_grad():
        y = torch.randn(4, 6)
        assert rel(art(y), model(y)) < 1e-5


def test_channels_last_module_keeps_row_major_parameters():
    """`.to(memory_format=torch.channels_last)` on the packaged module would hand the programs NHWC weights
    they read as row-major: the module keeps its parameters row-major (values unchanged)."""
    torch.manual_seed(0)
    model = Net(loss=True).train()
    mod = aotfuse.load(aotfuse.build(model, _x(1), train=True, targets=("sm_90",)).data, device="cpu").as_module()
    params = list(mod.parameters())
    mod.to(memory_format=CL)
    assert [p is q for p, q in zip(mod.parameters(), params)] == [True] * len(params)
    assert all(p.is_contiguous() for p in mod.parameters())
    _step_matches_eager(mod, model)


@pytest.mark.parametrize("step", ["split", "step"])
def test_channels_last_parameters_stay_channels_last(step):
    """A model made channels-last (model.to(memory_format=torch.channels_last): its conv filters too) trains
    with channels-last Parameters: the programs read each filter in place and write its gradient in that
    layout (TrainInfo.param_strides), so cuDNN converts nothing; a layout change on the module is undone;
    state dicts go both ways with eager."""
    torch.manual_seed(0)
    model = Net(loss=True).to(memory_format=CL).train()
    res = aotfuse.build(model, _x(1), train=True, targets=("sm_90",), step=step)
    art = aotfuse.load(res.data, device="cpu")
    strides = dict(zip(art.manifest.train.params, art.manifest.train.param_strides))
    assert strides["conv.weight"] == tuple(model.conv.weight.stride()) and strides["fc.weight"] is None
    mod = art.as_module()
    w = dict(mod.named_parameters())["conv.weight"]
    assert w.stride() == model.conv.weight.stride() and torch.equal(w, model.conv.weight)
    _step_matches_eager(mod, model)
    assert w.grad.stride() == w.stride()  # autograd took the program's gradient as it is (no layout copy)
    text = explain_report(res.report, program="step" if step == "step" else "backward")
    assert "read as a row-major buffer" not in text.split("-- inlining")[0], text
    mod.to(memory_format=torch.contiguous_format)
    assert dict(mod.named_parameters())["conv.weight"].stride() == model.conv.weight.stride()
    eager = copy.deepcopy(model)
    eager.load_state_dict(mod.state_dict())
    assert torch.equal(eager.conv.weight, w)
    mod.load_state_dict(model.state_dict())
    assert torch.equal(w, model.conv.weight) and w.stride() == model.conv.weight.stride()


class Stem(nn.Module):
    """ResNet's stem: conv, BatchNorm, ReLU and a padded, ceil-mode 3x3 max pool (values and indices)."""

    def __init__(self, loss=False):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)
        self.loss = loss

    def forward(self, x, t):
        y, idx = F.max_pool2d(torch.relu(self.bn(self.conv(x))), 3, 2, 1, ceil_mode=True, return_indices=True)
        z = self.fc(y.mean((2, 3))) + y.amax((1, 2, 3))[:, None]
        return F.mse_loss(z, t) if self.loss else (z, y, idx)  # y and idx outputs: the pool's results are stored


def _pool_sources(res) -> list[str]:
    import msgpack

    art = aotfuse.load(res.data, device="cpu")
    return [s for s in msgpack.unpackb(bytes(art.archive.part("sources"))).values() if "tl.maximum(0, (-1" in s]


def _stem_x(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 17, 13, generator=g).contiguous(memory_format=CL), torch.randn(2, 4, generator=g)


@pytest.mark.parametrize("train", [False, True])
def test_channels_last_max_pool_keeps_the_layout(train):
    """max_pool2d_with_indices has two results (values, indices); both are channels-last in eager, so both are
    stored NHWC: the pool kernel walks the channels fastest (its loads of the NHWC input contiguous), where a
    row-major result made every thread's loads 8 channels apart (ResNet-18's stem pool, H100: 762 us)."""
    torch.manual_seed(0)
    model = Stem(loss=train).train(train)
    res = aotfuse.build(model, _stem_x(1), train=train, targets=("sm_90",))
    pools = _pool_sources(res)
    assert pools
    for src in pools:
        loads = [ln for ln in src.splitlines() if "tl.load(" in ln and "xindex" in ln]
        # the channel is the fastest index (xindex % C, or the flat index itself), never (xindex // HW) % C
        assert loads and not any(re.search(r"\(xindex // \d+\) % 8\)", ln) for ln in loads), src
    if train:
        _step_matches_eager(aotfuse.load(res.data, device="cpu").as_module(), model, _stem_x)
    else:
        art = aotfuse.load(res.data, device="cpu")
        x, t = _stem_x(2)
        with torch.no_grad():
            for got, want in zip(art(x, t), model(x, t)):
                assert rel(got, want) < 1e-5


def test_channels_last_weights_are_stored_in_their_order_for_inference():
    """model.to(memory_format=torch.channels_last) makes conv filters NHWC: an inference archive stores them
    in that order (the tensor under the weight's name is the permuted one) and the convolution reads them
    through a channels-last view, so cuDNN converts nothing per call; results match eager. A training archive
    keeps row-major parameters (test_channels_last_module_keeps_row_major_parameters)."""
    torch.manual_seed(0)
    model = Stem().to(memory_format=CL).eval()
    assert not model.conv.weight.is_contiguous()
    res = aotfuse.build(model, _stem_x(1), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    w = model.conv.weight
    assert tuple(art.weights["conv.weight"].shape) == (w.shape[0], w.shape[2], w.shape[3], w.shape[1])
    assert torch.equal(art.weights["conv.weight"], w.detach().permute(0, 2, 3, 1))
    x, t = _stem_x(2)
    with torch.no_grad():
        for got, want in zip(art(x, t), model(x, t)):
            assert rel(got, want) < 1e-5
    contiguous = aotfuse.build(Stem().eval(), _stem_x(1), targets=("sm_90",))
    assert tuple(aotfuse.load(contiguous.data, device="cpu").weights["conv.weight"].shape) == tuple(w.shape)


@pytest.mark.parametrize("step", ["split", "step"])
def test_max_pool_indices_are_saved_as_int8_window_offsets(step):
    """The indices max_pool2d_with_indices hands its backward are saved as the tap of the window (int8,
    aotfuse::pool_offsets: 1 byte instead of 8) and restored in the backward (aotfuse::pool_indices); in one
    fused step program the pair cancels. Gradients match eager either way."""
    torch.manual_seed(0)
    model = Stem(loss=True).to(memory_format=CL).train()
    res = aotfuse.build(model, _stem_x(1), train=True, targets=("sm_90",), step=step)
    saved = [s for s in res.report.partition["saved"] if s.get("pool_offsets")]
    if step == "split":
        assert len(saved) == 1, res.report.partition["saved"]
        s = saved[0]
        assert s["dtype"] == "int64" and s["nbytes"] == math.prod(s["shape"]) and "window offsets" in s["why"]
    _step_matches_eager(aotfuse.load(res.data, device="cpu").as_module(), model, _stem_x)
