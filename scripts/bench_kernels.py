"""Kernel benchmark: memory-bound cases for eager, torch.compile and aotfuse, as percent of copy bandwidth.

    python3 scripts/bench_kernels.py [--only NAME,...] [--iters N] [--markdown FILE]

Forward cases time the kernels alone: each backend's call is captured in a CUDA graph and the graph
is replayed (CUDA events, median of 7 rounds of N replays), so launch gaps and per-call host work
are out of the numbers. aotfuse runs its program through the executor, on a state of its own (no
input copy, no output clone). Training cases (loss.backward() of a scalar-loss module, the grads
of the inputs that require grad) are timed the same way for every backend, as whole steps with
events and no graph (the packaged module's own graphs are off, and so are torch.compile's), and again
as GPU kernel time per step (the sum of the device kernels' durations, torch.profiler): the row marked
"[GPU kernel time per step]" is the kernels' own bandwidth (the training issue's 9.4 figures).

Bandwidth: the fewest bytes each case must move (each input read once, each output written once),
over the time, as percent of the measured device copy (a 1 GiB device-to-device copy; read + write
bytes). Inputs are fresh normal random numbers (never zeros). Every output is checked against eager
before timing (relative error of the norm). The table prints last; the same table is appended to
--markdown with device and date.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

import aotfuse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_ab import kernel_time  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16


# ---------------------------------------------------------------- cases
class Softmax(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


class RMSNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, dtype=BF16))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


class LayerNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.ln = torch.nn.LayerNorm(n, dtype=BF16)
        with torch.no_grad():
            self.ln.weight.normal_()
            self.ln.bias.normal_()

    def forward(self, x):
        return self.ln(x)


class BiasGelu(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.b = torch.nn.Parameter(torch.randn(n, dtype=BF16))

    def forward(self, x):
        return F.gelu(x + self.b, approximate="tanh")


class SiluLayerNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.b = torch.nn.Parameter(torch.randn(n, dtype=BF16))
        self.ln = torch.nn.LayerNorm(n, dtype=BF16)

    def forward(self, x):
        return self.ln(x * torch.sigmoid(x) + self.b)


class LayerNormLoss(torch.nn.Module):
    """(layer_norm(x, w, b).float() * g).sum(): the training issue's LayerNorm case."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, dtype=BF16))
        self.bias = torch.nn.Parameter(torch.randn(n, dtype=BF16))
        self.register_buffer("g", torch.randn(n))

    def forward(self, x):
        return (F.layer_norm(x, (x.shape[-1],), self.weight, self.bias).float() * self.g).sum()


class CrossEntropyLoss(torch.nn.Module):
    def forward(self, logits, target):
        return F.cross_entropy(logits.float(), target)


def fwd_case(name, make, shape, extra_bytes=0):
    def inputs():
        return (torch.randn(shape, device=DEV, dtype=BF16),)
    numel = shape[0] * shape[1]
    return dict(name=name, make=make, inputs=inputs, train=False, bytes=2 * numel * 2 + extra_bytes)


def cases():
    out = []
    n, r = 4096, 16384
    out.append(fwd_case("softmax 16384x4096", lambda: Softmax(), (r, n)))
    out.append(fwd_case("RMSNorm 16384x4096", lambda: RMSNorm(n), (r, n), 2 * n))
    out.append(fwd_case("LayerNorm 16384x4096", lambda: LayerNorm(n), (r, n), 4 * n))
    out.append(fwd_case("GELU(tanh)(x + b) 16384x4096", lambda: BiasGelu(n), (r, n), 2 * n))
    out.append(fwd_case("LayerNorm(x*sigmoid(x) + b) 8192x4096", lambda: SiluLayerNorm(n), (8192, n), 6 * n))
    for rows, cols in ((327680, 197), (65536, 1000), (1024, 50257)):
        out.append(fwd_case(f"softmax {rows}x{cols}", lambda: Softmax(), (rows, cols)))
        out.append(fwd_case(f"LayerNorm {rows}x{cols}", lambda c=cols: LayerNorm(c), (rows, cols), 4 * cols))

    def ln_inputs():
        return (torch.randn(r, n, device=DEV, dtype=BF16).requires_grad_(),)
    # forward+backward: x read (twice at most in practice), dx written; w, b, g and their grads are small
    out.append(dict(name="LayerNorm fwd+bwd 16384x4096 (grads x, w, b)", make=lambda: LayerNormLoss(n),
                    inputs=ln_inputs, train=True, bytes=2 * r * n * 2))

    def ce_inputs():
        return (torch.randn(8192, 32000, device=DEV, dtype=BF16).requires_grad_(),
                torch.randint(0, 32000, (8192,), device=DEV))
    out.append(dict(name="cross-entropy fwd+bwd 8192x32000 (grad of L)", make=lambda: CrossEntropyLoss(),
                    inputs=ce_inputs, train=True, bytes=2 * 8192 * 32000 * 2))
    return out


