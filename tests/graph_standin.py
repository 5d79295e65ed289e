"""CUDA-graph stand-ins for the CPU (runtime/graphs.py's capture replaced): a replay reruns the program on the
captured inputs and writes the results into the captured outputs, its fixed addresses. `Pools` adds the hazard
of graphs sharing a memory pool (graph_cache.PoolChain) at its worst: each replay of a graph captured into a
shared pool overwrites (NaN) every output of every graph captured after it in that pool, dropped ones too
(their outputs may still be held), as if each of those blocks had been its scratch."""
from __future__ import annotations

import ctypes
import gc
import itertools

import torch

from aotfuse.runtime import graphs
from aotfuse.runtime.graph_cache import copy_all


class Stream:
    def synchronize(self):
        pass


def by_address(t):
    """A view of t's memory that does not keep it (a CUDA graph keeps addresses, not tensors): holding the
    captured inputs themselves would hold the output sets they came from."""
    if not isinstance(t, torch.Tensor) or not t.untyped_storage().nbytes():
        return t
    s = t.untyped_storage()
    raw = torch.frombuffer((ctypes.c_char * s.nbytes()).from_address(s.data_ptr()), dtype=torch.uint8)
    return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


class CPUGraph:
    """A module-level class: one made per capture would be a reference cycle (as every class is) and keep
    the state alive."""

    def __init__(self, ex, args, seed, state, outs, donate=False):
        self.ex, self.seed, self.state, self.outs, self.donate = ex, seed, state, outs, donate
        self.args = [by_address(a) for a in args]

    def replay(self):
        fresh = self.ex.run(self.args, self.seed, self.state, self.donate)
        pairs = [(o, f) for o, f in zip(self.outs, fresh) if o is not None]
        copy_all([o for o, _ in pairs], [f for _, f in pairs])
        del fresh, pairs
        _collect()


def _collect():
    """Triton's interpreter leaves reference cycles that hold Python storage objects of a launch's arguments
    (its _restore_args_dev closure): collected, or output sets would look held (graph_cache._counts)."""
    gc.collect(1)


def record(ex, args, seed, state, stream, pool=None, side=None, donate=False):
    # a capture runs nothing: a donating graph's inputs are spent only by its replays (the stand-in's capture
    # run keeps them)
    outs = ex.run(args, seed, state)
    _collect()
    return CPUGraph(ex, args, seed, state, outs, donate), outs  # the same list: _capture sets passed-through ones to None


class _Scribbling(CPUGraph):
    def __init__(self, pools, pool, *a):
        super().__init__(*a)
        self.pools, self.pool = pools, pool

    def replay(self):
        super().replay()
        self.pools.replays.append(self.pool)
        if self.pool is None:
            return
        later = self.pools.captured[self.pool]
        later = later[next(i for i, o in enumerate(later) if o is self.outs) + 1:]
        for outs in later:
            for t in outs:
                if t is not None and t.is_floating_point():
                    t.fill_(float("nan"))


class Pools:
    """record() for graphs.py: shared pools overwritten as above; `captured[pool]` lists each capture's outputs."""

    def __init__(self):
        self.captured: dict = {}
        self.replays: list = []
        self.sides: list = []  # the capture stream of each capture
        self._ids = itertools.count()

    def new_pool(self):
        return ("pool", next(self._ids))

    def record(self, ex, args, seed, state, stream, pool=None, side=None, donate=False):
        self.sides.append(side)
        outs = ex.run(args, seed, state)
        _collect()
        if pool is not None:
            self.captured.setdefault(pool, []).append(outs)
        return _Scribbling(self, pool, ex, args, seed, state, outs, donate), outs


def patch(monkeypatch, recorder=record, stream_id=None) -> dict:
    """Graphs on the CPU: the capture replaced by `recorder`; returns {"id": ...}, the current stream's id."""
    stream = {"id": 1} if stream_id is None else stream_id
    monkeypatch.setattr(graphs, "_record", recorder)
    monkeypatch.setattr(graphs, "_caller_stream", lambda device: Stream())
    monkeypatch.setattr(graphs, "_side_stream", lambda device: Stream())
    monkeypatch.setattr(graphs, "current_stream", lambda index: stream["id"])
    return stream
