"""CUDA graphs of programs, for inference and training alike: zero-copy calls, graphs owning what they replay.

A graph replays raw device addresses: the inputs it was captured on, the outputs it wrote, its
scratch. A call copies nothing in and clones nothing out (beyond the small tensors below):

- **Inputs.** Parameters (`bound`) are read in place at their addresses: an optimizer's in-place
  update is seen by the next replay; a different tensor (load_state_dict, a `.data` swap) drops the
  stream's graphs and the next call captures again. Large inputs are read in place too: each graph
  is keyed by their addresses (a call whose tensors sit elsewhere replays another graph, or captures
  one), so a training backward reads the saved tensors where the forward's graph wrote them. Whether
  a program's large inputs are keyed: a training backward's are (saved tensors live at the forward
  graphs' few addresses); a training forward's are not (a batch is a new tensor every step, and a
  new address would cost a whole set of saved activations): they are copied into the stream's static
  buffers; for an inference program, they are keyed when at least 1/KEY_RATIO of its outputs' bytes
  (a softmax, a vision model's images), else copied. Inputs of at most `knobs.graph_copy_bytes`
  (token ids, the loss tangent, the seed) are always copied: the cost of a launch.
- **Outputs.** Each graph writes one set of output buffers (its private pool). A call hands them
  out as new tensors on those buffers (graph_cache.OutputSet), and the graph is replayed again only
  once the caller holds none of them (no tensor, view, `.grad` or autograd-saved tensor shares
  their storage). While a set is held, a call takes another graph of the same key, or captures one
  (up to `knobs.graph_instances` graphs per program and caller stream); beyond that, the call runs
  the program without a graph (the executor on the same arena: fresh outputs, still no copy),
  counted in `stats["eager_calls"]`. Outputs of at most `graph_copy_bytes` are cloned (a loss kept
  by the caller must not pin a set of activations), but for a training backward's (and a fused step's)
  gradients (`alias_small`): its large gradients hold the set anyway, and cloning every small one (biases,
  norms) cost more host time per step than the graph replays. An output that is an input passed through is
  returned as a view of that input, as the executor does.

Aliasing rules (what the caller sees): a returned tensor aliases its graph's output buffer; it
stays valid, unchanged by later calls, for as long as the caller (or autograd, or `.grad`) keeps
any tensor on that buffer, so keeping it is always safe, and costs an output set per call kept
alive. Other streams: a result read on another stream must stay referenced until that work is
done; `record_stream` does not protect it. A raw pointer (`data_ptr()`) kept without the tensor is
not a reference. In training the saved tensors are the forward graph's outputs (held by autograd
until the backward ran), the backward graph reads them in place, and a gradient autograd stores
into `.grad` keeps its set until `zero_grad()` (set_to_none) or until `.grad` is replaced.

Memory cost, per program and caller stream: one arena (shared by its graphs: replays on one
stream run in order; a training step's forward and backward share one too, `ArenaPool`, and one
cuBLASLt workspace), static buffers for the copied inputs, and per graph (at most `graph_instances`)
one output set plus what the capture allocated and freed in its pool (extern results, library
workspaces: reserved, not allocated, between replays); `graph_memory.py` lists these per program.
Graphs are captured on demand: a training step that frees its saved
tensors and sets grads to None needs one forward and one backward graph; two forwards alive at
once need two, and so on. Each capture costs one warm-up run and one capture, no compile.

What a graph owns:
- **Memory.** Its capture allocates into its own private pool (extern results, outputs); only that
  capture allocates from the pool, and the pool lives as long as the graph and the outputs handed out.
  Programs given an `order` (a staged backward's stages) capture into pools they share instead, one
  chain of graphs per pool in stage order (graph_cache.PoolChain): the stages' scratch is reserved
  once, not per stage; a graph of a chain replays only while no graph captured after it in that pool
  has its outputs held (else the call takes another graph, in another pool), which is what makes a
  block one capture freed safe to give to a later one (the cudagraph-trees rule).
- **Library workspaces.** cuBLAS keeps one workspace per (handle, stream) in a process-wide map.
  A capture that finds an entry reuses it without owning it: if it was allocated during an earlier
  capture, it lives in *that* graph's pool, and once that graph is gone and anyone clears the map
  (torch.compile's reduce-overhead mode does, around each of its captures), the replay writes into
  freed memory (`cudaErrorLaunchFailure` or a segfault: repro/replay_crash.py). So the map is
  cleared right before our capture, so that a workspace the program needs is allocated inside this
  graph's pool, and right after, so that the map keeps no pointer into this pool and nobody else
  uses it: the protocol of torch's own cudagraph trees.
- **Streams.** A graph is captured on a stream of its own and replays on the caller's current
  stream. Each caller stream gets graphs of its own, up to `knobs.graph_streams` streams (least
  recently used dropped after its stream drained), so two streams never share static memory; a
  lock per stream orders calls from several threads. Captures run in thread-local capture mode:
  other threads keep working while one captures.
- **Kernels.** A graph holds the executor, hence the launchers and the CUDA modules it captured.
  Modules are unloaded only after the device drained and never during a capture (cuda_driver's
  deferred unload). `release()` (Artifact.close) drops every graph at once; outputs already handed
  out stay valid (they own their buffers).
"""
from __future__ import annotations

