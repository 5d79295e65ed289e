"""as_module(): a train archive as an nn.Module whose forward and backward run packaged programs.

The module's parameters are the archive's weights (on the artifact's device). forward(*inputs) runs
the forward program (loss + saved tensors) inside a torch.autograd.Function; backward runs the
backward program on the saved tensors and the incoming gradient and hands gradients to autograd,
so `.grad` fills and any torch.optim optimizer works. Each forward keeps its own saved tensors,
so several forwards may be live before their backwards; they are freed once the backward ran.
Buffers the forward updates (train-mode BatchNorm) are the module's buffers (runtime/train_state.py):
passed to the forward program after the parameters and written back in place after it ran.

A fused-step archive (TrainInfo.mode "step", partition/step.py) has one program that returns the loss
and the gradients for a loss gradient of 1: the forward runs it and keeps the gradients (nothing else);
the backward multiplies them in place by the loss gradient autograd passes (emit/scale.py: no work
when it is 1) and hands them over, once: a second backward through the same forward is refused.
"""
from __future__ import annotations

import collections
import weakref

import torch
import torch.nn as nn

from ..contract.manifest import dense_strides, same_layout
from ..dtypes import TORCH
from ..errors import AotfuseError, ArchiveError, GuardError
from ..knobs import knobs
from .calling import flatten, loss_tree, rebuild
from .train_state import UpdatedBuffers, original_state_dict_names


def _run_first(ctx, module, progs, program: str, args) -> tuple:
    """Run the forward (or fused step) program on (parameters, updated buffers, inputs), write the buffer
    updates back, and return (loss, the outputs after the buffer updates)."""
    n_p = len(module._param_list)
    n_m = len(module._bufs.names)
    outs = module._run(progs, program, list(args[:n_p]) + module._bufs.tensors() + list(args[n_p:]))
    module._bufs.write_back(outs[1:1 + n_m])  # after the program read them: as eager updates in place
    ctx.module, ctx.progs = module, progs
    ctx.n_inputs = len(args) - n_p
    return outs[0], outs[1 + n_m:]


def _handed_out(loss):
    return loss.clone() if loss._base is not None else loss


class _Packaged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, progs, *args):
        loss, saved = _run_first(ctx, module, progs, "forward", args)
        for i, t in enumerate(saved):
            if not t.is_contiguous():  # the backward program reads each saved tensor as a row-major buffer
                raise ArchiveError(f"saved tensor #{i} of the forward program is not row-major (strides "
                                   f"{tuple(t.stride())}): this archive was built by an aotfuse with a known bug",
                                   remedy="rebuild the archive with this aotfuse")
        ctx.save_for_backward(*saved)
        return _handed_out(loss)

    @staticmethod
    def backward(ctx, grad_loss):
        module = ctx.module
        saved = ctx.saved_tensors
        tangent = grad_loss.reshape(()).to(module._loss_dtype).contiguous()
        grads = module._run(ctx.progs, "backward", list(saved) + [tangent], donate=_frees_saved())
        return (None, *_by_owner(module, ctx, _unshared(grads)))


