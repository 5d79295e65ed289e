"""Runs a program, linked once: buffer names resolved to slots, weights and arena views bound ahead.

Linking (at load, `Executor.__init__`) turns the instruction list into steps over integer slots.
Binding (`Executor.state()`, once per caller stream, or once per CUDA-graph instance) allocates the
arena and fills every slot whose tensor never changes: weights and arena views, with their device
addresses. A call then only fills the slots that do change (inputs, the seed, buffers allocated per
call, extern results) and walks the steps. Outputs never live in the shared arena: their buffers are
allocated per call, so a result stays valid after the next call.

The same executor serves the GPU (kernels launched through the CUDA driver, by address) and the CPU
(kernels run by Triton's interpreter, on tensors); only the launchers differ.

An executor runs static programs only: an archive with dynamic dims links one per shape, on the
program specialized for it (runtime/shapes.py). A launch's `sizes` (int32 scalars after the
buffers) are then constants of the linked step: `_Sized` appends them, and on the GPU a launch
whose buffers never change packs them once with its addresses.
"""
from __future__ import annotations

import collections
import threading
import weakref
from typing import Callable

import torch

from ..contract.program import DIMS_VERSION, Alloc, Extern, Free, Launch, Program, Return, TensorRef, program_dims
from ..dtypes import TORCH
from ..errors import ArchiveError
from ..knobs import knobs
from . import cublaslt
from .externs import resolve

DTYPES = TORCH  # program dtype names (aotfuse/dtypes.py); validate.py reads it from here too


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ArchiveError(f"program names unknown dtype {name!r}") from None


def new_seed(device) -> torch.Tensor:
    """A Philox seed for one call, drawn from torch's default generator (so torch.manual_seed applies)."""
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64).to(device, non_blocking=True)


def current_stream(index: int) -> int:
    """The raw handle of the current CUDA stream of device `index` (what cuLaunchKernel takes)."""
    return _RAW_STREAM(index) if _RAW_STREAM is not None else torch.cuda.current_stream(index).cuda_stream


# torch's binding for the raw current stream (used by its own generated wrappers); about 20x
# cheaper than torch.cuda.current_stream(...).cuda_stream, which builds a Stream object.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _contig_strides(shape):
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


class _View:
    """A strided view of a slot's tensor, as an extern argument or an output."""
    __slots__ = ("slot", "shape", "stride", "offset")

    def __init__(self, slot: int, a: TensorRef):
        self.slot, self.shape, self.stride, self.offset = slot, a.shape, a.stride, a.offset

    def of(self, env: list) -> torch.Tensor:
        base = env[self.slot]
        return base.as_strided(self.shape, self.stride, base.storage_offset() + self.offset)


def _flat(xs):
    for x in xs:
        if isinstance(x, list):
            yield from _flat(x)
        else:
            yield x


def _prepared(step: tuple, addr: list, per_call: set, after_launch: bool = True) -> tuple:
    """A GPU launch step with a parameter buffer of its own, filled once when none of its arguments
    changes per call (weights and arena views only); other steps (and CPU launches) as they are.
    after_launch: the step before it that does GPU work is a kernel launch (else, a kernel launched with
    PDL only after kernels launches plainly here: PreparedLaunch.after_extern)."""
    if step[0] == "launch" and hasattr(step[1], "prepare"):
        _, launch, grid, slots = step
        prepared = launch.prepare(grid)
        if not after_launch:
            site = getattr(prepared, "prepared", prepared)  # a sized launch's site
            if hasattr(site, "after_extern"):
                site.after_extern()
        if any(s in per_call for s in slots):
            return ("prepared", prepared.launch, slots)
        prepared.fill([addr[s] for s in slots])
        return ("fixed", prepared.launch_filled)
    return step


class _Sized:
    """A launcher of a kernel that takes int32 sizes after its buffers (Launch.sizes, fixed for a
    specialized program): called like the launcher it wraps, with the buffers only."""
    __slots__ = ("inner", "sizes")

    def __init__(self, inner: Callable, sizes: list[int]):
        self.inner, self.sizes = inner, sizes

    def __call__(self, grid, stream, args):
        self.inner(grid, stream, list(args) + self.sizes)


class _SizedGPU(_Sized):
    """... and on the GPU, its prepared launch sites take the sizes with the addresses."""
    __slots__ = ()

    def prepare(self, grid):
        return _SizedPrepared(self.inner.prepare(grid), self.sizes)