import collections
import threading
import weakref

import torch

from ..contract.program import Extern, Launch, Program
from ..errors import AotfuseError
from ..knobs import knobs
from .executor import Executor, current_stream, new_seed, torch_dtype
from .graph_memory import allocated_bytes, nbytes
from .graph_cache import InstanceCache, OutputSet, PoolChains, copy_all

KEY_RATIO = 8  # large inputs are read in place (keyed) when at least 1/8 of the outputs' bytes
STATS = ("captures", "replays", "eager_calls", "evictions", "resets", "warmups")


def _clear_library_workspaces() -> None:
    torch._C._cuda_clearCublasWorkspaces()


def _output_bytes(program: Program) -> int:
    """Bytes of the buffers the program returns (inputs passed through excluded)."""
    size = allocated_bytes(program)
    return sum(size.get(b, 0) for b in {o.t for o in program.returned})


def keyed_inputs(program: Program, bound: frozenset[int], copy_bytes: int,
                 volatile: frozenset[int] = frozenset(), key: bool | None = None) -> tuple[int, ...]:
    """The inputs graphs read in place, keyed by their addresses: the large ones that are not bound or
    volatile, when `key` (None: when they are at least 1/KEY_RATIO of the outputs' bytes)."""
    large = [i for i, x in enumerate(program.inputs)
             if i not in bound and i not in volatile and nbytes(x.shape, x.dtype) > copy_bytes]
    if key is None:
        in_bytes = sum(nbytes(program.inputs[i].shape, program.inputs[i].dtype) for i in large)
        key = KEY_RATIO * in_bytes >= _output_bytes(program)
    return tuple(large) if key else ()


def launches(program: Program) -> int:
    """Kernel launches and library calls one run of the program makes."""
    return sum(isinstance(i, (Launch, Extern)) for i in program.instructions)


def graphs_pay(graphed: "list[GraphedProgram]") -> tuple[bool, str]:
    """Whether CUDA graphs pay for a set of programs that run together (a training step): a graph
    removes the host cost of each launch (`knobs.launch_overhead_us`) but copies each large input it
    does not key by address into a static buffer on every call (read + write at `knobs.bandwidth_gbs`).
    A step whose batch is one large tensor and few kernels (a loss over 8192 x 32000 logits: 3 launches
    against a 0.5 GB copy) runs faster without graphs; a model's step (hundreds of launches, a batch of
    token ids) with them. The reason names both costs."""
    copy_bytes = sum(g.copied_large_bytes for g in graphed)
    n = sum(launches(g.ex.program) for g in graphed)
    copy_us = 2 * copy_bytes / (knobs.bandwidth_gbs * 1e3)
    launch_us = n * knobs.launch_overhead_us
    if copy_us > launch_us:
        return False, (f"no CUDA graphs: copying {copy_bytes} input bytes into static buffers per call "
                       f"(~{copy_us:.0f} us) costs more than the host time of {n} launches (~{launch_us:.0f} us)")
    return True, (f"CUDA graphs: {n} launches (~{launch_us:.0f} us of host time) outweigh copying "
                  f"{copy_bytes} input bytes per call (~{copy_us:.0f} us)")