def _frees_saved() -> bool:
    """Whether autograd frees this node's saved tensors after its backward (no retain_graph, no
    create_graph): only then may the backward program write over the ones it has read (Alloc.host)."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keep is not None and not keep()


def _by_owner(module, ctx, grads) -> tuple:
    n_p = len(module._param_list)
    out_param = [None] * n_p
    out_input = [None] * ctx.n_inputs
    for (kind, ref), g in zip(module._grad_map, grads):
        if kind == "param":
            out_param[module._param_index[ref]] = g
        else:
            out_input[int(ref)] = g
    return (None, *out_param, *out_input)


def _unshared(grads: list, keep: int | None = None) -> list:
    """A program may return one buffer for two gradients (equal values): each owner gets its own tensor,
    so an in-place change to one `.grad` (clipping, scaling, DDP's averaging) never reaches another.
    keep: outputs from this index on (a stage's carries, which the next stage only reads) keep their
    buffers, shared or not, and a gradient sharing one is the copy: the next stage's CUDA graph reads the carries at the addresses the previous graph wrote them
    (keyed by address), so a carry copied on every call would make it capture again for each new address
    (2 x H100, anchor GPT, 4 stages: backward_2 and backward_3 held two graph instances each)."""
    seen = set()
    if keep is not None:
        for g in grads[keep:]:
            if g.numel():
                seen.add((g.untyped_storage().data_ptr(), g.storage_offset()))
    out = []
    for i, g in enumerate(grads):
        key = (g.untyped_storage().data_ptr(), g.storage_offset()) if g.numel() else None
        if keep is not None and i >= keep:
            out.append(g)  # a carry: as the program wrote it (seen above)
            continue
        if key is not None and key in seen:
            g = g.clone()
        elif key is not None:
            seen.add(key)
        out.append(g)
    return out  # carries may share a buffer with each other: the next stage only reads them


class _Run:
    """One forward of a staged backward: what its stages share (the forward node's context, whose saved
    tensors every stage reads; carried values; the input gradients the last stage hands over)."""
    __slots__ = ("module", "progs", "ctx", "aliased", "carry", "input_grads", "next")

    def __init__(self, module, progs):
        self.module, self.progs = module, progs
        self.ctx, self.aliased, self.carry, self.input_grads, self.next = None, (), [], {}, 0

    def saved(self, ctx) -> list:
        """The saved tensors: those on the context, with the parameters (and views of them) put back."""
        on_ctx = iter(ctx.saved_tensors)  # torch's own error for a second backward without retain_graph=True
        return [next(on_ctx) if t is None else t for t in self.aliased]

    def stage(self, k: int, grad_loss) -> list:
        """Run backward stage k; returns its gradients (in the stage's order)."""
        module = self.module
        name, idx = module._stages[k]
        ctx = self.ctx() if self.ctx is not None else None
        if ctx is None:
            raise AotfuseError("a backward through a staged forward whose graph was freed",
                               remedy="run the forward again for each backward")
        saved = self.saved(ctx)
        if k == 0:  # a new backward: a partial one before (autograd.grad of early stages) or one that raised
            self.next, self.carry = 0, []
        elif k != self.next:
            raise AotfuseError(f"backward stage {k} of a staged backward ran before stage {self.next}: the "
                               "stages run in order, within one backward call",
                               remedy="call backward (or autograd.grad) on the loss the packaged module returned")
        tangent = grad_loss.reshape(()).to(module._loss_dtype).contiguous()
        n = len(idx)
        outs = _unshared(list(module._run(self.progs, name, list(saved) + [tangent] + self.carry)), keep=n)
        self.carry = list(outs[n:])
        self.next = (k + 1) % len(module._stages)
        grads = outs[:n]
        for i, g in zip(idx, grads):
            kind, ref = module._grad_map[i]
            if kind == "input":
                self.input_grads[int(ref)] = g
        if self.next == 0:  # the last stage ran: the graph's nodes may outlive this backward
            self.carry = []
        return [g for i, g in zip(idx, grads) if module._grad_map[i][0] == "param"]


class _StagedForward(torch.autograd.Function):
    """The forward program of a staged backward; its backward is the LAST stage (it runs last). It takes as
    autograd inputs only the last stage's parameters (and the user inputs): a parameter that were an input
    of two nodes would get its gradient hook only after both ran, at the end of the backward. The saved
    tensors are saved on its context (freed with the graph; saved-tensor hooks see them; a second backward
    without retain_graph is torch's error), but for parameters; the stages reach them through the run's
    weak reference."""

    @staticmethod
    def forward(ctx, module, run, n_last, *args):
        params = list(module._param_list)
        loss, saved = _run_first(ctx, module, run.progs, "forward", (*params, *args[n_last:]))
        ctx.n_inputs = len(args) - n_last
        # a parameter the forward returns as a saved tensor (or a view of it) is held as it is, not saved on the
        # context: an optimizer step in a gradient hook changes it in place once no later stage reads it
        # (partition/stages.py), and the context's version check would refuse it at the next stage
        params = {p.untyped_storage().data_ptr() for p in module._param_list if p.numel()}
        run.aliased = [t if t.numel() and t.untyped_storage().data_ptr() in params else None for t in saved]
        ctx.save_for_backward(*[t for t, a in zip(saved, run.aliased) if a is None])
        run.ctx = weakref.ref(ctx)
        ctx.run = run
        return _handed_out(loss)

    @staticmethod
    def backward(ctx, grad_loss):
        run = ctx.run
        grads = run.stage(len(run.module._stages) - 1, grad_loss)
        inputs = [run.input_grads.pop(i, None) for i in range(ctx.n_inputs)]
        return (None, None, None, *grads, *inputs)


class _Stage(torch.autograd.Function):
    """Identity on the loss; its backward runs backward stage k and hands that stage's parameter gradients
    to autograd (DDP's hooks fire, its bucket's all-reduce is queued) before the next stage is queued."""

    @staticmethod
    def forward(ctx, loss, run, k, *params):
        ctx.run, ctx.k = run, k
        return loss.clone()  # not a view of the input: the caller may change the loss in place (loss /= n)

    @staticmethod
    def backward(ctx, grad_loss):
        grads = ctx.run.stage(ctx.k, grad_loss)
        return (grad_loss, None, None, *grads)


def _staged(module, progs, inputs: tuple):
    """loss = Stage_0(Stage_1(... StagedForward(params of the last stage, inputs))): autograd runs Stage_0's
    backward first (stage 0 of the backward), the forward node's last."""
    run = _Run(module, progs)
    params = module._param_list
    last = [params[i] for i in module._stage_params[-1]]
    loss = _StagedForward.apply(module, run, len(last), *last, *inputs)
    for k in reversed(range(len(module._stages) - 1)):
        loss = _Stage.apply(loss, run, k, *[params[i] for i in module._stage_params[k]])
    return loss


class _Step(torch.autograd.Function):
    """A fused-step archive: the program computes loss and gradients (for loss gradient 1) in the forward."""

    @staticmethod
    def forward(ctx, module, progs, *args):
        loss, ctx.grads = _run_first(ctx, module, progs, "step", args)
        return _handed_out(loss)

    @staticmethod
    def backward(ctx, grad_loss):
        module = ctx.module
        grads = ctx.grads
        if grads is None:
            raise AotfuseError("a second backward through one forward of a fused-step archive: its gradients "
                               "were handed to autograd by the first (backward(retain_graph=True) twice)",
                               remedy="run the forward again for each backward, or build without --fused-step "
                                      "(step='split'), whose saved tensors serve several backwards")
        ctx.grads = None
        tangent = grad_loss.reshape(()).to(module._loss_dtype).contiguous()
        grads = _unshared(grads)  # before scaling: a buffer returned twice is scaled once per owner
        module._scale(ctx.progs, grads, tangent)
        return (None, *_by_owner(module, ctx, grads))


class _Programs:
    """What one call runs: executors by program name and their CUDA graphs (or None), at the dims `env`
    (None: a static archive). A forward's context keeps it, so its backward runs at the forward's shape."""
    __slots__ = ("executors", "graphs", "env")

    def __init__(self, executors: dict, graphs: dict | None, env: dict | None):
        self.executors, self.graphs, self.env = executors, graphs, env


def _grid(kernel, env) -> tuple:
    """A kernel's grid: ints, or size expressions evaluated at the dims (a gradient of a dynamic input)."""
    if env is None or all(isinstance(g, int) for g in kernel.grid):
        return tuple(kernel.grid)
    from ..contract.sizes import evaluate

    return tuple(g if isinstance(g, int) else evaluate(g, env) for g in kernel.grid)


def _size_args(kernel, env) -> list:
    """The int32 dims a kernel takes after its pointers (KernelEntry.size_args), at the dims `env`."""
    if not kernel.size_args:
        return []
    from ..contract.sizes import evaluate

    return [evaluate(s, env) for s in kernel.size_args]


class PackagedModule(nn.Module):
    """An nn.Module over a train archive. Parameter names follow the original module's (dots kept)."""

    def __init__(self, art, cuda_graphs: bool | None = None):
        super().__init__()
        info = art.manifest.train
        if info is None:
            raise AotfuseError("this archive has no backward program", remedy="build it with --train")
        self._art = art
        self._names = list(info.params)
        self._params = nn.ParameterDict()
        self._param_list = []
        # a parameter the programs read in a non-row-major layout (a channels-last conv filter) is made in it
        self._strides = tuple(info.param_strides) or (None,) * len(self._names)
        for name, stride in zip(self._names, self._strides):
            t = art.weights[name]
            if stride is not None and not dense_strides(tuple(t.shape), stride):
                raise ArchiveError(f"manifest.train.param_strides: {list(stride)} is not a dense layout of parameter "
                                   f"{name!r} {list(t.shape)}", remedy="rebuild the archive; it is damaged")
            if stride is not None:
                t = torch.empty_strided(tuple(t.shape), stride, dtype=t.dtype, device=t.device).copy_(t)
            elif t.device.type == "cpu":  # on the CPU path weights are views of the archive's bytes: never write there
                t = t.clone()
            p = nn.Parameter(t)
            self._params[name.replace(".", "__")] = p
            self._param_list.append(p)
        self._param_index = {n: i for i, n in enumerate(self._names)}
        self._first_key = self._names[0].replace(".", "__") if self._names else None
        self._bufs = UpdatedBuffers(art, info.mutated_buffers)
        original_state_dict_names(self, {"_params": tuple(self._names), "_bufs": self._bufs.names})
        self._grad_map = list(info.grads)
        self._graphs = None
        self._step = info.mode == "step"
        # a staged backward (partition/stages.py): per stage, its programs' name and gradient indices, and the
        # parameters whose gradients it returns (each parameter an input of exactly one autograd node)
        self._stages = [(name, tuple(st)) for name, st in zip(info.programs[1:], info.stages)]
        self._stage_params = [[self._param_index[ref] for i in st for kind, ref in [info.grads[i]] if kind == "param"]
                              for _, st in self._stages]
        if self._step:  # per gradient: its in-place scaling kernel's launcher and grid
            self._scalers = [(art.launchers[k], art.kernels[k]) for k in info.scale_kernels]
        self._use_graphs = art.device.type == "cuda" and (art.use_graphs if cuda_graphs is None else cuda_graphs)
        self._graphs_asked = art.graphs_asked if cuda_graphs is None else cuda_graphs
        self.graphs_why = "no CUDA graphs: " + ("not on a GPU" if art.device.type != "cuda" else "turned off")
        if art.dims:  # dynamic dims: each shape its executors and graphs, linked at its first call
            self._static = None
            self._shapes: collections.OrderedDict = collections.OrderedDict()
            self._graphs = None
            if self._use_graphs:
                self.graphs_why = "CUDA graphs per shape (decided at each shape's first call, see shape_stats())"
        else:
            self._graphs, why = self._make_graphs(art.executors) if self._use_graphs else (None, self.graphs_why)
            self.graphs_why = why
            self._static = _Programs(art.executors, self._graphs, None)
        loss = TORCH.get(art.output_specs[0].dtype.removeprefix("torch."))  # specs spell str(torch dtype)
        self._loss_dtype = loss if loss in (torch.float32, torch.bfloat16, torch.float16) else torch.float32

    def _make_graphs(self, executors: dict) -> tuple[dict | None, str]:
        """The programs' CUDA graphs over `executors` (the archive's, or one shape's), or None where they
        would not pay (runtime/graphs.graphs_pay), and why."""
        art, info = self._art, self._art.manifest.train
        n_p, n_m = len(self._names), len(self._bufs.names)
        if self._step:
            # the step reads parameters and updated buffers in place and copies the batch (a new tensor
            # every step) into static buffers; its outputs (the gradients) are fresh per held set
            # (the loss is cloned: a caller keeping it must not hold the set; the gradients are handed out on it)
            n_out = len(executors["step"].program.returned)
            graphs = {"step": art.graph_of(executors["step"], frozenset(range(n_p + n_m)), key=False,
                                           alias_small=frozenset(range(1 + n_m, n_out)))}
        else:
            # the forward copies the batch (a new tensor every step) and reads parameters and updated
            # buffers in place; the backward reads the saved tensors where the forward's graph wrote
            # them (keyed by address), parameters passed through in place, and copies the batch tensors
            # passed through. One arena per stream for both programs (graphs.ArenaPool): max, not sum.
            from .graphs import ArenaPool

            arenas = ArenaPool(max(executors[p].program.arena_bytes for p in info.programs), art.device)
            # (the loss and buffer updates are cloned; the saved tensors, small ones too, stay on the set: autograd
            # holds the large ones until the backward anyway)
            n_out = len(executors["forward"].program.returned)
            fwd = art.graph_of(executors["forward"], frozenset(range(n_p + n_m)), key=False, arenas=arenas,
                               alias_small=frozenset(range(1 + n_m, n_out)))
            # forward outputs: loss, n_m buffer updates, then the saved tensors (the backward's inputs)
            through = {k - 1 - n_m: j for k, j in fwd.passthrough.items() if k >= 1 + n_m}
            params = frozenset(k for k, j in through.items() if j in fwd.bound)
            graphs = {"forward": fwd}
            # a staged backward's programs read what the previous one carried, keyed; their graphs share memory
            # pools in stage order (graph_cache.PoolChain): the stages' scratch is held once, not per stage
            staged = len(info.programs) > 2
            for k, name in enumerate(info.programs[1:]):
                # its outputs are gradients (and carries): handed out on the graph's buffers, small ones too
                n_out = len(executors[name].program.returned)
                graphs[name] = art.graph_of(executors[name], params, frozenset(through) - params, key=True,
                                            arenas=arenas, order=k if staged else None,
                                            alias_small=frozenset(range(n_out)))
        from .graphs import graphs_pay

        use, why = graphs_pay(list(graphs.values()))
        if self._graphs_asked:  # asked for explicitly: kept whatever they cost
            return graphs, "CUDA graphs: asked for (cuda_graphs=True); " + why
        if not use:
            art.drop_graphs(graphs.values())
            return None, why
        return graphs, why

    def _programs(self, env: dict | None) -> "_Programs":
        """What a call at the dims `env` runs: the archive's programs (static), or that shape's executors and
        graphs (dynamic dims; at most knobs.shape_cache shapes kept, the least recently used released)."""
        if env is None:
            return self._static
        key = tuple(env[d.sym] for d in self._art.dims)
        progs = self._shapes.get(key)
        if progs is not None:
            self._shapes.move_to_end(key)
            return progs
        art = self._art
        executors = {name: art.shapes[name].executor(env) for name in art.manifest.train.programs}
        graphs = self._make_graphs(executors)[0] if self._use_graphs else None
        progs = self._shapes[key] = _Programs(executors, graphs, dict(env))
        while len(self._shapes) > max(1, knobs.shape_cache):
            _, old = self._shapes.popitem(last=False)
            if old.graphs:  # a forward still waiting for its backward runs that backward without a graph
                art.drop_graphs(old.graphs.values())
        return progs

    def shape_stats(self) -> dict:
        """Dynamic dims: the shapes this module holds (dims, each program's graph captures and replays)."""
        return {"cached": len(getattr(self, "_shapes", ())), "capacity": max(1, knobs.shape_cache),
                "shapes": [{"dims": p.env, "graphs": {n: g.stats for n, g in (p.graphs or {}).items()}}
                           for p in getattr(self, "_shapes", {}).values()]}

    def _scale(self, progs, grads: list, tangent: torch.Tensor) -> None:
        """grads[i] *= tangent in place, on the current stream (emit/scale.py: nothing when it is 1)."""
        grids = [_grid(k, progs.env) for _, k in self._scalers]
        if self._art.device.type == "cuda":
            from .executor import current_stream

            stream = current_stream(self._art.device.index)
            with self._art.device_scope():
                for (launch, k), grid, g in zip(self._scalers, grids, grads):
                    launch(grid, stream, [g.data_ptr(), tangent.data_ptr(), *_size_args(k, progs.env)])
        else:
            for (launch, k), grid, g in zip(self._scalers, grids, grads):
                launch(grid, 0, [g, tangent, *_size_args(k, progs.env)])

    def _run(self, progs, program: str, inputs: list, donate: bool = False):
        with self._art.device_scope():
            g = progs.graphs.get(program) if progs.graphs is not None else None
            if g is not None and not g.released:
                return g(inputs, donate)
            return progs.executors[program].run(inputs, donate=donate)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, p in zip(self._names, self._param_list):
            yield (prefix + name, p)

    def _refuse_replaced_parameters(self) -> None:
        """FSDP (`fully_shard`, or FullyShardedDataParallel) replaces a module's parameters with shards
        (DTensors, flat-parameter views) and gathers them around each forward: the packaged programs
        would go on reading the original tensors, gradients would miss the shards and each rank would
        train on its own. Refused before anything runs (an optimizer over these tensors changes nothing
        FSDP sees)."""
        current = list(self._params._parameters.values())
        if len(current) == len(self._param_list) and all(a is b for a, b in zip(current, self._param_list)):
            return  # a wrapper that keeps the parameters (composable replicate, DDP's class swap)
        raise AotfuseError(
            "the packaged module's parameters were replaced (FSDP's fully_shard or FullyShardedDataParallel "
            "shard them; load_state_dict(assign=True), functional_call or to_empty swap them): its programs "
            "read the parameter tensors it was loaded with, so this is not supported",
            remedy="wrap it in torch.nn.parallel.DistributedDataParallel (replicated parameters); FSDP would "
                   "need the programs to take the parameters FSDP all-gathers before each forward and to hand "
                   "their gradients to its reduce-scatter (docs/architecture.md, Training: data parallel)")

    def _apply(self, fn, recurse=True):
        """`.to()`, `.half()`, `.to(memory_format=torch.channels_last)` keep the Parameter objects (their
        .data changes): the programs read each parameter in the layout it was built with (row-major, or
        channels-last: TrainInfo.param_strides), so a layout change is undone here (values kept; a dtype
        change is refused at the next call by the archive's guards)."""
        out = super()._apply(fn, recurse)
        for p, stride in zip(self._param_list, self._strides):
            if stride is None:
                if not p.is_contiguous():
                    p.data = p.data.contiguous()
            elif not same_layout(tuple(p.shape), p.stride(), stride):
                p.data = torch.empty_strided(tuple(p.shape), stride, dtype=p.dtype, device=p.device).copy_(p.data)
        return out

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from self._bufs.named(prefix)

    def forward(self, *args, **kwargs):
        """Called as the model was at build time (positional and keyword tensors, e.g. `input_ids=`,
        `labels=`). Returns the loss, as the model's output class (`out.loss`) when it returned one."""
        call = self._art.manifest.call
        inputs = flatten(call, args, kwargs)
        loss = self._forward(inputs)
        tree = loss_tree(call)
        return loss if tree is None else rebuild(tree, [loss])

    def _forward(self, inputs: tuple):
        if type(self) is not PackagedModule or (self._param_list and self._params._parameters.get(
                self._first_key) is not self._param_list[0]):
            self._refuse_replaced_parameters()
        env = self._art.check_inputs(inputs)  # dynamic dims: their values (None: a static archive)
        self._bufs.check_mode(self.training)
        with_grad = {int(ref) for kind, ref in self._grad_map if kind == "input"}
        for i, x in enumerate(inputs):
            if x.requires_grad and i not in with_grad:
                name = self._art.input_specs[i].name
                raise GuardError(f"input {name!r} (#{i}) requires grad, but the archive has no gradient for it",
                                 remedy="build with an example input that requires grad (x.requires_grad_())")
        progs = self._programs(env)
        if self._stages:
            return _staged(self, progs, inputs)
        return (_Step if self._step else _Packaged).apply(self, progs, *self._param_list, *inputs)
