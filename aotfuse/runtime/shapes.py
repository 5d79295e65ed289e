"""Per-shape executors of a program with dynamic dims: linked at a shape's first call, LRU-bounded.

A program written for dynamic dims holds size expressions; the executor runs static programs. For
each tuple of dim values a call brings (the guards bind them, runtime/dims.py), the program is
specialized (`aotfuse.contract.specialize`: every size evaluated), validated at that shape
(runtime/validate_dims.validate_shape: every check a static program gets, before the first
launch) and linked into an `Executor` over the artifact's loaded kernels and weights. Linking only:
the kernels take the dims as int32 arguments, so nothing is compiled at load or at a call.

With CUDA graphs on, each shape gets its own `GraphedProgram`, captured at its first call (a new
shape costs one warm-up run and one capture) and replayed after. At most `knobs.shape_cache` shapes
are kept per program; beyond, the least recently used one is released: its graphs (after their
streams drained) and its executor's arenas. A shape in use by another thread when it is evicted is
released when that call returns.

Memory: per cached shape and caller stream, one arena of that shape's size (runtime/executor.py),
plus, with graphs, what runtime/graphs.py lists per graph (output sets, capture pools). Shapes do
not share an arena: two shapes are two executors, whose calls are not ordered with each other.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Mapping

import torch

from ..contract.program import Program, specialize
from ..errors import AotfuseError
from ..knobs import knobs
from .executor import Executor
from .validate_dims import validate_shape

GRAPH_STATS = ("captures", "replays", "eager_calls")


class _Shape:
    """One linked shape: its executor, its graphs (CUDA) and what it has served."""
    __slots__ = ("key", "executor", "graphed", "calls", "users", "evicted", "link_seconds")

    def __init__(self, key: tuple, executor: Executor, graphed, link_seconds: float):
        self.key, self.executor, self.graphed, self.link_seconds = key, executor, graphed, link_seconds
        self.calls = 0
        self.users = 0  # calls running on it now
        self.evicted = False

    def graph_stats(self) -> dict:
        s = self.graphed.stats if self.graphed is not None else {}
        return {k: s.get(k, 0) for k in GRAPH_STATS}


class ShapeCache:
    """One program's shapes, keyed by the tuple of dim values (in `syms` order)."""

    def __init__(self, name: str, program: Program, kernels: dict, weights: dict[str, torch.Tensor],
                 launchers: dict[str, Callable], device: torch.device, syms: tuple[str, ...],
                 make_graph: Callable[[Executor], object] | None = None):
        """make_graph: wraps a shape's executor into a GraphedProgram (None: no CUDA graphs)."""
        self.name = name
        self.program = program
        self.kernels = kernels
        self.weights = weights
        self.launchers = launchers
        self.device = device
        self.syms = syms
        self.make_graph = make_graph
        self.capacity = max(1, knobs.shape_cache)
        self._entries: collections.OrderedDict[tuple, _Shape] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._retired = collections.Counter()  # graph stats and calls of released shapes
        self.linked = 0  # shapes linked so far (a re-linked evicted shape counts again)
        self.evictions = 0
        self._released = False

    def key(self, env: Mapping[str, int]) -> tuple:
        return tuple(env[s] for s in self.syms)

    def run(self, env: Mapping[str, int], inputs) -> list[torch.Tensor]:
        """Run the program at the shape `env` (dim values, bound by the guards) on `inputs`."""
        entry = self._acquire(self.key(env), env)
        try:
            if entry.graphed is not None:
                return entry.graphed(list(inputs))
            return entry.executor.run(list(inputs))
        finally:
            self._leave(entry)

    def executor(self, env: Mapping[str, int]) -> Executor:
        """The executor of shape `env`, linked if needed (for reports: matmul paths, arena sizes)."""
        entry = self._acquire(self.key(env), env)
        self._leave(entry)
        return entry.executor

    def _acquire(self, key: tuple, env: Mapping[str, int]) -> _Shape:
        evicted = []
        with self._lock:  # a new shape is linked under the lock: concurrent first calls link it once
            if self._released:
                raise AotfuseError("this artifact was closed; its executors are gone", remedy="load the archive again")
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = self._link(key, env)
                while len(self._entries) > self.capacity:
                    old = self._entries.popitem(last=False)[1]
                    old.evicted = True
                    self.evictions += 1
                    if old.users == 0:
                        evicted.append(old)
            else:
                self._entries.move_to_end(key)
            entry.users += 1
            entry.calls += 1
        for old in evicted:
            self._release(old)
        return entry

    def _leave(self, entry: _Shape) -> None:
        with self._lock:
            entry.users -= 1
            done = entry.evicted and entry.users == 0
        if done:
            self._release(entry)

    def _link(self, key: tuple, env: Mapping[str, int]) -> _Shape:
        t0 = time.perf_counter()
        prog = specialize(self.program, env)
        validate_shape(self.name, prog, self.kernels, self.weights, env)
        ex = Executor(prog, self.weights, self.launchers, self.device)
        self.linked += 1
        return _Shape(key, ex, self.make_graph(ex) if self.make_graph is not None else None,
                      time.perf_counter() - t0)

    def _release(self, entry: _Shape) -> None:
        """Drop a shape's graphs (after their streams drained) and its executor."""
        stats = entry.graph_stats()
        if entry.graphed is not None:
            entry.graphed.release()
        with self._lock:
            self._retired.update(stats)
            self._retired["calls"] += entry.calls
        entry.graphed = None

    def stats(self) -> dict:
        """What the cache holds and has done: shapes cached (with each one's dims, calls, link time and
        graph captures / replays) and totals over every shape since load."""
        with self._lock:
            entries = list(self._entries.values())
            total = collections.Counter(self._retired)
        shapes = []
        for e in entries:
            g = e.graph_stats()
            total.update(g)
            total["calls"] += e.calls
            shapes.append({"dims": dict(zip(self.syms, e.key)), "calls": e.calls,
                           "link_ms": round(e.link_seconds * 1e3, 3), **g})
        return {"program": self.name, "cached": len(entries), "capacity": self.capacity, "linked": self.linked,
                "evictions": self.evictions, "calls": total["calls"],
                **{k: total[k] for k in GRAPH_STATS}, "shapes": shapes}

    def release(self) -> None:
        """Drop every shape (Artifact.close); later calls raise."""
        with self._lock:
            self._released = True
            olds = list(self._entries.values())
            self._entries.clear()
        for e in olds:
            self._release(e)
