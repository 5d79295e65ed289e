"""aotfuse.load: an archive becomes a callable on a device.

Load: read the archive, check the device guards (a cubin for this arch), move the weights, load the
kernels. Call: check every input against its guard, run the program on the current stream; with
static shapes on CUDA, capture the program into a CUDA graph on the first call and replay it.

An archive with dynamic dims (manifest `dims`): the guards bind the dims from the input shapes and
check their ranges (runtime/dims.py), and each shape runs its own executor, linked from the program
specialized for it at the shape's first call, with its own CUDA graphs (runtime/shapes.py). Static
archives take the static path, unchanged: whether an archive has dims is decided once, at load.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from ..archive import Archive, read_archive
from ..errors import AotfuseError, GuardError
from ..knobs import knobs
from ..contract.manifest import same_layout
from .calling import flatten, rebuild
from .dims import bind_dims
from .executor import Executor
from .payload import read_payload, read_sources


class Artifact:
    """A loaded archive bound to one device. Call it like the model's forward."""

    def __init__(self, archive: Archive, device: str | torch.device = "cuda", cuda_graphs: bool | None = None):
        t0 = time.perf_counter()
        self.archive = archive
        payload = read_payload(archive)  # validated, then typed (aotfuse.contract)
        self.manifest = payload.manifest
        self.dims = self.manifest.dims  # dynamic dims (DimSpec per symbol); empty: a static archive
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise GuardError("device cuda requested but CUDA is not available", remedy="use device='cpu'")
        self.kernels = payload.kernels  # name -> KernelEntry
        self.programs = payload.programs  # name -> Program
        self.input_specs = self.manifest.inputs  # InputSpec per user input
        self.output_specs = self.manifest.outputs
        self._modules: list = []
        if self.device.type == "cuda":
            from .gpu import make_launchers

            launchers, self.arch, self._modules = make_launchers(self.kernels, self.device)
            self.launchers = launchers  # name -> launch(grid, stream, addresses)
        elif self.device.type == "cpu":
            from .interpret import make_launchers as interp_launchers

            launchers, self.arch = interp_launchers(self.kernels, read_sources(archive, self.kernels)), "interpreter"
            self.launchers = launchers  # name -> launch(grid, stream, tensors)
        else:
            raise GuardError(f"device {self.device} is not supported", remedy="use cuda or cpu")
        self.weights = {k: v.to(self.device, non_blocking=True) for k, v in archive.weights.items()}
        self.use_graphs = (knobs.cuda_graphs if cuda_graphs is None else cuda_graphs) and self.device.type == "cuda"
        self.graphs_asked = cuda_graphs  # None: decided per program set (runtime/graphs.graphs_pay)
        self._graphs: list = []  # every GraphedProgram made from this artifact (released by close())
        self.shapes: dict = {}  # dynamic dims: program -> ShapeCache (its executors per shape)
        if self.dims:
            self.executors = {}  # linked per shape, at a shape's first call
            self._link_shapes(launchers)
            self.check_inputs = self._check_inputs_dims  # the guards that bind the dims
            self._forward_graph = None
        else:
            self.executors = {name: Executor(p, self.weights, launchers, self.device)
                              for name, p in self.programs.items()}
            self._forward_graph = (self.graphed("forward") if self.use_graphs and self.manifest.train is None
                                   else None)
        self.load_seconds = time.perf_counter() - t0

    def _link_shapes(self, launchers) -> None:
        from .shapes import ShapeCache

        # inference: each shape's graphs are made here; a train archive's module makes its own (runtime/training.py)
        make_graph = self._shape_graph if self.use_graphs and self.manifest.train is None else None
        syms = tuple(d.sym for d in self.dims)
        self.shapes = {name: ShapeCache(name, p, self.kernels, self.weights, launchers, self.device, syms, make_graph)
                       for name, p in self.programs.items()}

    def _shape_graph(self, ex: Executor):
        """The CUDA graphs of one shape's executor (captured at that shape's first call)."""
        from .graphs import GraphedProgram

        return GraphedProgram(ex, self.device)

    # ---------------------------------------------------------------- guards
    def check_inputs(self, inputs: tuple) -> dict | None:
        """Every input against its guard (GuardError naming it). Returns the dims' values in an
        archive with dynamic dims (symbol -> size: `_check_inputs_dims`, set at load), else None."""
        if len(inputs) != len(self.input_specs):
            raise GuardError(f"expected {len(self.input_specs)} inputs "
                             f"({', '.join(s.name for s in self.input_specs)}), got {len(inputs)}")
        for i, (x, spec) in enumerate(zip(inputs, self.input_specs)):
            where = f"input {spec.name!r} (#{i})"
            if not isinstance(x, torch.Tensor):
                raise GuardError(f"{where}: expected a tensor, got {type(x).__name__}")
            if tuple(x.shape) != spec.shape:
                raise GuardError(f"{where}: expected shape {spec.shape}, got {tuple(x.shape)}",
                                 remedy="this archive was built for static shapes; rebuild for this shape")
            self._check_tensor(where, x, spec)
        return None

    def _check_inputs_dims(self, inputs: tuple) -> dict:
        """check_inputs of an archive with dynamic dims: shapes bind the dims (runtime/dims.py); the
        other guards as in a static archive. Returns the dims' values."""
        if len(inputs) != len(self.input_specs):
            raise GuardError(f"expected {len(self.input_specs)} inputs "
                             f"({', '.join(s.name for s in self.input_specs)}), got {len(inputs)}")
        for i, (x, spec) in enumerate(zip(inputs, self.input_specs)):
            if not isinstance(x, torch.Tensor):
                raise GuardError(f"input {spec.name!r} (#{i}): expected a tensor, got {type(x).__name__}")
        env = bind_dims(self.input_specs, self.dims, inputs)
        for i, (x, spec) in enumerate(zip(inputs, self.input_specs)):
            self._check_tensor(f"input {spec.name!r} (#{i})", x, spec)
        return env

    def _check_tensor(self, where: str, x: torch.Tensor, spec) -> None:
        """The guards of one input besides its shape: dtype, device, layout, alignment. (A spec with
        strides has a static shape: load refuses strides with dims.)"""
        if str(x.dtype) != spec.dtype:
            raise GuardError(f"{where}: expected dtype {spec.dtype}, got {x.dtype}")
        if x.device != self.device:
            raise GuardError(f"{where}: expected device {self.device}, got {x.device}",
                             remedy=f"move it with .to('{self.device}')")
        if spec.stride is not None:
            if not same_layout(spec.shape, x.stride(), spec.stride):
                raise _stride_error(where, spec, x)
        elif not x.is_contiguous():
            raise GuardError(f"{where}: expected a contiguous tensor, got strides {tuple(x.stride())}",
                             remedy="pass x.contiguous()")
        if x.numel() and x.data_ptr() % 16:
            raise GuardError(f"{where}: expected 16-byte aligned data, got address {x.data_ptr():#x}",
                             remedy="pass x.clone()")

    # ---------------------------------------------------------------- call
    def __call__(self, *args, **kwargs):
        """Call it as the model was called at build time: positional and keyword tensors; the result
        has the model's output structure (runtime/calling.py) where the archive records it."""
        call = self.manifest.call
        inputs = flatten(call, args, kwargs)
        env = self.check_inputs(inputs)
        with self.device_scope():
            if call is None or self.manifest.train is not None:
                return self._run("forward", inputs, env)
            return rebuild(call["outputs"], self._run_flat("forward", inputs, env))

    def run(self, program: str, *inputs):
        """One program on flat positional inputs (as the program takes them)."""
        env = self.check_inputs(inputs)
        with self.device_scope():
            return self._run(program, inputs, env)

    def device_scope(self):
        """The artifact's device made current for the call (kernels, externs, graph replay)."""
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def _run(self, program: str, inputs: tuple, env: dict | None = None):
        train = self.manifest.train
        if train is not None:  # forward of a train archive: parameters (and updated buffers, read from the
            # archive; their new values are dropped: as_module() keeps them) are program inputs; return the loss
            # (a fused step's program computes the gradients too: as_module() hands them to autograd)
            params = [self.weights[n] for n in train.state_inputs]
            if env is not None:
                return self.shapes[train.programs[0]].run(env, params + list(inputs))[0]
            return self.executors[train.programs[0]].run(params + list(inputs))[0]
        outs = self._run_flat(program, inputs, env)
        return outs[0] if self.manifest.single_output and len(outs) == 1 else tuple(outs)

    def _run_flat(self, program: str, inputs: tuple, env: dict | None = None) -> list:
        if env is not None:  # dynamic dims: the shape's executor (and graphs)
            return self.shapes[program].run(env, inputs)
        if program == "forward" and self._forward_graph is not None:
            return self._forward_graph(list(inputs))
        return self.executors[program].run(list(inputs))

    def as_module(self, cuda_graphs: bool | None = None):
        """An nn.Module whose forward/backward run the packaged programs (train archives).
        On CUDA the programs are captured into CUDA graphs unless cuda_graphs=False; left None (here and
        at load), graphs are skipped where copying a large batch into their static buffers would cost more
        than the launches they save (runtime/graphs.graphs_pay; the module's `graphs_why` says which)."""
        from .training import PackagedModule

        return PackagedModule(self, cuda_graphs)

    # ---------------------------------------------------------------- info
    def inspect(self) -> dict:
        from .inspect import describe

        return describe(self.archive)

    def graphed(self, program: str, bound: frozenset[int] = frozenset(), volatile: frozenset[int] = frozenset(),
                key: bool | None = None, arenas=None, order: int | None = None, alias_small=frozenset()):
        """A CUDA-graph runner of one program (runtime/graphs.py), owned by this artifact; `arenas`: an
        ArenaPool shared with other programs whose calls on a stream are ordered; `order`: the program's
        place among them when their graphs share memory pools (a staged backward's stages)."""
        if self.dims:
            raise AotfuseError(f"program {program!r} has dynamic dims: its graphs are made per shape",
                               remedy="call the artifact; shape_stats() reports each shape's graphs")
        return self.graph_of(self.executors[program], bound, volatile, key, arenas, order, alias_small)

    def graph_of(self, executor, bound: frozenset[int] = frozenset(), volatile: frozenset[int] = frozenset(),
                 key: bool | None = None, arenas=None, order: int | None = None, alias_small=frozenset()):
        """graphed() of any executor of this artifact (a shape's, with dynamic dims)."""
        from .graphs import GraphedProgram

        g = GraphedProgram(executor, self.device, bound, volatile, key, arenas, order, alias_small)
        self._graphs.append(g)
        return g

    def drop_graphs(self, graphs) -> None:
        """Release graphs made by graph_of (after their streams drained) and forget them."""
        graphs = list(graphs)
        for g in graphs:
            g.release()
        self._graphs = [g for g in self._graphs if all(g is not d for d in graphs)]

    def shape_stats(self) -> dict:
        """Dynamic dims: per program, the shapes linked and cached (each with its dims, calls, link
        time and CUDA-graph captures and replays) and the totals (runtime/shapes.py). Static: {}."""
        return {name: cache.stats() for name, cache in self.shapes.items()}

    def close(self):
        """Drop the CUDA graphs (after their streams drained), then unload the kernels."""
        for g in self._graphs:
            g.release()
        self._graphs = []
        for cache in self.shapes.values():
            cache.release()
        self._forward_graph = None
        for m in self._modules:
            m.close()
        self._modules = []