class _SizedPrepared:
    __slots__ = ("prepared", "sizes", "launch_filled")

    def __init__(self, prepared, sizes: list[int]):
        self.prepared, self.sizes = prepared, sizes
        self.launch_filled = prepared.launch_filled

    def launch(self, stream: int, args) -> None:
        self.prepared.launch(stream, args + self.sizes)

    def fill(self, args) -> None:
        self.prepared.fill(list(args) + self.sizes)


def _sized(launch: Callable, sizes: tuple) -> Callable:
    return (_SizedGPU if hasattr(launch, "prepare") else _Sized)(launch, [int(v) for v in sizes])


class State:
    """What one caller (a stream, or a CUDA-graph instance) runs on: the arena and the slots.
    Calls on one state are serialized by its lock."""

    def __init__(self, ex: "Executor", arena: torch.Tensor | None = None,
                 workspace: Callable[[int], torch.Tensor] | None = None):
        """arena: a uint8 buffer of at least the program's arena bytes to run in (shared by programs
        whose calls are ordered, e.g. a training step's forward and backward on one stream); else its own.
        workspace: gives a uint8 buffer of at least n bytes for the cuBLASLt matmuls (shared by the same
        programs: a workspace is scratch within one call); else the state allocates its own."""
        self.lock = threading.Lock()
        self._workspace = workspace
        self._old_workspaces: list[torch.Tensor] = []  # re-bound states: graphs may still replay on them
        if arena is None:
            arena = torch.empty(ex.program.arena_bytes, dtype=torch.uint8, device=ex.device)
        elif arena.dtype != torch.uint8 or arena.numel() < ex.program.arena_bytes or arena.device != ex.device:
            raise ArchiveError(f"a shared arena of {arena.numel()} B ({arena.dtype}, {arena.device}) cannot hold "
                               f"this program's {ex.program.arena_bytes} B on {ex.device}")
        self.arena = arena
        self.env: list = [None] * ex.n_slots
        self.addr: list[int] = [0] * ex.n_slots
        for slot, t in ex.weight_slots:
            self._set(slot, t)
        for slot, off, shape, dt, nbytes in ex.arena_allocs:
            self._set(slot, self.arena[off:off + nbytes].view(dt).view(shape))
        # Extern arguments that view weights or the arena are the same tensors on every call: made
        # once here. Only views of per-call buffers (inputs, extern results, outputs) stay _View.
        # GPU launches get a parameter buffer of their own (this state's calls are serialized).
        self.externs: list = [None] * ex.n_externs
        self._base_steps = []
        after_launch = False  # what ran before the program (the caller's work) is not one of its kernels
        for step in ex.steps:
            self._base_steps.append(_prepared(step, self.addr, ex.per_call, after_launch))
            if step[0] in ("launch", "extern"):  # allocations and frees enqueue no GPU work
                after_launch = step[0] == "launch"
        self.steps = self._base_steps
        for step in ex.steps:
            if step[0] == "extern":
                _, i, _fn, args, kwargs, _ov_flag, ov, *_ = step
                args = [self._fix(a, ex.per_call) for a in args]
                kwargs = {k: self._fix(v, ex.per_call) for k, v in kwargs.items()}
                out = self._fix(ov, ex.per_call)
                # per call, only views of per-call buffers are made (an op that allocates its result
                # has no out argument: its view is applied to the result when it is bound)
                dynamic = any(isinstance(a, _View) for a in _flat([args, list(kwargs.values()),
                                                                    [out] if step[5] else []]))
                self.externs[i] = (args, kwargs, out, dynamic)
        # Matmul externs as prepared cuBLASLt calls (runtime/cublaslt.py), for torch's current settings.
        self.matmul_policy: tuple | None = None
        self.matmul_records: dict[int, dict] = {}
        self._matmuls: dict[int, cublaslt.LtMatmul] = {}
        self._lt_handle = None
        self.lt_workspace: torch.Tensor | None = None
        if ex.matmuls:
            self.bind_matmuls(ex, cublaslt.policy_key())
        ex._last_state = weakref.ref(self)

    def bind_matmuls(self, ex: "Executor", key: tuple) -> None:
        """(Re)make the cuBLASLt matmuls of this state for torch's matmul settings `key`; externs that
        cannot take that path keep torch's binding, with the reason in matmul_records."""
        self.matmul_policy = key
        plans: dict[int, cublaslt.LtMatmul] = {}
        records: dict[int, dict] = {}
        lib = None
        why_not = None
        if ex.device.type != "cuda":
            why_not = "CPU: torch's binding"
        elif not knobs.cublaslt:
            why_not = "AOTFUSE_CUBLASLT=0"
        else:
            try:
                lib = cublaslt.library()
            except cublaslt.Unsupported as e:
                why_not = str(e)
        if lib is not None and self._lt_handle is None and any(not isinstance(v, str) for v in ex.matmuls.values()):
            index = ex.device.index or 0
            self._lt_handle = lib.take_handle(index)
            weakref.finalize(self, lib.give_handle, index, self._lt_handle)
        static = {slot: a for slot, a in enumerate(self.addr) if slot not in ex.per_call}
        policy = cublaslt.Policy(*key)
        for i, spec in ex.matmuls.items():
            target = ex.extern_targets[i]
            if isinstance(spec, str) or why_not is not None:
                records[i] = {"target": target, "path": "torch", "why": why_not or spec}
                continue
            try:
                plans[i] = cublaslt.LtMatmul(lib, self._lt_handle, spec, policy, static, knobs.cublaslt_workspace)
            except cublaslt.Unsupported as e:
                records[i] = {"target": target, "path": "torch", "why": str(e), "matmul": spec.describe()}
        need = max((p.workspace_needed for p in plans.values()), default=0)
        # one workspace for the state's matmuls (they run in order on the state's stream), owned by the state
        # or shared with the programs of its arena
        if self.lt_workspace is not None:
            self._old_workspaces.append(self.lt_workspace)
        if not need:
            self.lt_workspace = None
        elif self._workspace is not None:
            self.lt_workspace = self._workspace(need)
        else:
            self.lt_workspace = torch.empty(need, dtype=torch.uint8, device=ex.device)
        for p in plans.values():
            p.use_workspace(self.lt_workspace.data_ptr() if need else 0, need)
        self._matmuls = plans
        self.matmul_records = records
        if why_not is not None:
            self.matmul_policy = None  # nothing to re-bind when torch's settings change: no per-call check
        self.steps = [("lt", plans[st[1]].run, st) if st[0] == "extern" and st[1] in plans else st
                      for st in self._base_steps]

    def matmul_report(self) -> list[dict]:
        """Per matmul extern, in program order: the path it takes (cublaslt or torch) and why."""
        out = []
        for i in sorted(set(self.matmul_records) | set(self._matmuls)):
            rec = self._matmuls[i].record() if i in self._matmuls else dict(self.matmul_records[i])
            out.append({"extern": i, **rec})
        return out

    def _fix(self, a, per_call: set):
        if isinstance(a, _View):
            return a if a.slot in per_call else a.of(self.env)
        if isinstance(a, list):
            return [self._fix(x, per_call) for x in a]
        return a

    def _set(self, slot: int, t: torch.Tensor) -> None:
        self.env[slot] = t
        self.addr[slot] = t.data_ptr()


