"""Zero-copy graph calls without a GPU: output liveness (OutputSet), the graph cache policy
(InstanceCache), which inputs are keyed, and GraphedProgram's call path with CUDA capture replaced by
a CPU stand-in (a replay reruns the program into the captured output buffers, reading the captured
inputs): every decision the GPU path takes, on CPU tensors. The GPU tier (test_gpu_runtime.py) runs
the same rules under real CUDA graphs."""
from __future__ import annotations

import pytest
import torch

from aotfuse.contract import Program
from aotfuse.errors import AotfuseError, ArchiveError
from aotfuse.knobs import override
from aotfuse.runtime import graphs
from aotfuse.runtime.executor import Executor
from aotfuse.runtime.graph_cache import InstanceCache, OutputSet, PoolChains

import graph_standin  # tests/: CUDA capture replaced by a CPU stand-in

N, K = 64, 32  # x [N, K] float32: 8 KiB, above the 4 KiB copy threshold; bias b [K]: copied


# ---------------------------------------------------------------- OutputSet: liveness
def test_output_set_is_held_by_any_tensor_view_or_storage_on_its_buffers():
    outs = [torch.zeros(2048), torch.zeros(4)]  # 8 KiB: aliased; 16 B: cloned
    s = OutputSet(outs, copy_bytes=4096)
    assert s.aliased == [0] and s.cloned == [1] and not s.held()
    a, b = s.hand_out()
    assert a.data_ptr() == outs[0].data_ptr() and b.data_ptr() != outs[1].data_ptr()
    assert s.held()
    del b  # the cloned output is the caller's own
    assert s.held()
    view = a[10:20]
    del a
    assert s.held()  # a view shares the storage
    del view
    assert not s.held()
    stor = s.hand_out()[0].untyped_storage()  # a storage object alone keeps the buffer too
    assert s.held()
    del stor
    assert not s.held()


class _Saves(torch.autograd.Function):
    """Saves an aliased output for backward, as training's forward does with saved tensors."""

    @staticmethod
    def forward(ctx, p, out_set):
        (saved,) = out_set.hand_out()
        ctx.save_for_backward(saved)
        return (p * 2).sum()

    @staticmethod
    def backward(ctx, g):
        return ctx.saved_tensors[0] * 0 + g, None


class _Grads(torch.autograd.Function):
    """Returns an aliased output as the gradient, as the backward program's graph does."""

    @staticmethod
    def forward(ctx, p, out_set):
        ctx.out_set = out_set
        return p.sum()

    @staticmethod
    def backward(ctx, g):
        return ctx.out_set.hand_out()[0], None


def test_saved_tensors_hold_a_set_until_backward_ran():
    s = OutputSet([torch.ones(2048)], copy_bytes=4096)
    p = torch.nn.Parameter(torch.zeros(2048))
    loss = _Saves.apply(p, s)
    assert s.held()
    loss.backward()
    assert not s.held()


def test_a_gradient_stolen_into_grad_holds_its_set_until_zero_grad():
    sets = [OutputSet([torch.full((2048,), float(i + 1))], copy_bytes=4096) for i in range(2)]
    p = torch.nn.Parameter(torch.zeros(2048))
    _Grads.apply(p, sets[0]).backward()
    # autograd stole the returned tensor: .grad is the set's buffer, no copy
    assert p.grad.data_ptr() == sets[0].outs[0].data_ptr() and sets[0].held()
    # gradient accumulation: the first set is held by .grad, so the next backward must use another;
    # autograd adds it into .grad in place and drops it
    _Grads.apply(p, sets[1]).backward()
    assert sets[0].held() and not sets[1].held()
    assert torch.equal(p.grad, torch.full((2048,), 3.0))
    p.grad = None  # optimizer.zero_grad(set_to_none=True)
    assert not sets[0].held()


# ---------------------------------------------------------------- InstanceCache: policy
class _Entry:
    def __init__(self, key, held=False):
        self.key = key
        self.outputs = self
        self._held = held
        self.last = 0

    def held(self):
        return self._held


