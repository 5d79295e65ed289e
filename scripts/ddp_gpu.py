"""Data-parallel training with the packaged module (issue 12): one process per GPU under torchrun.

    python3 -m aotfuse build aotfuse.examples.gpt:anchor_train --train -o /tmp/anchor_train.aotf --arch sm_90
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=N scripts/ddp_gpu.py /tmp/anchor_train.aotf \
        [--spec aotfuse.examples.gpt:anchor_train] [--steps 50] [--modes eager,compile,aotfuse] [--json OUT]
        [--overlap]

A mode `aotfuse:PATH` runs another archive of the same model (e.g. one built with --backward-stages 4:
partition/stages.py). `--overlap`: after the timed steps, rank 0 profiles 5 steps and reports the NCCL
kernels' time per step and the share of it that ran while a compute kernel ran (the all-reduce hidden
behind the backward).

Each mode wraps its module in DistributedDataParallel (NCCL; gloo on the CPU) and runs `--steps` AdamW
steps on the same per-rank batches (fresh random tokens, seeded by step and rank): eager (the model),
compile (torch.compile of the DDP module) and aotfuse (`aotfuse.load(path, device=f"cuda:{rank}")
.as_module()` in DDP). Each step's loss is all-reduced (mean over ranks) and compared with eager's step
by step; the step time is the median over the steps after the first `--warmup` (CUDA events, the
stream drained before each step). Rank 0 prints one line per mode and a table; `--json` writes them.
Peak memory is torch's max_memory_allocated over the mode, from a collection (gc.collect) before it: the
previous mode's objects are gone (DDP keeps reference cycles); "allocated before" says what was left.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import aotfuse
from aotfuse.specs import load_spec, random_inputs


def _batch(specs, device, step: int, rank: int):
    return random_inputs(specs, device=device, seed=1000 * step + rank)


def _step(step_fn, opt, batch):
    opt.zero_grad(set_to_none=True)
    loss = step_fn(*batch)
    getattr(loss, "loss", loss).backward()
    opt.step()


def _union(iv):
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap(step, n: int = 5) -> dict:
    """NCCL kernel time per step and the share of it during which a compute kernel ran (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    comm, comp = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or "Memcpy" in e.name or "Memset" in e.name:
            continue
        (comm if "nccl" in e.name.lower() else comp).append((e.time_range.start, e.time_range.end))
    compute = _union(comp)
    total = sum(b - a for a, b in comm)
    hidden = 0.0
    for a, b in comm:
        for c, d in compute:
            if c < b and d > a:
                hidden += min(b, d) - max(a, c)
    return {"comm_us": total / n, "comm_hidden": hidden / total if total else 0.0}


def run_mode(mode: str, spec: str, path: str, device, steps: int, warmup: int, lr: float,
             want_overlap: bool = False):
    rank = dist.get_rank()
    model, _ = load_spec(spec)  # the same initial weights on every rank (the spec seeds its init)
    model = model.to(device).train()
    if mode.startswith("aotfuse"):
        art = aotfuse.load(mode.partition(":")[2] or path, device=device)
        mod = art.as_module()
        with torch.no_grad():  # the archive's weights are the spec's; copy anyway: one source of truth
            for n, p in mod.named_parameters():
                p.copy_(dict(model.named_parameters())[n])
        del model
    else:
        mod = model
    specs = aotfuse.inspect_archive(path)["inputs"]  # with the ranges of integer inputs
    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(mod, device_ids=ids)
    step_fn = torch.compile(ddp) if mode == "compile" else ddp
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr)
    losses, times = [], []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t_first = time.perf_counter()
    first = None
    for step in range(steps):
        batch = _batch(specs, device, step, rank)
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = step_fn(*batch)
        loss = getattr(loss, "loss", loss)
        loss.backward()
        opt.step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        if first is None:
            first = time.perf_counter() - t_first
        lt = loss.detach().float().reshape(1)
        dist.all_reduce(lt)
        losses.append(float(lt) / dist.get_world_size())
    graphs = _graph_stats(mod) if mode.startswith("aotfuse") else {}
    overlap = _overlap(lambda: _step(step_fn, opt, _batch(specs, device, 0, rank))) if want_overlap else {}
    cuda = device.type == "cuda"
    return {"mode": mode, **overlap, **graphs, "losses": losses, "step_ms": statistics.median(times[warmup:]),
            "first_step_s": first, "peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else 0.0,
            "reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20 if cuda else 0.0}


def _graph_stats(mod) -> dict:
    """Per program of the packaged module, its GraphedProgram's stats (captures, replays, eager_calls,
    evictions, resets) after the timed steps; {} where the module holds none (no CUDA graphs)."""
    graphs = getattr(mod, "_graphs", None)
    out = {"graphs_why": getattr(mod, "graphs_why", "")} if hasattr(mod, "graphs_why") else {}
    if isinstance(graphs, dict):
        out["graph_stats"] = {name: dict(g.stats) for name, g in graphs.items() if hasattr(g, "stats")}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("archive")
    ap.add_argument("--spec", default="aotfuse.examples.gpt:anchor_train")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--modes", default="eager,compile,aotfuse")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--json", default="")
    ap.add_argument("--overlap", action="store_true")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rows = []
    for mode in a.modes.split(","):
        before = 0.0
        if cuda:
            # DDP keeps reference cycles: without a collection the previous mode's module, and with it its
            # CUDA graphs (output sets, arena), stays allocated and is counted in this mode's peak
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device) / 2**20
        r = run_mode(mode, a.spec, a.archive, device, a.steps, a.warmup, a.lr, a.overlap and cuda)
        r["before_mb"] = before
        rows.append(r)
        if rank == 0:
            print(f"{mode}: world {world}, step {r['step_ms']:.3f} ms, first step {r['first_step_s']:.1f} s, "
                  f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, peak {r['peak_mb']:.0f} MiB "
                  f"(reserved {r['reserved_mb']:.0f} MiB; {r['before_mb']:.0f} MiB allocated before the mode)",
                  flush=True)
            if r.get("graphs_why"):
                print(f"  {r['graphs_why']}", flush=True)
            for name, st in r.get("graph_stats", {}).items():
                print(f"  graphs {name}: " + ", ".join(f"{k} {v}" for k, v in st.items()), flush=True)
    if rank == 0:
        ref = next((r for r in rows if r["mode"] == "eager"), None)
        name = torch.cuda.get_device_name(device) if cuda else "cpu"
        print(f"\n{name} x {world}, torch {torch.__version__}, {a.spec}, {a.steps} AdamW steps")
        print("| GPUs | mode | step ms (median) | first step s | peak MiB (rank 0) | loss first -> last | "
              "worst step loss diff vs eager | last-10 mean diff | NCCL us per step | of it hidden behind compute | "
              "peak reserved MiB (rank 0) | allocated before the mode MiB |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if ref is not None:
                d = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(r["losses"], ref["losses"])]
                r["worst_rel"] = max(d)
                r["last10_rel"] = abs(statistics.mean(r["losses"][-10:]) - statistics.mean(ref["losses"][-10:])) / \
                    abs(statistics.mean(ref["losses"][-10:]))
            print(f"| {world} | {r['mode']} | {r['step_ms']:.3f} | {r['first_step_s']:.1f} | {r['peak_mb']:.0f} | "
                  f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | {r.get('worst_rel', 0):.1e} | "
                  f"{r.get('last10_rel', 0):.1e} | {r.get('comm_us', float('nan')):.0f} | "
                  f"{100 * r.get('comm_hidden', float('nan')):.0f}% | {r['reserved_mb']:.0f} | {r['before_mb']:.0f} |")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"device": name, "world": world, "spec": a.spec, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
