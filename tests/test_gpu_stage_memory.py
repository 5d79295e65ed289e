"""GPU tier (skipped without CUDA): what a staged backward's CUDA graphs hold (issue 12.2).

The stage graphs capture into one shared memory pool (graph_cache.PoolChain) and share the step's arena and
cuBLASLt workspace: the staged step's peak allocation is the one-program step's plus the carries, its stage
pools reserve no more than a pool per stage did, and dropping the module frees every graph at once (no
reference cycle left for Python's GC)."""
from __future__ import annotations

import copy
import gc

import pytest
import torch

import aotfuse
from aotfuse.runtime import graph_cache
from aotfuse.runtime.graph_memory import totals, train_memory
from aotfuse.specs import load_spec, random_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MiB = 2 ** 20


def _arch():
    major, minor = torch.cuda.get_device_capability()
    return (f"sm_{major}{minor}",)


@pytest.fixture(scope="module")
def archives():
    model, inputs = load_spec("aotfuse.examples.gpt:demo_train(dropout=0.0)")
    return model, {n: aotfuse.build(model, inputs, train=True, targets=_arch(), step="split", backward_stages=n).data
                   for n in (1, 3)}


def _pools() -> dict:
    """Reserved bytes per private memory pool (segments of the default pool left out)."""
    out: dict = {}
    segments = torch.cuda.memory._snapshot()["segments"]
    if segments and "segment_pool_id" not in segments[0]:
        pytest.skip("this torch's memory snapshot does not say which pool a segment is in")
    for seg in segments:
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        if pool != (0, 0):
            out[pool] = out.get(pool, 0) + seg["total_size"]
    return out


def _train(data, model, steps: int = 4):
    """(peak allocated above the start, bytes per private pool after the steps, the module)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    before = set(_pools())
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    pm = aotfuse.load(data, device="cuda").as_module()
    ref = copy.deepcopy(model).cuda()
    for step in range(steps):
        batch = random_inputs(pm._art.input_specs, device="cuda", seed=step)
        for m in (pm, ref):
            m.zero_grad(set_to_none=True)
            m(*batch).backward()
        want = dict(ref.named_parameters())
        for n, p in pm.named_parameters():
            g = p.grad.detach().double()
            assert float((g - want[n].grad.double()).norm() / want[n].grad.double().norm().clamp_min(1e-30)) < 1e-3, n
    del ref
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    pools = {k: v for k, v in _pools().items() if k not in before}
    return peak, pools, pm


def test_stage_graphs_share_one_pool_and_hold_the_one_program_step_plus_the_carries(archives, monkeypatch):
    model, data = archives
    one_peak, one_pools, one = _train(data[1], model)
    del one
    staged_peak, staged_pools, pm = _train(data[3], model)
    stages = [g for name, g in pm._graphs.items() if name != "forward"]
    assert [g.stats["captures"] for g in stages] == [1, 1, 1], [g.stats for g in stages]
    fams = [next(iter(g._families.values())) for g in stages]
    chains = fams[0].chains
    assert all(f.chains is chains for f in fams) and len(chains.chains) == 1 and len(chains.chains[0].members) == 3
    # forward's pool + the stages' shared pool, as forward's + backward's for one program
    assert len(staged_pools) == len(one_pools) == 2, (staged_pools, one_pools)
    # one cuBLASLt workspace per stream for the step's programs (a second only where a later need was larger)
    ws = {f.state.lt_workspace.data_ptr() for g in pm._graphs.values() for f in g._families.values()
          if f.state.lt_workspace is not None}
    assert len(ws) <= 2
    carries = totals(train_memory(aotfuse.load(data[3], device="cpu"))).carries
    print(f"peak above start: one program {one_peak / MiB:.2f} MiB, 3 stages {staged_peak / MiB:.2f} MiB "
          f"(carries {carries / MiB:.2f}); pools one {sorted(v / MiB for v in one_pools.values())}, "
          f"staged {sorted(v / MiB for v in staged_pools.values())}")
    assert staged_peak <= one_peak + carries + 2 * MiB
    del pm
    # the same stages with a pool per graph (what the runtime did before the chains) reserve at least as much
    real = graph_cache.PoolChains.open_for

    def one_pool_each(self, order):
        c = graph_cache.PoolChain(self.new_handle())
        self.chains.append(c)
        return c
    monkeypatch.setattr(graph_cache.PoolChains, "open_for", one_pool_each)
    _, private_pools, pm = _train(data[3], model)
    monkeypatch.setattr(graph_cache.PoolChains, "open_for", real)
    assert len(private_pools) == 4
    assert sum(staged_pools.values()) <= sum(private_pools.values())


def test_dropping_the_module_frees_its_graphs_without_a_collection(archives):
    """A program and its per-stream families form no reference cycle: the graphs' output sets, pools and the
    arena go with the module (a measurement of the next module no longer counts them)."""
    import weakref

    model, data = archives
    gc.collect()
    torch.cuda.synchronize()
    gc.disable()
    try:
        art = aotfuse.load(data[3], device="cuda")
        pm = art.as_module()
        for step in range(2):
            pm.zero_grad(set_to_none=True)
            pm(*random_inputs(art.input_specs, device="cuda", seed=step)).backward()
        assert pm._graphs is not None
        refs = [weakref.ref(g) for g in pm._graphs.values()]
        pm.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        during = torch.cuda.memory_allocated()
        held = sum(g.ex.program.arena_bytes for g in pm._graphs.values()) // len(pm._graphs)
        del pm, art
        torch.cuda.synchronize()
        # (memory other tests left may be freed meanwhile: compare with what this module held, not a baseline)
        assert all(r() is None for r in refs), "a graph outlived its module (a reference cycle)"
        assert during - torch.cuda.memory_allocated() >= held, (during, torch.cuda.memory_allocated(), held)
    finally:
        gc.enable()