def test_cache_replays_a_free_graph_of_the_key_and_captures_another_while_held():
    c = InstanceCache(limit=3)
    assert c.choose(("a",)) == ("capture", None)
    a1 = _Entry(("a",))
    c.add(a1)
    assert c.choose(("a",)) == ("replay", a1)
    a1._held = True
    assert c.choose(("a",)) == ("capture", None)  # another output set for the same addresses
    c.add(_Entry(("a",), held=True))
    c.add(_Entry(("b",), held=True))
    assert c.choose(("a",)) == ("eager", None)  # full, every graph of the key held, nothing idle


def test_cache_evicts_only_idle_free_graphs_for_a_key_seen_before():
    c = InstanceCache(limit=2)
    a, b = _Entry(("a",)), _Entry(("b",))
    c.add(a)
    c.add(b)
    assert c.choose(("x0",)) == ("eager", None)  # first sighting: no capture
    drifting = [c.choose((f"d{i}",)) for i in range(6)]  # a new address on every call never captures
    assert drifting == [("eager", None)] * 6
    assert c.choose(("x0",)) == ("eager", None)  # seen before, but x0 fell out of the recent misses
    assert c.choose(("x0",)) == ("capture", a)  # seen again, and a, b idle for 2 * limit calls: LRU goes
    c.remove(a)
    c.add(_Entry(("x0",)))


def test_cache_does_not_thrash_when_more_keys_cycle_than_fit():
    c = InstanceCache(limit=2)
    captures = 0
    for i in range(60):
        key = (i % 3,)
        what, victim = c.choose(key)
        if what == "capture":
            captures += 1
            if victim is not None:
                c.remove(victim)
            c.add(_Entry(key))
    assert captures == 2  # the third key runs without a graph instead of evicting a busy one


# ---------------------------------------------------------------- keyed inputs
def _ref(t, shape, stride=None, offset=0):
    if stride is None:
        stride, acc = [], 1
        for d in reversed(shape):
            stride.insert(0, acc)
            acc *= d
    return {"t": t, "shape": list(shape), "stride": list(stride), "offset": offset}


def _program(out_rows: int = N) -> Program:
    """inputs x [N, K] (large), w [K, K] (a parameter), b [K] (small); returns
    y = b + (x @ w)[:out_rows] @ w (large), z = x[:1] @ w[:, :2] (8 bytes), and x passed through."""
    f32 = "float32"
    ins = [{"op": "alloc", "buf": "a", "offset": 0, "shape": [N, K], "dtype": f32},
           {"op": "extern", "target": "aten.mm.out", "args": [_ref("x", [N, K]), _ref("w", [K, K])], "kwargs": {},
            "out": "a", "out_view": _ref("a", [N, K]), "out_variant": True, "shape": [N, K], "dtype": f32},
           {"op": "alloc", "buf": "y", "offset": -1, "shape": [out_rows, K], "dtype": f32},
           {"op": "extern", "target": "aten.addmm.out", "args": [_ref("b", [K]), _ref("a", [out_rows, K]),
                                                                 _ref("w", [K, K])],
            "kwargs": {}, "out": "y", "out_view": _ref("y", [out_rows, K]), "out_variant": True,
            "shape": [out_rows, K], "dtype": f32},
           {"op": "alloc", "buf": "z", "offset": -1, "shape": [1, 2], "dtype": f32},
           {"op": "extern", "target": "aten.mm.out", "args": [_ref("x", [1, K]), _ref("w", [K, 2], [K, 1])],
            "kwargs": {}, "out": "z", "out_view": _ref("z", [1, 2]), "out_variant": True, "shape": [1, 2],
            "dtype": f32},
           {"op": "return", "outputs": [_ref("y", [out_rows, K]), _ref("z", [1, 2]), _ref("x", [N, K])]}]
    return Program.from_dict({"version": 3, "inputs": [{"buf": "x", "shape": [N, K], "dtype": f32},
                                                      {"buf": "w", "shape": [K, K], "dtype": f32},
                                                      {"buf": "b", "shape": [K], "dtype": f32}],
                              "weights": {}, "arena_bytes": N * K * 4, "rng": None, "instructions": ins})


