"""GPU tier (skipped without CUDA): archives built in-process run on the GPU like eager."""
from __future__ import annotations

import copy

import pytest
import torch

import aotfuse
from aotfuse.specs import load_spec, random_inputs

pytestmark = pytest.mark.gpu


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_inference_graphs_on_and_off_match_eager():
    model, inputs = load_spec("aotfuse.examples.gpt:demo")
    res = aotfuse.build(model, inputs)
    model = model.cuda()
    for graphs in (True, False):
        art = aotfuse.load(res.data, device="cuda", cuda_graphs=graphs)
        for seed in (1, 2):  # a second call replays the captured graph with new inputs
            x = random_inputs(art.input_specs, device="cuda", seed=seed)
            with torch.no_grad():
                assert rel(art(*x), model(*x)) < 1e-4


def test_training_with_cuda_graphs_follows_eager_and_recaptures_on_new_parameters():
    model, inputs = load_spec("aotfuse.examples.llama:block_train")
    res = aotfuse.build(model, inputs, train=True)
    art = aotfuse.load(res.data, device="cuda")
    mod = art.as_module()
    ref = copy.deepcopy(model).cuda()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (mod, ref)]
    for step in range(5):
        batch = random_inputs(art.input_specs, device="cuda", seed=step)
        losses = []
        for m, o in zip((mod, ref), opts):
            o.zero_grad()
            loss = m(*batch)
            loss.backward()
            o.step()
            losses.append(loss)
        assert rel(losses[0], losses[1]) < 1e-4
    fwd = mod._graphs["forward"]
    assert fwd.captures == 1
    with torch.no_grad():  # swap a parameter's tensor (new values too): the next call must capture again
        p = mod._param_list[0]
        p.data = p.data * 1.5
        dict(ref.named_parameters())[mod._names[0]].mul_(1.5)
    batch = random_inputs(art.input_specs, device="cuda", seed=99)
    assert rel(mod(*batch), ref(*batch)) < 1e-4
    assert fwd.captures == 2


@pytest.mark.parametrize("config", ["128,128,64,8,8,3,1", "128,128,64,8,4,3,1,1"], ids=["persistent", "warp-specialized"])
def test_persistent_tma_templates_on_two_streams_and_graphs(config):
    """Persistent matmul templates (KernelEntry.persistent: one program per SM; TMA descriptors made in
    the kernel, in global scratch each launch site owns) match eager with and without CUDA graphs, and
    on two caller streams at once (each executor state has its own scratch)."""
    import torch.nn.functional as F

    from aotfuse.knobs import override

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.proj = torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)

        def forward(self, x):
            return x + self.proj(F.gelu(self.fc(x), approximate="tanh"))

    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16).eval()
    x = torch.randn(2000, 256, dtype=torch.bfloat16)
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    with override(mm="template", mm_config=config, targets=(arch,)):
        res = aotfuse.build(model, (x,), targets=(arch,))
    art0 = aotfuse.load(res.data, device="cuda", cuda_graphs=False)
    mm = [k for k in art0.kernels.values() if k.kind == "template_mm"]
    assert len(mm) == 2 and all(k.persistent == 1 for k in mm)
    if major >= 9:
        assert all(k.binaries[art0.arch].global_scratch > 0 for k in mm)  # descriptors made in the kernel
    model = model.cuda()
    for graphs in (False, True):
        art = aotfuse.load(res.data, device="cuda", cuda_graphs=graphs)
        for seed in (1, 2):
            xs = torch.randn(2000, 256, dtype=torch.bfloat16, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
            with torch.no_grad():
                assert rel(art(xs), model(xs)) < 2e-2
    art = aotfuse.load(res.data, device="cuda")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    xs = [torch.randn(2000, 256, dtype=torch.bfloat16, device="cuda") for _ in streams]
    torch.cuda.synchronize()
    outs = []
    for _ in range(3):
        for s, xi in zip(streams, xs):
            with torch.cuda.stream(s), torch.no_grad():
                outs.append((xi, art(xi)))
    torch.cuda.synchronize()
    with torch.no_grad():
        for xi, o in outs:
            assert rel(o, model(xi)) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_persistent_tma_templates_at_odd_sizes_match_eager(dtype):
    """TMA zero-fill at edges no tile divides (M 100, N 104, K 72 with 32-wide tiles) and a transposed
    operand (x.t() @ x) on the GPU, against eager and an fp32 reference."""
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_mm_templates import Odd  # noqa: E402

    from aotfuse.knobs import override

    torch.manual_seed(0)
    model = Odd().to(dtype).eval()
    inputs = (torch.randn(100, 72, dtype=dtype), torch.randn(100, 104, dtype=dtype))
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    with override(mm="template", mm_config="32,32,32,4,4,2,1", targets=(arch,)):
        res = aotfuse.build(model, inputs, targets=(arch,))
    art = aotfuse.load(res.data, device="cuda")
    assert sum(k.persistent == 1 for k in art.kernels.values()) == 3
    model = model.cuda()
    ref32 = copy.deepcopy(model).float()
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        ins = tuple(torch.randn(t.shape, generator=g).to(dtype).cuda() for t in inputs)
        with torch.no_grad():
            outs, refs, r32 = art(*ins), model(*ins), ref32(*[t.float() for t in ins])
        for o, r, q in zip(outs, refs, r32):
            if dtype == torch.float32:
                assert rel(o, r) < 1e-5
            else:
                assert rel(o, q) <= max(2e-2, 2 * rel(r, q))
