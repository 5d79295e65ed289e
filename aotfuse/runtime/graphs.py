"""CUDA graphs of programs, for inference and training alike, owning everything they replay.

A graph replays raw device addresses, so it is safe only while everything at those addresses lives
as long as the graph and nothing else writes there. Who owns what:

- **Memory.** Each instance owns its executor state (the arena, bound once); each capture allocates
  into its own private pool (extern results, outputs). Only that capture allocates from the pool,
  and the pool lives as long as the graph.
- **Library workspaces.** cuBLAS keeps one workspace per (handle, stream) in a process-wide map.
  A capture that finds an entry reuses it without owning it: if it was allocated during an earlier
  capture, it lives in *that* graph's pool, and once that graph is gone and anyone clears the map
  (torch.compile's reduce-overhead mode does, around each of its captures), the replay writes into
  freed memory (`cudaErrorLaunchFailure` or a segfault: repro/replay_crash.py). So the map is
  cleared right before our capture, so that a workspace the program needs is allocated inside this
  graph's pool, and right after, so that the map keeps no pointer into this pool and nobody else
  uses it: the protocol of torch's own cudagraph trees.
- **Streams.** A graph is captured on a stream of its own and replays on the caller's current
  stream. Each caller stream gets its own instance (its own static buffers), up to
  `knobs.graph_streams` streams (least recently used evicted after its stream drained), so two
  streams never share static memory; a lock per instance orders calls from several threads.
  Captures run in thread-local capture mode: other threads keep working while one captures.
- **Kernels.** An instance holds the executor, hence the launchers and the CUDA modules it
  captured. Modules are unloaded only after the device drained and never during a capture
  (cuda_driver's deferred unload). `release()` (Artifact.close) drops every instance at once.

Inputs listed in `bound` (parameters) are captured at their addresses and must keep them: an
optimizer's in-place update is seen by the next replay; a different tensor (load_state_dict, a
`.data` swap) triggers a new capture. Other inputs are copied into static buffers. Outputs are
copied out of the graph's memory after each replay (so results of earlier calls stay valid), except
outputs that are bound inputs passed through, returned as views of the inputs themselves.
"""
from __future__ import annotations

import collections
import threading

import torch

from ..errors import AotfuseError
from ..knobs import knobs
from .executor import Executor, current_stream, new_seed


def _copy(dst: list, src: list) -> None:
    """One multi-tensor copy; a plain copy_ when there is one tensor (less host time)."""
    if len(dst) == 1:
        dst[0].copy_(src[0])
    elif dst:
        torch._foreach_copy_(dst, src)


def _clear_library_workspaces() -> None:
    torch._C._cuda_clearCublasWorkspaces()


class GraphedProgram:
    """One program replayed as CUDA graphs, one instance per caller stream."""

    def __init__(self, executor: Executor, device: torch.device, bound: frozenset[int] = frozenset()):
        self.ex = executor
        self.device = device
        self.bound = bound
        inputs = [i.buf for i in executor.program.inputs]
        # output k is input j passed through (same buffer, whole and unstrided): no copy needed
        self.passthrough = {k: inputs.index(o.t) for k, o in enumerate(executor.program.returned)
                            if o.t in inputs and inputs.index(o.t) in bound}
        self._instances: collections.OrderedDict[int, _Instance] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._released = False

    @property
    def captures(self) -> int:
        return sum(i.captures for i in list(self._instances.values()))

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        inst = self._instance(current_stream(self.device.index))
        with inst.lock:
            if inst.released:  # evicted between lookup and lock: take a fresh one
                return self(inputs)
            return inst.run(inputs)

    def _instance(self, stream: int) -> "_Instance":
        with self._lock:
            if self._released:
                raise AotfuseError("this artifact was closed; its CUDA graphs are gone",
                                   remedy="load the archive again")
            inst = self._instances.get(stream)
            if inst is not None:
                self._instances.move_to_end(stream)
                return inst
            # made on the caller's thread with its stream current: the instance keeps that Stream
            inst = self._instances[stream] = _Instance(self, torch.cuda.current_stream(self.device))
            evicted = []
            while len(self._instances) > max(1, knobs.graph_streams):
                evicted.append(self._instances.popitem(last=False)[1])
        for old in evicted:
            old.release()
        return inst

    def release(self) -> None:
        """Drop every instance after its stream drained; later calls raise."""
        with self._lock:
            self._released = True
            olds = list(self._instances.values())
            self._instances.clear()
        for inst in olds:
            inst.release()


class _Instance:
    """The graph of one program for one caller stream, with the static buffers it replays on."""

    def __init__(self, prog: GraphedProgram, stream: torch.cuda.Stream):
        self.prog = prog
        self.stream = stream
        self.lock = threading.Lock()
        self.graph = None
        self.released = False
        self.captures = 0

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        p = self.prog
        if self.graph is None or any(inputs[i].data_ptr() != self.bound_ptrs[i] for i in p.bound):
            self._capture(inputs)
        _copy(self.copy_to, [inputs[i] for i in self.copy_idx])
        if self.seed is not None:
            self.seed.copy_(new_seed(p.device))
        self.graph.replay()
        outs = [None] * len(self.static_out)
        fresh = [torch.empty_like(t) for t in self.fresh_src]
        _copy(fresh, self.fresh_src)
        for k, t in zip(self.fresh_idx, fresh):
            outs[k] = t
        for k, j in p.passthrough.items():  # a fresh view per call, like the eager executor makes
            o = self.static_out[k]
            outs[k] = inputs[j].as_strided(o.shape, o.stride(), o.storage_offset())
        return outs

    def _capture(self, inputs: list[torch.Tensor]) -> None:
        p, stream = self.prog, self.stream
        self.graph = None  # a recapture (bound address changed): the old graph and pool go first
        self.static = [x if i in p.bound else x.detach().clone() for i, x in enumerate(inputs)]
        # addresses at capture: a Parameter whose .data is swapped keeps its identity, not its address
        self.bound_ptrs = {i: inputs[i].data_ptr() for i in p.bound}
        self.seed = new_seed(p.device) if p.ex.program.rng else None
        self.state = p.ex.state()  # this instance's own arena: the graph replays its addresses
        capture_stream = torch.cuda.Stream(p.device)
        capture_stream.wait_stream(stream)
        with torch.cuda.stream(capture_stream), torch.no_grad():
            p.ex.run(self.static, self.seed, self.state)  # warm-up: lazy library set-up stays out of the graph
        graph = torch.cuda.CUDAGraph()
        _clear_library_workspaces()
        try:
            with torch.cuda.stream(capture_stream), torch.no_grad():
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self.static_out = p.ex.run(self.static, self.seed, self.state)
                finally:
                    graph.capture_end()
        finally:
            _clear_library_workspaces()
        stream.wait_stream(capture_stream)
        self.graph = graph
        self.copy_idx = [i for i in range(len(inputs)) if i not in p.bound]
        self.copy_to = [self.static[i] for i in self.copy_idx]
        self.fresh_idx = [k for k in range(len(self.static_out)) if k not in p.passthrough]
        self.fresh_src = [self.static_out[k] for k in self.fresh_idx]
        self.captures += 1

    def release(self) -> None:
        with self.lock:
            if self.graph is not None:
                self.stream.synchronize()  # the last replay may still run; its pool must outlive it
            self.released = True
            self.graph = None
            self.static = self.static_out = self.copy_to = self.fresh_src = []
            self.state = None
