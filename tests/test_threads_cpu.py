"""The CPU path called from several threads at once (Triton's interpreter works through global state).

One artifact is shared by every thread: each call gets its own inputs and is checked against eager.
Afterwards a build in the main thread must still compile cubins (no interpreter patch left behind).
"""
from __future__ import annotations

import threading

import torch

import aotfuse
from aotfuse.examples.gpt import GPTConfig, GPTWithLoss, _init, demo
from aotfuse.specs import random_inputs


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_threads(n: int, work) -> list:
    """Run work(i) in n threads started together; return their results, re-raising the first error."""
    results: list = [None] * n
    errors: list = []
    barrier = threading.Barrier(n)

    def body(i):
        try:
            barrier.wait(timeout=60)
            results[i] = work(i)
        except BaseException as exc:  # noqa: BLE001 - reported in the main thread
            errors.append((i, exc))

    threads = [threading.Thread(target=body, args=(i,), name=f"caller-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a calling thread hung"
    if errors:
        i, exc = errors[0]
        raise AssertionError(f"{len(errors)} of {n} threads failed; thread {i}: {exc!r}") from exc
    return results


# The demo GPT's structure (two layers: embeddings, attention, LayerNorms, GELU MLP, same 7 kernel
# launches per call) at a size the interpreter runs in about 2 s a call instead of about 15 s.
SMALL = GPTConfig(vocab=64, seq=8, dim=32, heads=2, layers=2)


def test_demo_artifact_from_four_threads_then_build():
    model, example = demo(cfg=SMALL)
    art = aotfuse.load(aotfuse.build(model, example, targets=("sm_90",)).data, device="cpu")

    def work(i):
        errs = []
        for k in range(2):  # different random inputs for every call
            (tokens,) = random_inputs(art.input_specs, device="cpu", seed=100 + 10 * i + k)
            out = art(tokens)
            with torch.no_grad():
                ref = model(tokens)
            errs.append(rel(out, ref))
        return errs

    errs = run_threads(4, work)
    assert all(e <= 1e-5 for per_thread in errs for e in per_thread), errs

    # The interpreter's patches are all undone: triton.language is itself again and a cubin compiles.
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    assert JITFunction.__call__.__qualname__ == "JITFunction.__call__"
    assert not triton_interpret_on()
    assert tl.core.is_builtin(tl.load) and tl.load.__name__ == "load"  # the interpreter's patch is a lambda
    res = aotfuse.build(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8)).eval(),
                        (torch.randn(4, 8),), targets=("sm_90",))
    assert res.data[:4] and aotfuse.load(res.data, device="cpu").arch == "interpreter"


def triton_interpret_on() -> bool:
    import triton

    return bool(triton.knobs.runtime.interpret)


def small_gpt_train():
    cfg = GPTConfig(vocab=64, seq=8, dim=32, heads=2, layers=1, dropout=0.0)
    model = _init(GPTWithLoss(cfg), seed=0).train()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g))


def test_train_module_forward_backward_from_two_threads():
    model, example = small_gpt_train()
    art = aotfuse.load(aotfuse.build(model, example, train=True, targets=("sm_90",)).data, device="cpu")
    mod = art.as_module()
    params = list(mod.parameters())
    names = [n for n, _ in mod.named_parameters()]
    ref_params = dict(model.named_parameters())

    def work(i):
        out = []
        for k in range(1):  # one forward/backward per thread: about 9 s each on the interpreter
            inputs = random_inputs(art.input_specs, device="cpu", seed=200 + 10 * i + k)
            loss = mod(*inputs)
            grads = torch.autograd.grad(loss, params)  # this call's gradients only, not .grad
            ref_loss = model(*inputs)  # eager reference on this thread's inputs
            ref_grads = torch.autograd.grad(ref_loss, [ref_params[n] for n in names])
            out.append((rel(loss, ref_loss), max(rel(g, r) for g, r in zip(grads, ref_grads))))
        return out

    for per_thread in run_threads(2, work):
        for loss_err, grad_err in per_thread:
            assert loss_err < 1e-5 and grad_err < 1e-4, (loss_err, grad_err)