def test_inputs_are_keyed_when_large_next_to_the_outputs():
    bound = frozenset({1})
    assert graphs.keyed_inputs(_program(), bound, 4096) == (0,)  # x: 8 KiB in, 8 KiB out (a softmax, a backward)
    assert graphs.keyed_inputs(_program(), bound, 4096, volatile=frozenset({0})) == ()  # a batch passed through
    assert graphs.keyed_inputs(_program(), bound, 1 << 20) == ()  # under the copy threshold: copied
    # inputs small next to the outputs: copied, or each new address would cost a whole output set
    big = _program(out_rows=N * 16)
    assert graphs.keyed_inputs(big, bound, 4096) == ()
    # training says which: a forward never keys its batch, a backward keys its saved tensors
    assert graphs.keyed_inputs(_program(), bound, 4096, key=False) == ()
    assert graphs.keyed_inputs(big, bound, 4096, key=True) == (0,)
    assert graphs.keyed_inputs(big, bound, 4096, frozenset({0}), key=True) == ()


# ---------------------------------------------------------------- the call path on the CPU
@pytest.fixture
def cpu_graphs(monkeypatch):
    return graph_standin.patch(monkeypatch)


def _gp(**knobs):
    with override(**knobs):
        ex = Executor(_program(), {}, {}, torch.device("cpu"))
        return graphs.GraphedProgram(ex, torch.device("cpu"), frozenset({1}))


def _want(x, w, b):
    return b + (x @ w) @ w, x[:1] @ w[:, :2]


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, K, generator=g), torch.randn(K, K, generator=g), torch.randn(K, generator=g)]


def test_graphs_pay_weighs_the_copy_of_large_inputs_against_the_launches_saved():
    """Per call a graph copies each large input it does not key into a static buffer (read + write) and
    saves each launch's host time: a few launches over a large batch run without graphs."""
    ex = Executor(_program(), {}, {}, torch.device("cpu"))
    gp = graphs.GraphedProgram(ex, torch.device("cpu"), frozenset({1}), key=False)
    assert gp.copied == [0, 2] and gp.copied_large_bytes == N * K * 4  # b (K floats) is small: not counted
    assert graphs.launches(_program()) == 3
    with override(bandwidth_gbs=2000.0, launch_overhead_us=4.0):
        use, why = graphs.graphs_pay([gp])  # 8 KiB copied (~0 us) vs 3 launches (~12 us)
        assert use and why.startswith("CUDA graphs: 3 launches")
    with override(bandwidth_gbs=0.001, launch_overhead_us=4.0):  # the same copy at 1 MB/s: ~16 ms
        use, why = graphs.graphs_pay([gp])
        assert not use and f"copying {N * K * 4} input bytes" in why and "3 launches" in why
    keyed = graphs.GraphedProgram(ex, torch.device("cpu"), frozenset({1}), key=True)
    assert keyed.copied_large_bytes == 0  # read in place: nothing to weigh
    with override(bandwidth_gbs=0.001):
        assert graphs.graphs_pay([keyed])[0]


def test_outputs_alias_the_graph_stay_valid_while_held_and_a_held_set_takes_another_graph(cpu_graphs):
    gp = _gp()
    x, w, b = _data(0)
    y1, z1, x1 = gp([x, w, b])
    want1 = _want(x, w, b)
    assert torch.allclose(y1, want1[0]) and torch.allclose(z1, want1[1])
    assert x1.data_ptr() == x.data_ptr() and torch.equal(x1, x)  # passed through: the caller's tensor
    addr1 = y1.data_ptr()
    b2 = b + 1  # copied input (small): new values, same graph key
    y2, z2, _ = gp([x, w, b2])
    assert y2.data_ptr() != addr1 and gp.stats["captures"] == 2  # y1 is held: another output set
    assert torch.allclose(y1, want1[0])  # untouched by call 2
    assert torch.allclose(y2, _want(x, w, b2)[0])
    del y1, x1
    y3, _, _ = gp([x, w, b])
    assert y3.data_ptr() == addr1 and gp.stats["captures"] == 2  # set 1 free again: replayed, no capture
    assert torch.allclose(y3, want1[0]) and torch.allclose(y2, _want(x, w, b2)[0])
    assert gp.stats["replays"] == 3 and gp.stats["eager_calls"] == 0
    del y2, y3
    # the small outputs z1, z2 are clones, still kept: they pin no set
    assert not any(e.outputs.held() for e in gp._families[1].cache.entries)
    assert torch.allclose(z1, want1[1]) and torch.allclose(z2, _want(x, w, b2)[1])


