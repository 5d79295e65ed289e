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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        ours = torch.nn.parallel.DistributedDataParallel(aotfuse.load(path, device="cpu").as_module())
        ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
        worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        for step in range(2):
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
        results[rank] = worst
    finally:
        dist.destroy_process_group()


def test_ddp_gloo_two_processes_matches_eager_ddp(tmp_path):
    model, (tokens, targets) = demo_train(dropout=0.0)
    path = tmp_path / "train.aotf"
    aotfuse.build(model, (tokens, targets), train=True, targets=("sm_90",)).save(path)
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
