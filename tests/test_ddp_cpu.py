"""Data-parallel training over the packaged module (issue 12, point 4): two processes on the CPU with the
gloo backend, each wrapping `aotfuse.load(...).as_module()` in DistributedDataParallel and training on its
own shard; gradients (all-reduced by DDP's hooks on the packaged module's parameters) and the updated
parameters after two SGD steps match eager DDP of the same model run in the same processes."""
from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import aotfuse
from aotfuse.examples.gpt import demo_train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _worker(rank: int, path: str, port: int, model, batches, results):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        pm = aotfuse.load(path, device="cpu").as_module()
        events = []  # the packaged programs run and DDP's bucket all-reduces, in order
        run = pm._run
        pm._run = lambda progs, name, ins, **kw: (events.append(name), run(progs, name, ins, **kw))[1]
        # small buckets: each a few parameters, all-reduced as soon as DDP has their gradients
        ours = torch.nn.parallel.DistributedDataParallel(pm, bucket_cap_mb=0.05)
        ours.register_comm_hook(None, lambda state, bucket: (events.append("all-reduce"),
                                                               allreduce_hook(state, bucket))[1])
        ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
        worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        for step in range(2):
            events.clear()
            tokens, targets = batches[step][rank]  # each rank its own shard
            for m, opt in zip((ours, ref), opts):
                opt.zero_grad(set_to_none=True)
            lo, lr = ours(tokens, targets), ref(tokens, targets)
            lo.backward()
            lr.backward()
            worst["loss"] = max(worst["loss"], _rel(lo, lr))
            ref_named = dict(ref.module.named_parameters())
            for n, p in ours.module.named_parameters():
                worst["grad"] = max(worst["grad"], _rel(p.grad, ref_named[n].grad))
            for opt in opts:
                opt.step()
        ref_named = dict(ref.module.named_parameters())
        for n, p in ours.module.named_parameters():
            worst["param"] = max(worst["param"], _rel(p, ref_named[n]))
        # the all-reduce happened: every rank holds the same averaged gradient of its last step
        g = next(iter(ours.module.parameters())).grad.clone()
        others = [torch.empty_like(g) for _ in range(WORLD)]
        dist.all_gather(others, g)
        worst["ranks_agree"] = max(_rel(o, g) for o in others)
        worst["events"] = list(events)  # the last step's (DDP rebuilt its buckets by arrival after the first)
        results[rank] = worst
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stages", [1, 3])
def test_ddp_gloo_two_processes_matches_eager_ddp(tmp_path, stages):
    """stages=3: a staged backward (partition/stages.py) hands each stage's gradients to DDP before the next
    stage runs, so bucket all-reduces are queued between the backward's programs, not all after them."""
    model, (tokens, targets) = demo_train(dropout=0.0)
    path = tmp_path / "train.aotf"
    aotfuse.build(model, (tokens, targets), train=True, targets=("sm_90",), step="split",
                  backward_stages=stages).save(path)
    g = torch.Generator().manual_seed(3)
    vocab = int(tokens.max()) + 1

    def shard():
        t = torch.randint(0, vocab, tokens.shape, generator=g)
        return t, torch.randint(0, vocab, targets.shape, generator=g)
    batches = [[shard() for _ in range(WORLD)] for _ in range(2)]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(str(path), _free_port(), model, batches, results), nprocs=WORLD, join=True)
    assert sorted(results.keys()) == list(range(WORLD))
    for rank, w in results.items():
        assert w["loss"] < 1e-5 and w["grad"] < 1e-4 and w["param"] < 1e-5, (rank, w)
        assert w["ranks_agree"] == 0.0, (rank, w)
        ev = w["events"]
        programs = [e for e in ev if e != "all-reduce"]
        assert programs == ["forward", "backward"] + [f"backward_{k}" for k in range(1, stages)], ev
        last = ev.index(programs[-1])
        if stages == 1:  # every all-reduce waits for the one backward program
            assert ev.index("all-reduce") > last, ev
        else:  # each stage's buckets are queued before the next stage runs
            for k in range(stages - 1):
                between = ev[ev.index(programs[1 + k]) + 1:ev.index(programs[2 + k])]
                assert "all-reduce" in between, (k, ev)


def _fsdp_worker(rank: int, path: str, port: int, tokens, targets, results):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from aotfuse.errors import AotfuseError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    try:
        mod = aotfuse.load(path, device="cpu").as_module()
        fully_shard(mod, mesh=init_device_mesh("cpu", (1,)))
        try:
            mod(tokens, targets)
            results["error"] = None
        except AotfuseError as exc:
            results["error"] = str(exc)
    finally:
        dist.destroy_process_group()


def test_fsdp_fully_shard_is_refused_before_anything_runs(tmp_path):
    """fully_shard replaces the parameters with shards: the programs would read the stale originals and
    each rank would train alone, silently. The forward refuses, naming what to use instead (issue 12.3)."""
    model, (tokens, targets) = demo_train(dropout=0.0)
    path = tmp_path / "train.aotf"
    aotfuse.build(model, (tokens, targets), train=True, targets=("sm_90",)).save(path)
    results = mp.Manager().dict()
    mp.spawn(_fsdp_worker, args=(str(path), _free_port(), tokens, targets, results), nprocs=1, join=True)
    assert results["error"] and "FSDP" in results["error"] and "DistributedDataParallel" in results["error"]