class GraphedProgram:
    """One program replayed as CUDA graphs: per caller stream, graphs keyed by input addresses."""

    def __init__(self, executor: Executor, device: torch.device, bound: frozenset[int] = frozenset(),
                 volatile: frozenset[int] = frozenset(), key: bool | None = None, arenas: "ArenaPool | None" = None,
                 order: int | None = None, alias_small: frozenset[int] = frozenset()):
        """bound: parameters, read at their addresses; volatile: inputs that are new tensors on every
        call (a batch the forward passed through to the backward), copied; key: whether the other
        large inputs are keyed by address (None: decided by size, see keyed_inputs); arenas: one arena
        and matmul workspace per caller stream shared with other programs (a training step's forward and
        backward); order: with arenas, the program's place among programs that run in turn (a staged
        backward's stages): their graphs share memory pools (graph_cache.PoolChain); None: a pool per graph;
        alias_small: outputs handed out on the graph's buffers even when small (graph_cache.OutputSet)."""
        self.ex = executor
        self.arenas = arenas
        self.order = order if arenas is not None else None
        self.device = device
        self.bound = bound
        prog = executor.program
        names = [i.buf for i in prog.inputs]
        # output k is input j passed through: handed out as a view of the caller's input
        self.passthrough = {k: names.index(o.t) for k, o in enumerate(prog.returned) if o.t in names}
        self._through = [(k, j, prog.returned[k]) for k, j in self.passthrough.items()]
        self.copy_bytes = knobs.graph_copy_bytes
        self.alias_small = frozenset(alias_small)
        self.instances = knobs.graph_instances
        self.keyed = keyed_inputs(prog, bound, self.copy_bytes, volatile, key)
        self.copied = [i for i in range(len(names)) if i not in bound and i not in self.keyed]
        self.bound_order = sorted(bound)
        self._families: collections.OrderedDict[int, _Family] = collections.OrderedDict()
        self._retired: collections.Counter = collections.Counter()  # stats of dropped families
        self._lock = threading.Lock()
        self._released = False

    @property
    def copied_large_bytes(self) -> int:
        """Bytes a call copies into static buffers beyond the small inputs (`knobs.graph_copy_bytes`)."""
        ins = self.ex.program.inputs
        sizes = [nbytes(ins[i].shape, ins[i].dtype) for i in self.copied]
        return sum(b for b in sizes if b > self.copy_bytes)

    @property
    def stats(self) -> dict:
        """captures, replays, eager_calls (no graph could serve), evictions, resets (bound changed), warmups (a
        donating key's first call, run without a graph: _Family.run)."""
        with self._lock:
            total = collections.Counter(self._retired)
            for fam in self._families.values():
                total.update(fam.stats)
        return {k: total[k] for k in STATS}

    @property
    def captures(self) -> int:
        return self.stats["captures"]

    @property
    def released(self) -> bool:
        return self._released

    def __call__(self, inputs: list[torch.Tensor], donate: bool = False) -> list[torch.Tensor]:
        """donate: as Executor.run's (a training backward whose saved tensors autograd frees after it)."""
        fam = self._family(current_stream(self.device.index))
        with fam.lock:
            if fam.released:  # dropped between lookup and lock: take a fresh one
                return self(inputs, donate)
            outs = fam.run(inputs, donate)
        for k, j, o in self._through:  # a view of the caller's input, as the executor returns
            if outs[k] is None:
                x = inputs[j]
                outs[k] = x.as_strided(o.shape, o.stride, x.storage_offset() + o.offset)
        return outs

    def _family(self, stream: int) -> "_Family":
        with self._lock:
            if self._released:
                raise AotfuseError("this artifact was closed; its CUDA graphs are gone",
                                   remedy="load the archive again")
            fam = self._families.get(stream)
            if fam is not None:
                self._families.move_to_end(stream)
                return fam
            # made on the caller's thread with its stream current: the family keeps that Stream
            fam = self._families[stream] = _Family(self, _caller_stream(self.device), stream)
            evicted = []
            while len(self._families) > max(1, knobs.graph_streams):
                evicted.append(self._families.popitem(last=False)[1])
        for old in evicted:
            self._retire(old)
        return fam

    def _retire(self, fam: "_Family") -> None:
        fam.release()
        with self._lock:
            self._retired.update(fam.stats)

    def release(self) -> None:
        """Drop every graph after its stream drained; later calls raise."""
        with self._lock:
            self._released = True
            olds = list(self._families.values())
            self._families.clear()
        for fam in olds:
            self._retire(fam)


def _caller_stream(device: torch.device):
    return torch.cuda.current_stream(device)


def _new_pool():
    return torch.cuda.graph_pool_handle()


def _side_stream(device: torch.device):
    return torch.cuda.Stream(device)


