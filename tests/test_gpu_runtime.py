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