def _stride_error(where: str, spec, x: torch.Tensor) -> GuardError:
    """An input laid out otherwise than the build's example (channels-last images, most often)."""
    cl = spec.stride == tuple(torch.empty(spec.shape, device="meta").contiguous(
        memory_format=torch.channels_last).stride()) if len(spec.shape) == 4 else False
    return GuardError(f"{where}: expected strides {spec.stride} (the layout of the build's example), "
                      f"got {tuple(x.stride())}",
                      remedy="pass x.contiguous(memory_format=torch.channels_last)" if cl else
                      "pass a tensor laid out as the example was (or rebuild with a contiguous one)")


def load(src: Any, device: str | torch.device = "cuda", *, cuda_graphs: bool | None = None,
         verify: bool = True, sha256: str | None = None) -> Artifact:
    """Load an .aotf archive (path or bytes) onto a device ('cuda', 'cuda:1' or 'cpu').

    An archive is code (cubins run on the GPU; on the CPU the stored Triton source runs in the
    interpreter): load only archives you trust. sha256 pins the exact file: the hex SHA-256 that
    `aotfuse inspect` prints; the bytes are hashed before anything in them is parsed, and any other
    file is refused with ArchiveError. See "Trust model" in artifacts/FORMAT.md.
    """
    return Artifact(read_archive(src, verify=verify, sha256=sha256), device, cuda_graphs)