# ---------------------------------------------------------------- timing
def copy_bandwidth() -> float:
    """Device copy, bytes read + written per second: the best of 1 GiB and 256 MiB bf16 copies, after
    half a second of copying (the clocks of an idle GPU ramp up first)."""
    best = 0.0
    for nbytes in (1 << 30, 1 << 28):
        x = torch.randn(nbytes // 2, device=DEV, dtype=BF16)
        y = torch.empty_like(x)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.5:
            y.copy_(x)
        torch.cuda.synchronize()
        ms = time_graph(lambda: y.copy_(x), iters=20)
        best = max(best, 2 * nbytes / (ms * 1e-3))
    return best


def _median_events(run, iters: int, rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph (after warm-up calls on a side stream), replayed once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def time_graph(fn, iters: int) -> float:
    return _median_events(capture_graph(fn).replay, iters)


def time_steps(step, iters: int) -> float:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    return _median_events(step, iters)


def rel_err(got, want) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# ---------------------------------------------------------------- backends
def build_aotfuse(model, inputs, train: bool):
    """Training cases are built as one fused step (partition/step.py): a loss's forward and backward in
    one program, the issue's "fused forward+backward"; AOTFUSE_TRAIN_STEP=split measures two programs."""
    path = tempfile.mktemp(suffix=".aotf")
    cpu_inputs = tuple(x.detach().cpu().requires_grad_(x.requires_grad) for x in inputs)
    kw = {"step": os.environ.get("AOTFUSE_TRAIN_STEP") or "auto"} if train else {}
    aotfuse.build(model.cpu(), cpu_inputs, train=train, targets=(_arch(),), **kw).save(path)
    model.to(DEV)
    art = aotfuse.load(path, device=DEV, cuda_graphs=False)
    os.unlink(path)
    return art


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def run_forward_case(c, iters):
    torch.manual_seed(0)
    model = c["make"]().to(DEV).eval()
    x = c["inputs"]()
    with torch.no_grad():
        want = model(*x)
        art = build_aotfuse(model, x, train=False)
        ex = art.executors["forward"]
        st = ex.state()
        got = ex.run(list(x), state=st)[0]
        compiled = torch.compile(model)
        got_c = compiled(*x)
        errs = (rel_err(got, want), rel_err(got_c, want))
        times = {
            "eager": time_graph(lambda: model(*x), iters),
            "compile": time_graph(lambda: compiled(*x), iters),
            "aotfuse": time_graph(lambda: ex.run(list(x), state=st), iters),
        }
    return times, errs


def run_train_case(c, iters):
    torch.manual_seed(0)
    model = c["make"]().to(DEV)
    x = c["inputs"]()
    params = list(model.parameters())

    def grads_of(fn):
        for t in list(x) + params:
            t.grad = None
        fn(*x).backward()
        return [t.grad for t in x if t.requires_grad] + [p.grad for p in params]

    want = grads_of(model)
    art = build_aotfuse(model, x, train=True)
    mod = art.as_module(cuda_graphs=False)
    with torch.no_grad():
        for (name, p) in mod.named_parameters():
            p.copy_(dict(model.named_parameters())[name])
    mparams = list(mod.parameters())
    params_all = [params, mparams]
    compiled = torch.compile(model)

    def step_of(fn, ps):
        def step():
            for t in list(x) + ps:
                t.grad = None
            fn(*x).backward()
        return step

    for t in x:
        t.grad = None
    mod(*x).backward()
    got = [t.grad for t in x if t.requires_grad] + [p.grad for p in mparams]
    errs = (max(rel_err(g, w) for g, w in zip(got, want)),)
    grads_of(compiled)
    got_c = [t.grad for t in x if t.requires_grad] + [p.grad for p in params]
    errs += (max(rel_err(g, w) for g, w in zip(got_c, want)),)
    steps = {"eager": step_of(model, params_all[0]), "compile": step_of(compiled, params_all[0]),
             "aotfuse": step_of(mod, params_all[1])}
    times = {k: time_steps(f, iters) for k, f in steps.items()}
    # The same steps' GPU kernel time (the sum of the device kernels' durations, torch.profiler, median
    # of 3 profiles of 5 steps): the kernels' own bandwidth, without the step's host work and gaps.
    kernels = {k: statistics.median(kernel_time(f)[0] for _ in range(3)) / 1e3 for k, f in steps.items()}
    return times, errs, kernels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--markdown", default="")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    rows = []
    for c in cases():
        if a.only and not any(s in c["name"] for s in a.only.split(",")):
            continue
        try:
            times, errs, *kern = (run_train_case if c["train"] else run_forward_case)(c, a.iters)
        except Exception as e:  # one broken case must not hide the others' numbers
            traceback.print_exc()
            rows.append((c["name"], "-", "-", "-", "-", "-", f"error: {type(e).__name__}: {str(e)[:80]}"))
            continue
        for label, ts in [("", times)] + [(" [GPU kernel time per step]", k) for k in kern]:
            pct = {k: 100 * c["bytes"] / (v * 1e-3) / bw for k, v in ts.items()}
            rows.append((c["name"] + label, f"{ts['eager'] * 1e3:.0f}", f"{ts['compile'] * 1e3:.0f}",
                         f"{ts['aotfuse'] * 1e3:.0f}", f"{pct['compile']:.0f}%", f"{pct['aotfuse']:.0f}%",
                         f"{ts['compile'] / ts['aotfuse']:.2f}x; err {errs[-2]:.1e}"))
            print(rows[-1], flush=True)
    head = ("case", "eager us", "compile us", "aotfuse us", "compile % copy", "aotfuse % copy",
            "aotfuse vs compile; rel err")
    dev = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy {bw / 1e12:.2f} TB/s"
    lines = [f"Kernel benchmark ({dev}, {datetime.date.today()}; `python3 scripts/bench_kernels.py "
             f"--iters {a.iters}`; medians)", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    if a.markdown:
        with open(a.markdown, "a") as f:
            f.write("\n".join(lines) + "\n\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
