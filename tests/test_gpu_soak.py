"""GPU soak (skipped without CUDA): an ordinary serving/training process must never crash.

One process: several inference and training archives loaded and freed, calls interleaved with eager
models and torch.compile models (default and reduce-overhead), two CUDA streams, four threads calling
one artifact, garbage collection between rounds. Every output is checked against eager. The order
inside a round is the one that crashed (repro/replay_crash.py): a train archive's graphs captured and
freed, then an inference archive captured, then reduce-overhead captures (which clear cuBLAS's
workspaces), then replays.
"""
from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch

import aotfuse
from aotfuse.specs import load_spec, random_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

INFER = ["aotfuse.examples.gpt:demo", "aotfuse.examples.llama:block", "aotfuse.examples.cnn:cnn"]
TRAIN = ["aotfuse.examples.gpt:demo_train(dropout=0.0)", "aotfuse.examples.llama:block_train"]
ROUNDS = 3


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def built():
    arch = f"sm_{torch.cuda.get_device_capability()[0]}{torch.cuda.get_device_capability()[1]}"
    out = {}
    for spec in INFER:
        model, inputs = load_spec(spec)
        data = aotfuse.build(model, inputs, targets=(arch,)).data
        out[spec] = (model.cuda().eval(), data)
    for spec in TRAIN:
        model, inputs = load_spec(spec)
        out[spec] = (model, aotfuse.build(model, inputs, train=True, targets=(arch,)).data)
    return out


def check_infer(art, model, seed, tol=1e-4):
    x = random_inputs(art.input_specs, device="cuda", seed=seed)
    with torch.no_grad():
        got, ref = art(*x), model(*x)
    assert rel(got, ref) < tol, f"seed {seed}: {rel(got, ref):.2e}"


def train_steps(data, model, steps=3):
    pm = aotfuse.load(data, device="cuda").as_module()
    ref = copy.deepcopy(model).cuda()
    for step in range(steps):
        batch = random_inputs(pm._art.input_specs, device="cuda", seed=1000 + step)
        for m in (pm, ref):
            for p in m.parameters():
                p.grad = None
        lp, lr = pm(*batch), ref(*batch)
        lp.backward()
        lr.backward()
        assert rel(lp, lr) < 1e-4
        grads = dict(ref.named_parameters())
        for name, p in pm.named_parameters():
            assert rel(p.grad, grads[name].grad) < 1e-3, name
    torch.cuda.synchronize()
    return pm


def threads_on_one_artifact(art, model, own_streams: bool):
    results, errors = {}, []

    def worker(t):
        try:
            ctx = torch.cuda.stream(torch.cuda.Stream()) if own_streams else torch.cuda.stream(None)
            with ctx, torch.no_grad():
                for i in range(3):
                    x = random_inputs(art.input_specs, device="cuda", seed=10 * t + i)
                    y = art(*x)
                    torch.cuda.current_stream().synchronize()
                    results[(t, i)] = (x, y)
        except Exception as exc:  # reported below, in the main thread
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert len(results) == 12
    with torch.no_grad():
        for (t, i), (x, y) in results.items():
            assert rel(y, model(*x)) < 1e-4, (t, i)


def test_soak_one_process(built):
    gpt_model, gpt_data = built[INFER[0]]
    for rnd in range(ROUNDS):
        # (1) training archives: captured, stepped, freed
        for spec in TRAIN:
            model, data = built[spec]
            pm = train_steps(data, model)
            del pm
        # (2) inference archives, interleaved with eager and torch.compile in both modes
        arts = {spec: aotfuse.load(data, device="cuda") for spec, (_, data) in built.items() if spec in INFER}
        for spec, art in arts.items():
            check_infer(art, built[spec][0], seed=rnd)
        compiled = torch.compile(copy.deepcopy(gpt_model))
        reduce = torch.compile(copy.deepcopy(gpt_model), mode="reduce-overhead")
        for i in range(4):
            x = random_inputs(arts[INFER[0]].input_specs, device="cuda", seed=100 + i)
            with torch.no_grad():
                ref = gpt_model(*x)
                for fn in (compiled, reduce):
                    assert rel(fn(*x), ref) < 1e-3
                for spec, art in arts.items():  # replays after reduce-overhead cleared cuBLAS's workspaces
                    check_infer(art, built[spec][0], seed=200 + 10 * rnd + i)
        # (3) two streams, then four threads (shared stream and own streams) on one artifact
        art = arts[INFER[0]]
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        outs = []
        with torch.no_grad():
            for s, seed in ((s1, 1), (s2, 2), (s1, 3), (s2, 4)):
                with torch.cuda.stream(s):
                    x = random_inputs(art.input_specs, device="cuda", seed=seed)
                    outs.append((s, x, art(*x)))
            torch.cuda.synchronize()
            for s, x, y in outs:
                assert rel(y, gpt_model(*x)) < 1e-4
        threads_on_one_artifact(art, gpt_model, own_streams=False)
        threads_on_one_artifact(art, gpt_model, own_streams=True)
        # (4) free everything, collect, go again
        if rnd == ROUNDS - 1:
            art.close()  # explicit close: graphs dropped after their streams drained, then kernels unloaded
            with pytest.raises(aotfuse.AotfuseError):
                art(*random_inputs(art.input_specs, device="cuda", seed=0))
        del arts, art, compiled, reduce, outs
        gc.collect()
        torch.cuda.synchronize()