def _record(ex: Executor, args: list, seed, state, stream, pool=None, side=None, donate: bool = False) -> tuple:
    """Capture one run of the program on `args` into a CUDA graph: (graph, its outputs). pool: a memory
    pool shared with other graphs (graph_cache.PoolChain); None: a private one. side: the stream to
    capture on (graphs sharing a pool capture on one: the allocator reuses a freed block only for an
    allocation on the stream it was freed on); None: a new one. donate: the graph writes over the donated
    inputs (Executor.run); no warm-up run then (it would spend them before the replay reads them): the
    caller ran the program without a graph first (_Family.run)."""
    side = _side_stream(ex.device) if side is None else side
    side.wait_stream(stream)
    if not donate:
        with torch.cuda.stream(side), torch.no_grad():
            ex.run(args, seed, state)  # warm-up: lazy library set-up stays out of the graph
    graph = torch.cuda.CUDAGraph()
    _clear_library_workspaces()
    try:
        with torch.cuda.stream(side), torch.no_grad():
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                outs = ex.run(args, seed, state, donate)
            finally:
                graph.capture_end()
    finally:
        _clear_library_workspaces()
    stream.wait_stream(side)
    return graph, outs


class ArenaPool:
    """One arena per caller stream, shared by the programs given it (sized for the largest): a training
    step's forward and backward never run at once on one stream (its work runs in order), and each
    reads the other's results from output sets, never from the arena, so one arena serves both: the
    step holds max(forward, backward) arena bytes instead of their sum. An arena lives while a family
    (a program's graphs on that stream) uses it. For the same reason the programs share one cuBLASLt
    workspace per stream (`workspace`: scratch within one matmul call), and programs given an `order`
    (a staged backward's stages) capture their graphs into shared memory pools (`chains`)."""

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes = int(nbytes)
        self.device = device
        self._arenas: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        self._workspaces: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        self._chains: dict[int, PoolChains] = {}
        self._sides: dict[int, object] = {}  # caller stream -> the stream its chained graphs are captured on
        self._lock = threading.Lock()

    def workspace(self, stream: int, need: int) -> torch.Tensor:
        """The stream's matmul workspace, of at least `need` bytes. A larger need gets a new one that later
        states share; states bound to the smaller one keep it (their graphs replay its address)."""
        with self._lock:
            t = self._workspaces.get(stream)
            if t is None or t.numel() < need:
                t = torch.empty(need, dtype=torch.uint8, device=self.device)
                self._workspaces[stream] = t
            return t

    def chains(self, stream: int) -> PoolChains:
        """The pool chains of the stream's ordered programs (graph_cache.PoolChain)."""
        with self._lock:
            c = self._chains.get(stream)
            if c is None:
                c = self._chains[stream] = PoolChains(lambda: _new_pool())
            return c

    def capture_stream(self, stream: int):
        """The one stream the caller stream's chained graphs are captured on: a block a capture freed goes
        back to its pool tagged with the capture's stream, and only an allocation on that stream reuses it."""
        with self._lock:
            side = self._sides.get(stream)
            if side is None:
                side = self._sides[stream] = _side_stream(self.device)
            return side

    def get(self, stream: int) -> torch.Tensor:
        """The arena of the caller stream `stream` (its raw handle, as families are keyed)."""
        with self._lock:
            t = self._arenas.get(stream)
            if t is None:
                t = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                self._arenas[stream] = t
            return t


class _Graph:
    """One capture: the graph, the input addresses it reads (its key) and the outputs it writes; its
    program's order, where it was captured into a pool chain (graph_cache.PoolChains)."""
    __slots__ = ("graph", "key", "outputs", "last", "order")

    def __init__(self, graph, key: tuple, outputs: OutputSet, order: int | None = None):
        self.graph, self.key, self.outputs, self.last, self.order = graph, key, outputs, 0, order