def test_keyed_inputs_are_read_in_place_and_a_new_address_replays_its_own_graph(cpu_graphs):
    gp = _gp()
    x, w, b = _data(1)
    assert gp.keyed == (0,) and gp.copied == [2] and 0 not in gp._family(1).static
    gp([x, w, b])
    x2 = x * 3
    y, _, _ = gp([x2, w, b])
    assert gp.stats["captures"] == 2 and torch.allclose(y, _want(x2, w, b)[0])
    del y
    x.mul_(-1)  # in place at the same address: the graph reads the new values
    y, _, _ = gp([x, w, b])
    assert gp.stats["captures"] == 2 and torch.allclose(y, _want(x, w, b)[0])


def test_beyond_the_limit_a_held_call_runs_without_a_graph(cpu_graphs):
    gp = _gp(graph_instances=2)
    x, w, b = _data(2)
    kept = [gp([x, w, b + i]) for i in range(4)]  # the caller keeps every result
    assert gp.stats == {"captures": 2, "replays": 2, "eager_calls": 2, "evictions": 0, "resets": 0, "warmups": 0}
    for i, (y, z, _) in enumerate(kept):  # all valid, none overwritten
        want = _want(x, w, b + i)
        assert torch.allclose(y, want[0]) and torch.allclose(z, want[1])


def test_a_new_parameter_tensor_drops_the_graphs(cpu_graphs):
    gp = _gp()
    x, w, b = _data(3)
    y1, _, _ = gp([x, w, b])
    w2 = w * 2  # load_state_dict / a .data swap: a different tensor
    y2, _, _ = gp([x, w2, b])
    assert gp.stats["resets"] == 1 and gp.stats["captures"] == 2
    assert torch.allclose(y2, _want(x, w2, b)[0]) and torch.allclose(y1, _want(x, w, b)[0])
    w.mul_(0.5)  # the old parameter updated in place is no longer read
    del y2
    y3, _, _ = gp([x, w2, b])
    assert torch.allclose(y3, _want(x, w2, b)[0]) and gp.stats["captures"] == 2


def test_streams_get_graphs_of_their_own_and_release_keeps_handed_out_outputs(cpu_graphs):
    gp = _gp()
    x, w, b = _data(4)
    y1, _, _ = gp([x, w, b])
    cpu_graphs["id"] = 2
    y2, _, _ = gp([x, w, b + 1])
    assert len(gp._families) == 2 and gp.stats["captures"] == 2
    assert y1.data_ptr() != y2.data_ptr()
    gp.release()
    assert torch.allclose(y1, _want(x, w, b)[0]) and torch.allclose(y2, _want(x, w, b + 1)[0])
    assert gp.stats["captures"] == 2  # counts of dropped streams are kept
    with pytest.raises(AotfuseError, match="closed"):
        gp([x, w, b])