class Executor:
    """Linked once per (program, device); its states hold the per-caller memory."""

    def __init__(self, program: Program, weights: dict[str, torch.Tensor], launchers: dict[str, Callable],
                 device: torch.device):
        if program.version >= DIMS_VERSION and program_dims(program):
            raise ArchiveError(f"program has size expressions over {', '.join(sorted(program_dims(program)))}",
                               remedy="link it specialized for one shape (aotfuse.contract.specialize)")
        self.program = program
        self.device = device
        self._slots: dict[str, int] = {}
        self.input_slots = [self._slot(i.buf) for i in program.inputs]
        self.rng_slot = self._slot(program.rng) if program.rng else None
        self.weight_slots = [(self._slot(buf), weights[fqn]) for buf, fqn in program.weights.items()]
        # the weights' storages (fixed for the executor): a donated input sharing one keeps its values (_donatable)
        self._weight_storages = [t.untyped_storage().data_ptr() for _, t in self.weight_slots if t.numel()]
        # the dtype of each slot's buffer, where the program says it (matmul externs read their operands')
        self.slot_dtypes: dict[int, torch.dtype] = {s: torch_dtype(i.dtype) for s, i in
                                                    zip(self.input_slots, program.inputs) if i.dtype in DTYPES}
        self.slot_dtypes.update((s, t.dtype) for s, t in self.weight_slots)
        self.matmuls: dict[int, cublaslt.MatmulSpec | str] = {}  # extern index -> spec, or why torch's binding
        self.extern_targets: list[str] = []
        self._last_state = None
        instructions = program.instructions
        # outputs (and the buffers they view) are allocated per call, never in the shared arena
        self._per_call_bufs = {o.t for o in program.returned}
        self.arena_allocs: list[tuple] = []
        self.donor_need: dict[int, int] = {}  # donated input slot -> bytes of it the program's allocs reach
        self.n_externs = 0
        self.per_call: set[int] = set(self.input_slots) | ({self.rng_slot} if self.rng_slot is not None else set())
        self.steps = [s for s in (self._link(ins, launchers) for ins in instructions) if s is not None]
        if not self.steps or self.steps[-1][0] != "return":
            raise ArchiveError("program does not end with a return instruction")
        self.n_slots = len(self._slots)
        self._per_call_list = sorted(self.per_call)
        # a free releases only per-call tensors (arena views and weights stay bound): drop the others
        steps = []
        for st in self.steps:
            if st[0] == "free":
                st = ("free", tuple(s for s in st[1] if s in self.per_call))
                if not st[1]:
                    continue
            steps.append(st)
        self.steps = steps
        self._states: collections.OrderedDict = collections.OrderedDict()
        self._states_lock = threading.Lock()

    def _slot(self, name: str) -> int:
        return self._slots.setdefault(name, len(self._slots))

    # ---------------------------------------------------------------- link
    def _link(self, ins, launchers):
        if isinstance(ins, Alloc):
            dt = torch_dtype(ins.dtype)
            slot = self._slot(ins.buf)
            self.slot_dtypes[slot] = dt
            if ins.host is not None:  # in another buffer's bytes (schedule/hosts.py)
                host = self._slots.get(ins.host)
                if host is None:
                    raise ArchiveError(f"alloc {ins.buf!r} lies in {ins.host!r}, which is not defined before it")
                self.per_call.add(slot)
                n = dt.itemsize
                for d in ins.shape:
                    n *= d
                if host in self.input_slots:  # a donated input: its bytes only when the call donates it
                    self.donor_need[host] = max(self.donor_need.get(host, 0), ins.offset + n)
                    return ("donor", slot, host, ins.offset, n, ins.shape, dt)
                return ("hosted", slot, host, ins.offset, n, ins.shape, dt)  # an output not yet written
            if ins.offset < 0 or ins.buf in self._per_call_bufs:
                self.per_call.add(slot)
                return ("new", slot, ins.shape, dt)
            n = 1
            for d in ins.shape:
                n *= d
            self.arena_allocs.append((slot, ins.offset, ins.shape, dt, n * dt.itemsize))
            return None  # bound once per state
        if isinstance(ins, Launch):
            launch = launchers.get(ins.kernel)
            if launch is None:
                raise ArchiveError(f"program launches kernel {ins.kernel!r} that the archive does not contain")
            if ins.sizes:
                launch = _sized(launch, ins.sizes)
            return ("launch", launch, ins.grid, tuple(self._slot(b) for b in ins.args))
        if isinstance(ins, Extern):
            out = self._slot(ins.out)
            if not ins.out_variant:
                self.per_call.add(out)  # the op allocates its result
            # a multi-output op's further results: (slot, view, shape, dtype, contiguous strides) each
            more = tuple((self._slot(o.out), _View(self._slot(o.out), o.out_view), o.shape, torch_dtype(o.dtype),
                          _contig_strides(o.shape)) for o in ins.outs)
            self.per_call.update(m[0] for m in more)
            self.slot_dtypes.setdefault(out, torch_dtype(ins.dtype))
            for m in more:
                self.slot_dtypes.setdefault(m[0], m[3])
            self.n_externs += 1
            index = self.n_externs - 1
            self.extern_targets.append(ins.target)
            step = ("extern", index, resolve(ins.target), self._arg(ins.args),
                    {k: self._arg(v) for k, v in ins.kwargs.items()}, ins.out_variant,
                    _View(out, ins.out_view), out, ins.shape, torch_dtype(ins.dtype), _contig_strides(ins.shape),
                    more)
            if ins.target in cublaslt.TARGETS:
                try:
                    if not ins.out_variant:
                        raise cublaslt.Unsupported("not an .out call")
                    self.matmuls[index] = cublaslt.derive(ins.target, step[3], step[4], step[6], self.slot_dtypes)
                except cublaslt.Unsupported as e:
                    self.matmuls[index] = str(e)
            return step
        if isinstance(ins, Free):
            return ("free", tuple(s for s in (self._slots.get(b) for b in ins.bufs) if s is not None))
        if isinstance(ins, Return):
            return ("return", [_View(self._slot(o.t), o) for o in ins.outputs])
        raise ArchiveError(f"unknown program instruction {type(ins).__name__}")

    def _arg(self, a):
        """A program argument as the executor binds it: views -> _View, sequences -> lists (as torch takes them)."""
        if isinstance(a, TensorRef):
            return _View(self._slot(a.t), a)
        if isinstance(a, tuple):
            return [self._arg(x) for x in a]
        return a

    # ---------------------------------------------------------------- bind
    def state(self, arena: torch.Tensor | None = None, workspace: Callable[[int], torch.Tensor] | None = None) -> State:
        """A fresh state (a CUDA-graph family owns one), on its own arena and matmul workspace or on
        shared ones (`arena`; `workspace(n)` gives a buffer of at least n bytes)."""
        return State(self, arena, workspace)

    def matmul_report(self, state: State | None = None) -> list[dict]:
        """Per matmul extern: the path its calls take (cublaslt, with the algorithm's workspace and
        alignments, or torch's binding and why), as bound in `state` (default: the last state made)."""
        st = state or (self._last_state() if self._last_state is not None else None)
        if st is not None:
            return st.matmul_report()
        out = []
        for i, v in sorted(self.matmuls.items()):
            rec = {"extern": i, "target": self.extern_targets[i]}
            if isinstance(v, str) or self.device.type != "cuda":
                rec.update(path="torch", why=v if isinstance(v, str) else "CPU: torch's binding")
            else:
                rec.update(path="cublaslt", matmul=v.describe(), bound=False)
            out.append(rec)
        return out

    def _state_for_caller(self, key) -> State:
        with self._states_lock:
            st = self._states.get(key)
            if st is None:
                st = self._states[key] = State(self)
                while len(self._states) > max(1, knobs.graph_streams):
                    self._states.popitem(last=False)  # its arena was allocated on its stream: freed in order
            else:
                self._states.move_to_end(key)
            return st

    # ---------------------------------------------------------------- run
    def run(self, inputs: list[torch.Tensor], seed: torch.Tensor | None = None,
            state: State | None = None, donate: bool = False) -> list[torch.Tensor]:
        """donate: the caller hands over the inputs the program's donated allocs lie in (a training backward's
        saved tensors that autograd frees after it): once the program has read such an input for the last
        time it writes other buffers over it. Each donated input must be a row-major tensor, 16-byte
        aligned, large enough, and share its storage with no other input nor weight; one that is not keeps
        its values (its allocs get memory of their own). False: every such alloc gets memory of its own."""
        stream = current_stream(self.device.index) if self.device.type == "cuda" else 0
        st = state or self._state_for_caller(stream)
        with st.lock:
            if st.matmul_policy is not None:
                key = cublaslt.policy_key()
                if key != st.matmul_policy:  # torch's matmul settings changed since the state was bound
                    st.bind_matmuls(self, key)
            try:
                return self._run(st, inputs, seed, stream, donate)
            finally:
                env = st.env
                for s in self._per_call_list:  # drop this call's tensors; the outputs are the caller's
                    env[s] = None

    def _run(self, st: State, inputs, seed, stream: int, donate: bool = False) -> list[torch.Tensor]:
        env, addr, dev = st.env, st.addr, self.device
        by_addr = dev.type == "cuda"  # GPU launchers take (grid, stream, addresses); the interpreter's tensors
        for s, t in zip(self.input_slots, inputs):
            env[s] = t
            addr[s] = t.data_ptr()
        donated = self._donatable(env) if donate and self.donor_need else ()
        if self.rng_slot is not None:
            t = seed if seed is not None else new_seed(dev)
            env[self.rng_slot] = t
            addr[self.rng_slot] = t.data_ptr()
        for step in st.steps:
            kind = step[0]
            if kind == "fixed":
                step[1](stream)
            elif kind == "lt":
                if not step[1](stream, addr):  # a per-call operand misaligned for the algorithm: torch's binding
                    self._extern(st, step[2], env, addr)
            elif kind == "prepared":
                step[1](stream, [addr[s] for s in step[2]])
            elif kind == "launch":
                _, launch, grid, slots = step
                launch(grid, stream, [addr[s] for s in slots] if by_addr else [env[s] for s in slots])
            elif kind == "new":
                _, slot, shape, dt = step
                t = torch.empty(shape, dtype=dt, device=dev)
                env[slot] = t
                addr[slot] = t.data_ptr()
            elif kind == "extern":
                self._extern(st, step, env, addr)
            elif kind == "donor" or kind == "hosted":
                _, slot, host, off, n, shape, dt = step
                if kind == "hosted" or host in donated:
                    t = env[host].view(-1).view(torch.uint8)[off:off + n].view(dt).view(shape)
                else:
                    t = torch.empty(shape, dtype=dt, device=dev)
                env[slot] = t
                addr[slot] = t.data_ptr()
            elif kind == "free":
                for s in step[1]:
                    env[s] = None
            else:
                return [v.of(env) for v in step[1]]
        raise ArchiveError("program has no return instruction")

    def _donatable(self, env: list) -> set[int]:
        """The donated input slots whose tensors this call may write over (see run)."""
        owners: dict[int, int] = {}
        for s in self.input_slots:
            t = env[s]
            if t.numel():
                p = t.untyped_storage().data_ptr()
                owners[p] = owners.get(p, 0) + 1
        for p in self._weight_storages:
            owners[p] = owners.get(p, 0) + 1
        ok = set()
        for s, need in self.donor_need.items():
            t = env[s]
            if (t.numel() and t.is_contiguous() and t.data_ptr() % 16 == 0 and t.numel() * t.element_size() >= need
                    and owners[t.untyped_storage().data_ptr()] == 1):
                ok.add(s)
        return ok

    @staticmethod
    def _decode(a, env):
        if isinstance(a, _View):
            return a.of(env)
        if isinstance(a, list):
            return [Executor._decode(x, env) for x in a]
        return a

    def _extern(self, st: State, step, env, addr) -> None:
        _, i, fn, _a, _k, out_variant, ov, out, shape, dtype, contig, more = step
        args, kwargs, outv, dynamic = st.externs[i]
        if dynamic:
            args = [self._decode(a, env) for a in args]
            kwargs = {k: self._decode(v, env) for k, v in kwargs.items()}
            if out_variant:  # a non-out op's view is of its own result, bound below
                outv = self._decode(outv, env)
        if out_variant:
            fn(*args, **kwargs, out=outv)
            return
        result = fn(*args, **kwargs)
        if isinstance(result, (tuple, list)) or more:  # results: the first binds `out`, the others their own
            if isinstance(result, (tuple, list)) and any(r is None for r in result):
                result = [r for r in result if r is not None]  # outputs its output_mask did not ask for
            if not isinstance(result, (tuple, list)) or len(result) != len(more) + 1:
                raise ArchiveError(f"extern returned {type(result).__name__}, the program expects {len(more) + 1} "
                                   "results")
            for r, (slot, rv, rshape, rdt, rcontig) in zip(result[1:], more):
                self._bind(env, addr, r, rv, slot, rshape, rdt, rcontig)
            result = result[0]
        self._bind(env, addr, result, ov, out, shape, dtype, contig)

    @staticmethod
    def _bind(env, addr, result, ov, out, shape, dtype, contig) -> None:
        """An op's result as buffer `out`: bound as it is when it has the planned layout, else copied."""
        t = None
        if result.stride() == ov.stride:
            # The op wrote the layout we planned for (e.g. flash attention's [B, T, H, D]): bind it.
            base_off = result.storage_offset() - ov.offset
            if base_off >= 0:
                t = result.as_strided(shape, contig, base_off)
        if t is None:
            t = torch.empty(shape, dtype=dtype, device=result.device)
            t.as_strided(ov.shape, ov.stride, ov.offset).copy_(result)
        env[out] = t
        addr[out] = t.data_ptr()