class _Family:
    """The graphs of one program for one caller stream. They share the stream's arena, the static
    buffers of copied inputs and the seed: replays on one stream run in order."""

    def __init__(self, prog: GraphedProgram, stream: torch.cuda.Stream, stream_id: int):
        # weak: the program owns its families; a strong back-reference made each program a reference cycle
        # whose graphs, output sets and arena outlived the module until Python's cyclic GC ran (issue 12.2)
        self.prog = weakref.proxy(prog)
        self.stream = stream
        self.lock = threading.Lock()
        arenas = prog.arenas
        self.state = (prog.ex.state(arenas.get(stream_id), lambda n: arenas.workspace(stream_id, n))
                      if arenas is not None else prog.ex.state())
        self.chains = arenas.chains(stream_id) if prog.order is not None else None
        self.stream_id = stream_id
        # Static buffers of the copied inputs, allocated at the first call with that call's strides: an
        # input the archive reads in place with its own layout (channels-last, the manifest's stride)
        # must keep it; the guards hold every later call to the same layout.
        self.static: dict[int, torch.Tensor] = {}
        self.seed = torch.empty(1, dtype=torch.int64, device=prog.device) if prog.ex.program.rng else None
        self.cache = InstanceCache(prog.instances, self.chains.held_after if self.chains is not None else None)
        self.bound_ptrs: list | None = None
        self.warm: dict = {}  # donating keys that ran once without a graph (insertion-ordered, bounded)
        self.stats = collections.Counter(dict.fromkeys(STATS, 0))  # keys fixed: read while other threads count
        self.released = False

    def run(self, inputs: list[torch.Tensor], donate: bool = False) -> list:
        p = self.prog
        ptrs = [inputs[i].data_ptr() for i in p.bound_order]
        if ptrs != self.bound_ptrs:  # a parameter's tensor changed: graphs of the old ones go
            if self.cache.entries:
                self.stats["resets"] += 1
                self._drop(list(self.cache.entries))
            self.bound_ptrs = ptrs
        key = tuple(inputs[i].data_ptr() for i in p.keyed)
        if donate and p.ex.donor_need:
            key += ("donate",)  # its graphs write over the donated inputs: never replayed for a call that keeps them
            if key not in self.warm:
                # a donating key's first call runs without a graph: it sets lazy libraries up, so its capture
                # (at the key's next call) needs no warm-up run, which would spend the inputs the replay reads
                self.warm[key] = None
                while len(self.warm) > 4 * max(1, p.instances):
                    self.warm.pop(next(iter(self.warm)))
                self.stats["warmups"] += 1
                return p.ex.run(list(inputs), None, self.state, True)
        else:
            donate = False
        action, g = self.cache.choose(key)
        if action == "eager":
            self.stats["eager_calls"] += 1
            return p.ex.run(list(inputs), None, self.state, donate)
        if len(self.static) != len(p.copied):
            ins = p.ex.program.inputs
            self.static = {i: torch.empty_strided(inputs[i].shape, inputs[i].stride(), dtype=torch_dtype(ins[i].dtype),
                                                  device=p.device) for i in p.copied}
        dst = [self.static[i] for i in p.copied]
        src = [inputs[i] for i in p.copied]
        if self.seed is not None:
            dst.append(self.seed)
            src.append(new_seed(p.device))
        copy_all(dst, src)
        if action == "capture":
            if g is not None:
                self.stats["evictions"] += 1
                self._drop([g])
            g = self._capture(inputs, key, donate)
            self.cache.add(g)
        g.graph.replay()
        self.stats["replays"] += 1
        return g.outputs.hand_out()

    def _capture(self, inputs: list[torch.Tensor], key: tuple, donate: bool = False) -> _Graph:
        p = self.prog
        args = [self.static.get(i, x) for i, x in enumerate(inputs)]
        if self.chains is None:
            graph, outs = _record(p.ex, args, self.seed, self.state, self.stream, donate=donate)
            g = _Graph(graph, key, OutputSet(self._kept(outs), p.copy_bytes, p.alias_small))
        else:
            with self.chains.lock:  # members listed in the order they were captured into the pool
                chain = self.chains.open_for(p.order)
                graph, outs = _record(p.ex, args, self.seed, self.state, self.stream, chain.handle,
                                      p.arenas.capture_stream(self.stream_id), donate)
                g = _Graph(graph, key, OutputSet(self._kept(outs), p.copy_bytes, p.alias_small), p.order)
                self.chains.add(chain, g)
        self.stats["captures"] += 1
        return g

    def _kept(self, outs: list) -> list:
        for k in self.prog.passthrough:  # views of this call's inputs: never kept (they would pin the inputs)
            outs[k] = None
        return outs

    def _drop(self, graphs: list[_Graph]) -> None:
        self.stream.synchronize()  # the last replay may still run; its pool must outlive it
        for g in graphs:
            self.cache.remove(g)
            if self.chains is not None:
                self.chains.remove(g)

    def release(self) -> None:
        with self.lock:
            if self.cache.entries:
                self._drop(list(self.cache.entries))
            self.released = True
            self.state = None
            self.static = {}