def test_programs_sharing_an_arena_pool_run_in_one_arena_per_stream(cpu_graphs):
    """A training step's forward and backward share one arena per stream (graphs.ArenaPool): sized for
    the larger program, one per stream, and results stay right when both programs run in it in turn."""
    prog = _program()
    pool = graphs.ArenaPool(prog.arena_bytes * 2, torch.device("cpu"))
    a = graphs.GraphedProgram(Executor(prog, {}, {}, torch.device("cpu")), torch.device("cpu"), frozenset({1}),
                              arenas=pool)
    b = graphs.GraphedProgram(Executor(prog, {}, {}, torch.device("cpu")), torch.device("cpu"), frozenset({1}),
                              arenas=pool)
    x, w, bias = _data(7)
    for _ in range(2):  # in turn, as a step's forward and backward
        ya, _, _ = a([x, w, bias])
        yb, _, _ = b([x, w, bias + 1])
        assert torch.allclose(ya, _want(x, w, bias)[0]) and torch.allclose(yb, _want(x, w, bias + 1)[0])
    fa, fb = next(iter(a._families.values())), next(iter(b._families.values()))
    assert fa.state.arena is fb.state.arena and fa.state.arena.numel() == prog.arena_bytes * 2
    cpu_graphs["id"] = 2
    a([x, w, bias])
    assert pool.get(2) is not pool.get(1)
    with pytest.raises(ArchiveError, match="cannot hold"):
        Executor(prog, {}, {}, torch.device("cpu")).state(torch.empty(8, dtype=torch.uint8))


def test_a_program_and_its_graphs_go_with_the_last_reference_not_at_the_next_gc(cpu_graphs):
    """No reference cycle between a program and its per-stream families: dropping the module (the artifact,
    the GraphedProgram) frees the graphs' output sets and arena at once. A cycle kept them until Python's
    cyclic GC ran: a second module loaded in the same process (scripts/ddp_gpu.py's next mode) was measured
    with the first one's ~870 MiB still allocated (issue 12.2)."""
    import gc
    import weakref

    gp = _gp()
    x, w, b = _data(5)
    y, _, _ = gp([x, w, b])
    fam = next(iter(gp._families.values()))
    refs = [weakref.ref(gp), weakref.ref(fam), weakref.ref(fam.state)]
    out = fam.cache.entries[0].outputs.outs[0].untyped_storage()
    del fam, y
    gc.disable()
    try:
        del gp
        assert [r() for r in refs] == [None, None, None]
        assert torch._C._storage_Use_Count(out._cdata) == 1  # only `out` here still refers to the output buffer
    finally:
        gc.enable()


# ---------------------------------------------------------------- graphs sharing a memory pool (PoolChain)
class _Member(_Entry):
    def __init__(self, order, held=False):
        super().__init__(("k",), held)
        self.order = order


def test_pool_chains_join_in_stage_order_and_block_a_replay_while_a_later_member_is_held():
    handles = iter(range(10))
    chains = PoolChains(lambda: next(handles))
    s = [_Member(k) for k in range(3)]
    for m in s:  # stages captured in the order they run: one chain, one pool
        c = chains.open_for(m.order)
        chains.add(c, m)
    assert len(chains.chains) == 1 and c.handle == 0 and c.members == s
    assert not any(chains.held_after(m) for m in s)
    s[2]._held = True  # the last stage's gradients kept (gradient accumulation, or no zero_grad)
    assert chains.held_after(s[0]) and chains.held_after(s[1]) and not chains.held_after(s[2])
    cache = InstanceCache(4, chains.held_after)
    cache.add(s[0])
    assert cache.choose(("k",)) == ("capture", None)  # its own outputs are free, but it must not replay
    again = _Member(0)  # a stage that comes again (a second instance) starts a chain of its own
    c2 = chains.open_for(0)
    chains.add(c2, again)
    assert c2 is not c and c2.handle == 1 and chains.open_for(1) is c2
    # a member dropped while its outputs are held stays as a ghost until they are let go
    chains.remove(s[2])
    assert chains.held_after(s[0]) and len(c.members) == 3
    s[2]._held = False
    assert not chains.held_after(s[0]) and c.members == s[:2]
    for m in s[:2]:
        chains.remove(m)
    assert c not in chains.chains  # empty: its pool is not captured into again


def test_stage_graphs_sharing_a_pool_never_overwrite_held_outputs(monkeypatch):
    """Three programs run in turn (a staged backward's stages) capture into one pool; the stand-in overwrites
    every output of the later graphs in that pool at each replay (their blocks may be its scratch). Held
    outputs stay right: a replay whose pool has a later member held takes another chain."""
    pools = graph_standin.Pools()
    graph_standin.patch(monkeypatch, pools.record)
    monkeypatch.setattr(graphs, "_new_pool", pools.new_pool)
    prog = _program()
    arenas = graphs.ArenaPool(prog.arena_bytes, torch.device("cpu"))
    gps = [graphs.GraphedProgram(Executor(prog, {}, {}, torch.device("cpu")), torch.device("cpu"), frozenset({1}),
                                 arenas=arenas, order=k) for k in range(3)]
    x, w, b = _data(11)

    def step(i):
        return [gp([x, w, b + i + k])[0] for k, gp in enumerate(gps)]

    for i in range(2):  # results dropped after each step: one chain, replayed
        ys = step(i)
        for k, y in enumerate(ys):
            assert torch.allclose(y, _want(x, w, b + i + k)[0])
        del ys, y
    assert [gp.stats["captures"] for gp in gps] == [1, 1, 1] and len(pools.captured) == 1
    # captured on one stream: the allocator reuses a block freed in a pool only on the stream it was freed on
    assert len(pools.sides) == 3 and all(sd is pools.sides[0] for sd in pools.sides) and pools.sides[0] is not None
    kept = step(5)[1:]  # the later stages' results held: the first stage's replay would overwrite them
    ys = step(7)
    for k in range(3):
        if k:
            assert torch.allclose(kept[k - 1], _want(x, w, b + 5 + k)[0]), k
        assert torch.allclose(ys[k], _want(x, w, b + 7 + k)[0]), k
    assert [gp.stats["captures"] for gp in gps] == [2, 2, 2] and len(pools.captured) == 2
    del ys, kept
    step(9)  # all let go: the first chain replays again
    assert [gp.stats["captures"] for gp in gps] == [2, 2, 2] and pools.replays[-3:] == [("pool", 0)] * 3
    assert all(gp.stats["eager_calls"] == 0 for gp in gps)


def test_programs_sharing_an_arena_pool_share_a_matmul_workspace_per_stream():
    """cuBLASLt workspaces (one per executor state) are scratch within one call, as the arena is: the
    programs of a step share one per stream; a larger need gets a new one, and those bound keep theirs."""
    pool = graphs.ArenaPool(64, torch.device("cpu"))
    a = pool.workspace(1, 100)
    assert pool.workspace(1, 60) is a and pool.workspace(2, 60) is not a
    b = pool.workspace(1, 400)
    assert b is not a and b.numel() == 400 and pool.workspace(1, 100) is b and a.numel() == 100


def test_a_graph_dropped_while_its_outputs_are_held_still_blocks_the_graphs_before_it(monkeypatch):
    """A new parameter tensor drops a program's graphs (a reset) even while the caller holds their outputs
    (a gradient in .grad): those outputs stay in the shared pool, so the earlier graphs there must not replay
    over them (graph_cache._Ghost) until they are let go."""
    pools = graph_standin.Pools()
    graph_standin.patch(monkeypatch, pools.record)
    monkeypatch.setattr(graphs, "_new_pool", pools.new_pool)
    prog = _program()
    arenas = graphs.ArenaPool(prog.arena_bytes, torch.device("cpu"))
    gps = [graphs.GraphedProgram(Executor(prog, {}, {}, torch.device("cpu")), torch.device("cpu"), frozenset({1}),
                                 arenas=arenas, order=k) for k in range(3)]
    x, w, b = _data(12)
    gps[0]([x, w, b])
    gps[1]([x, w, b])
    kept = gps[2]([x, w, b])[0]  # the last program's result held
    w2 = w * 2
    assert torch.allclose(gps[2]([x, w2, b])[0], _want(x, w2, b)[0])  # a reset: its held graph dropped
    assert gps[2].stats["resets"] == 1
    y0 = gps[0]([x, w, b])[0]
    assert torch.allclose(kept, _want(x, w, b)[0])  # not overwritten by the first program's replay
    assert torch.allclose(y0, _want(x, w, b)[0]) and gps[0].stats["captures"] == 2
    del kept, y0
    gps[0]([x, w, b])  # let go: the first chain's graph replays again
    assert gps[0].stats["captures"] == 2 and pools.replays[-1] == ("pool", 0)
