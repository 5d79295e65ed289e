"""The joint forward+backward graph: aot_autograd's joint trace with our training decompositions.

`trace_joint(model, example_inputs)` returns a `JointGraph` whose FX graph takes
`(*params, *buffers, *user_inputs, tangent)` and returns `(*user_outputs, *buffer_updates, *grads)`:
- the model's forward returns the scalar loss, alone or first of several outputs
  (`loss_index` says which; other outputs must not require grad);
- `tangent` is a 0-d placeholder (the loss's dtype and shape) standing for d(out)/d(loss): it
  REPLACES the `ones_like(loss)` seed aot_autograd creates, so `loss.backward(gradient=g)` and loss
  scaling cost no extra kernel. If no seed can be identified (a future torch), every gradient
  output is multiplied by the tangent instead (correct by linearity) and `tangent_mode` says
  "multiply";
- `buffer_updates[i]` is the new value of buffer `mutated_buffers[i]` (train-mode BatchNorm's
  running statistics and `num_batches_tracked`): aot_autograd functionalizes an in-place update of a
  buffer into an extra graph output plus a map output -> buffer fqn (`buffers_to_mutate`, as
  torch.export represents buffer mutations). The forward program returns these values and the
  runtime writes them into the module's buffers (runtime/training.py). An in-place update of a user
  input or of a parameter is refused, naming it;
- `grads[i]` says what gradient output i is: ("param", fqn) or ("input", user input index).
"""
from __future__ import annotations

import contextlib
import dataclasses
import operator
import time
from typing import Any

import torch
import torch.fx

from ..errors import AotfuseError, BuildError
from ..export.capture import InputSpec, output_structure
from ..export.complex import as_real_weight, realify
from ..export.experts import rewrite_fallback_experts
from ..fxgraph import ancestors
from .batchnorm import cumulative_average_batchnorm
from .decomp_train import sdpa_math_mode, training_decompositions
from .layerdrop import uniform_compare_mode
from .losses import cross_entropy_mode
from .origins import attribute, call_sites
from .pooling import adaptive_pool_mode
from .product_sums import merge_product_sums
from .rnn import lstm_mode
from .sampling import grid_sample_mode
from .tied_embedding import fuse_tied_embedding_grads
from .upsample import nearest_upsample_mode

aten = torch.ops.aten

_PREFIX = "model."


@dataclasses.dataclass(frozen=True)
class JointGraph:
    gm: torch.fx.GraphModule
    param_names: tuple[str, ...]  # fqn per parameter placeholder, in placeholder order
    buffer_names: tuple[str, ...]  # fqn per buffer placeholder, in placeholder order
    weights: dict[str, torch.Tensor]  # fqn -> detached contiguous CPU tensor (params and buffers)
    inputs: tuple[InputSpec, ...]  # the user inputs
    grads: tuple[tuple[str, Any], ...]  # per gradient output: ("param", fqn) | ("input", index)
    # placeholder name -> ("param", fqn) | ("buffer", fqn) | ("input", index) | ("tangent", None), in order
    placeholders: tuple[tuple[str, str, Any], ...]
    num_user_outputs: int  # gm outputs are (*user_outputs, *buffer_updates, *grads)
    loss_index: int
    tangent: str  # the tangent placeholder's name
    tangent_mode: str  # "seed" (replaced aot_autograd's ones_like seed) | "multiply" (fallback)
    seconds: float
    # the model's call and output (export/capture.py's CapturedGraph.call / outputs_tree); the user
    # outputs are the loss (leaf `loss_leaf` of outputs_tree), then the other leaves in tree order
    call: dict | None = None
    outputs_tree: dict | None = None
    loss_leaf: int = 0
    decisions: tuple = ()  # per attention call: fused or math, and why (decomp_train.sdpa_math_mode)
    product_sums: tuple = ()  # per sum of matmul products: merged into one matmul or kept, and why (product_sums.py)
    tied_embeddings: tuple = ()  # per add of an embedding gradient: one buffer with the matmul or not (tied_embedding.py)
    # fqn of the buffer each buffer-update output writes (gm outputs after the user outputs), in order;
    # a subset of buffer_names
    mutated_buffers: tuple[str, ...] = ()
    # dynamic dims (joint/dims.py): our Dim records, torch's size symbols -> ours, and torch's ShapeEnv
    # (a guard it gains while the programs are lowered would fix a dim: lowering refuses it)
    dims: tuple = ()
    symmap: dict = dataclasses.field(default_factory=dict)
    shape_env: Any = None

    @property
    def num_forward_outputs(self) -> int:
        """The outputs the forward computes: the user outputs, then the buffer updates."""
        return self.num_user_outputs + len(self.mutated_buffers)

    @property
    def user_output_nodes(self) -> list:
        return list(_output_args(self.gm)[: self.num_user_outputs])

    @property
    def buffer_update_nodes(self) -> list:
        return list(_output_args(self.gm)[self.num_user_outputs:self.num_forward_outputs])

    @property
    def grad_output_nodes(self) -> list:
        return list(_output_args(self.gm)[self.num_forward_outputs:])

    def placeholder_kinds(self) -> dict[str, tuple[str, Any]]:
        return {name: (kind, ref) for name, kind, ref in self.placeholders}

    def flat_args(self, example_inputs, tangent: float | torch.Tensor = 1.0) -> list[torch.Tensor]:
        """The gm's arguments: weights by fqn, then the user inputs, then the tangent."""
        args = [self.weights[f] for f in self.param_names] + [self.weights[f] for f in self.buffer_names]
        args += list(example_inputs)
        loss_val = self.user_output_nodes[self.loss_index].meta["val"]
        if not isinstance(tangent, torch.Tensor):
            tangent = torch.full(tuple(loss_val.shape), float(tangent), dtype=loss_val.dtype)
        return args + [tangent]


def _output_args(gm: torch.fx.GraphModule):
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return out.args[0]


class _TupleOut(torch.nn.Module):
    """aot_export_module wants positional tensor inputs and tuple outputs; the model is kept under `model.`.

    Calls `model(*args[:n_pos], **keywords)` with the keyword tensors (then the constants) and
    flattens the output tree (tuple, dict, ModelOutput) into its leaves. The loss is moved first:
    it is the leaf at `loss_key` (dict-like outputs: "loss", as transformers models return it),
    else leaf `loss_index`. With keep_rest, the other outputs follow, detached (the packaged backward
    differentiates the loss only); without it (the default: today's train archives return the loss
    alone, runtime/training.py), only the loss is returned. `out_spec` / `loss_leaf` record what
    the trace saw."""

    def __init__(self, model: torch.nn.Module, n_pos: int = 0, keywords: tuple = (), consts: dict | None = None,
                 loss_index: int = 0, keep_rest: bool = False):
        super().__init__()
        self.keep_rest = keep_rest
        self.model = model
        self.n_pos, self.keywords, self.consts = n_pos, tuple(keywords), dict(consts or {})
        self.loss_index = loss_index
        self.out_spec = None
        self.loss_leaf = None
        self._tied = self._ties()  # read off the real tensors, before aot_autograd swaps in fakes

    # Tied weights (an LM head tied to the embedding, BERT's decoder bias tied to cls.predictions.bias):
    # aot_export_module lists named_parameters(remove_duplicate=False) and would make each name its own
    # input, so a tied pair got two gradients (or one name none: "Found a parameter that did not
    # receive a gradient"). Here each tensor is listed once, under its first name, as
    # nn.Module.parameters() and optimizers see it; while the forward runs, every other name is
    # pointed at the first name's (traced) tensor, so the uses share it and their gradients add up.
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return super().named_parameters(prefix, recurse, True)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return super().named_buffers(prefix, recurse, True)

    def _ties(self):
        """[(module, attr kind, attr, owner module, owner attr)] for every alias of a parameter/buffer."""
        out = []
        for kind, named in (("_parameters", self.named_parameters), ("_buffers", self.named_buffers)):
            first = {id(t): n for n, t in named()}
            listed = super().named_parameters if kind == "_parameters" else super().named_buffers
            for name, t in listed(remove_duplicate=False):
                if first.get(id(t), name) != name:
                    mod, _, attr = name.rpartition(".")
                    omod, _, oattr = first[id(t)].rpartition(".")
                    out.append((self.get_submodule(mod), kind, attr, self.get_submodule(omod), oattr))
        return out

    def forward(self, *args):
        ties = self._tied
        saved = [getattr(m, kind)[a] for m, kind, a, _, _ in ties]
        try:
            for m, kind, a, om, oa in ties:
                getattr(m, kind)[a] = getattr(om, kind)[oa]
            return self._forward(*args)
        finally:
            for (m, kind, a, _, _), t in zip(ties, saved):
                getattr(m, kind)[a] = t

    def _forward(self, *args):
        import torch.utils._pytree as pytree

        kw = dict(zip(self.keywords, args[self.n_pos:]))
        out = self.model(*args[:self.n_pos], **kw, **self.consts)
        leaves, spec = pytree.tree_flatten(out)
        idx = self.loss_index
        if not spec.is_leaf() and isinstance(spec.context, (list, tuple)) and "loss" in spec.context:
            before = spec.context.index("loss")  # leaves of the children before "loss"
            idx = sum(spec.child(i).num_leaves for i in range(before))
        if not 0 <= idx < len(leaves):
            raise BuildError(f"the model returned {len(leaves)} tensors; no loss at output {idx}",
                             remedy="call the model with labels= (or return the loss first)")
        self.out_spec, self.loss_leaf = spec, idx
        loss = leaves[idx]
        if not self.keep_rest:
            return (loss,)
        rest = [x.detach() if isinstance(x, torch.Tensor) else x for i, x in enumerate(leaves) if i != idx]
        return (loss, *rest)


def _strip(fqn: str) -> str:
    return fqn[len(_PREFIX):] if fqn.startswith(_PREFIX) else fqn


# ---------------------------------------------------------------- the tangent

_SEEDS = {aten.ones_like.default, aten.full_like.default, aten.full.default, aten.ones.default,
          aten.new_ones.default, aten.scalar_tensor.default, aten.new_full.default}


def _is_one(node) -> bool:
    t = node.target
    if t in (aten.ones_like.default, aten.ones.default, aten.new_ones.default):
        return True
    if t in (aten.full_like.default, aten.new_full.default):
        return len(node.args) > 1 and node.args[1] == 1
    if t is aten.full.default:
        return len(node.args) > 1 and node.args[1] == 1
    if t is aten.scalar_tensor.default:
        return node.args[0] == 1
    return False


def _find_seed(gm, loss, user_outputs):
    fwd = ancestors(user_outputs)
    lv = loss.meta["val"]
    cands = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in _SEEDS or n in fwd or not _is_one(n):
            continue
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(lv.shape) or v.dtype != lv.dtype:
            continue
        if any(a is not loss for a in n.all_input_nodes):
            continue
        cands.append(n)
    direct = [n for n in cands if n.args and n.args[0] is loss]
    if len(direct) == 1:
        return direct[0]
    return cands[0] if len(cands) == 1 else None


def _insert_tangent(gm, loss, user_outputs, grad_outputs):
    graph = gm.graph
    last_ph = [n for n in graph.nodes if n.op == "placeholder"][-1]
    seed = _find_seed(gm, loss, user_outputs)
    with graph.inserting_after(last_ph):
        tangent = graph.placeholder("tangent")
    lv = loss.meta["val"]
    if seed is not None:
        tangent.meta["val"] = seed.meta["val"]
        if "tensor_meta" in seed.meta:
            tangent.meta["tensor_meta"] = seed.meta["tensor_meta"]
        seed.replace_all_uses_with(tangent)
        graph.erase_node(seed)
        return tangent, "seed"
    # Fallback: scale every gradient (linear in the seed).
    tangent.meta["val"] = lv  # same shape and dtype as the loss
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    new = list(out.args[0])
    k = len(new) - len(grad_outputs)
    for i, g in enumerate(grad_outputs):
        if g is None:
            continue
        with graph.inserting_before(out):
            m = graph.call_function(aten.mul.Tensor, (g, tangent))
        m.meta["val"] = g.meta["val"]
        new[k + i] = m
    out.args = (tuple(new),)
    return tangent, "multiply"


# ---------------------------------------------------------------- CSE

def _key(v):
    if isinstance(v, (list, tuple)):
        return (type(v).__name__,) + tuple(_key(x) for x in v)
    if isinstance(v, dict):
        return ("dict",) + tuple(sorted((k, _key(x)) for k, x in v.items()))
    if isinstance(v, float):
        return ("float", repr(v))  # nan == nan, -0.0 != 0.0
    if isinstance(v, (torch.fx.Node, int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                      torch.memory_format)):
        return (type(v).__name__, v)
    raise TypeError(type(v).__name__)


def _cse(graph: torch.fx.Graph) -> int:
    """Merge identical pure call_function nodes (the backward's decompositions recompute forward
    values such as the nll one-hot or silu's sigmoid; the partitioner decides where they live).
    Random and mutating ops are never merged."""
    import operator

    seen: dict = {}
    merged = 0
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        t = n.target
        if isinstance(t, torch._ops.OpOverload):
            schema = t._schema
            if torch.Tag.nondeterministic_seeded in t.tags or schema.is_mutable or not schema.returns:
                continue
        elif t is not operator.getitem:
            continue
        try:
            key = (t, _key(n.args), _key(n.kwargs))
            hash(key)
        except TypeError:
            continue
        if key in seen:
            n.replace_all_uses_with(seen[key])
            graph.erase_node(n)
            merged += 1
        else:
            seen[key] = n
    return merged


# ---------------------------------------------------------------- names

def _input_names(model, n: int) -> list[str]:
    """The forward's parameter names for the user inputs (as torch.export names them), else argN."""
    import inspect

    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:n]]
    return names + [f"arg{i}" for i in range(len(names), n)]


def _ident(s: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in s)
    return out if out and not out[0].isdigit() else "_" + out


def _rename_placeholders(phs, placeholders, input_names):
    """Readable placeholder names: p_<fqn> for parameters, b_<fqn> for buffers, the forward's
    argument names for inputs (FX keeps names unique)."""
    out = []
    for node, (_, kind, ref) in zip(phs, placeholders):
        want = {"param": lambda: "p_" + _ident(ref), "buffer": lambda: "b_" + _ident(ref),
                "input": lambda: _ident(input_names[ref])}[kind]()
        try:
            node._rename(want)
            node.target = node.name  # the generated forward's argument name
        except Exception:  # a private FX helper: keep aot_autograd's names if it is gone
            pass
        out.append((node.name, kind, ref))
    return out


# ---------------------------------------------------------------- data-dependent values

_DATA_DEPENDENT = ("DataDependentOutputException", "GuardOnDataDependentSymNode", "DynamicOutputShapeException")


def model_line(exc: BaseException) -> str | None:
    """'file:line: code' of the innermost traceback frame outside torch and aotfuse: the model's line."""
    import os
    import sysconfig
    import traceback

    # by directory (torch's, aotfuse's, the standard library's), not by a "/torch/" substring: a venv may
    # itself live under a folder named torch (/opt/torch/.venv/.../transformers/... is the model's code)
    skip = tuple(os.path.realpath(d) + os.sep for d in (
        os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)), sysconfig.get_paths()["stdlib"]))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not os.path.realpath(f.filename).startswith(skip)]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {(f.line or '').strip()}"


def data_dependent_error(exc: BaseException, stage: str) -> BuildError | None:
    """A BuildError naming the model line that asked for a tensor's value while tracing (`.item()`,
    `bool(t)`, `if t.any():`, a shape that depends on values), or None for other errors."""
    if type(exc).__name__ not in _DATA_DEPENDENT:
        return None
    where = model_line(exc) or "the model's forward"
    return BuildError(f"{stage}: the model reads a tensor's value at {where}",
                      remedy="a compiled program cannot branch on data: compute that value outside the model "
                             "and pass it in, or skip the check under `if not torch.compiler.is_compiling():`")


# ---------------------------------------------------------------- constants

def _simplify_masks(gm, placeholders, weights, mutated=()) -> None:
    """export/masks.py on the joint graph (before _fold: a mask that becomes a flag is never stored);
    buffers the forward does not update are constants of the archive."""
    from ..export.masks import simplify_attention_masks

    seeds = {name: weights[ref] for name, kind, ref in placeholders if kind == "buffer" and ref not in mutated}
    simplify_attention_masks(gm, seeds)


def _lift_constants(gm, placeholders, buffer_names, weights):
    """aot_autograd keeps a tensor the forward makes from Python values (`torch.tensor(2.0)`, the value of
    `t[:, 0] = 1`: T5's and Whisper's shift of the labels) as a get_attr of the graph module, where export
    lifts it to an input. Each becomes a buffer placeholder (a fixed weight of the train archive) after the
    other parameters and buffers. Returns the placeholders in graph order; updates buffer_names and weights."""
    from ..export.fold import PREFIX

    graph = gm.graph
    consts = [n for n in graph.nodes if n.op == "get_attr"]
    if not consts:
        return placeholders
    kinds = {name: (kind, ref) for name, kind, ref in placeholders}
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    fixed = [n for n in phs if kinds[n.name][0] in ("param", "buffer")]
    after = fixed[-1] if fixed else None
    for n in consts:
        val = operator.attrgetter(n.target)(gm)
        if not isinstance(val, torch.Tensor):
            raise BuildError(f"joint graph attribute {n.target} is a {type(val).__name__}, not a tensor",
                             remedy="compute the value in forward from tensors, or register it as a buffer")
        val = val.detach().contiguous().cpu()
        if after is None:
            with graph.inserting_before(phs[0]):
                ph = graph.placeholder(f"lifted_{n.name}")
        else:
            with graph.inserting_after(after):
                ph = graph.placeholder(f"lifted_{n.name}")
        ph.meta.update({k: v for k, v in n.meta.items() if k in ("val", "tensor_meta")} or {"val": val})
        n.replace_all_uses_with(ph)
        graph.erase_node(n)
        after = ph
        fqn = PREFIX + n.name
        buffer_names.append(fqn)
        weights[fqn] = val
        kinds[ph.name] = ("buffer", fqn)
    graph.lint()
    return [(n.name, *kinds[n.name]) for n in graph.nodes if n.op == "placeholder"]


def _fold(gm, placeholders, param_names, buffer_names, weights, mutated=()):
    """export/fold.py on the joint graph: constant subgraphs lowering has no rule for (the causal
    mask's cumsum) become buffers, placed after the other buffers (buffers the forward does not
    update are fixed archive weights of a train archive; `mutated` ones are not constants).
    Returns the placeholders in graph order; updates buffer_names and weights."""
    from ..export.fold import fold_unlowerable_constants, lowerable_ops

    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kinds = {name: (kind, ref) for name, kind, ref in placeholders}
    # a buffer the forward updates changes from call to call: never a constant
    seeds = {n.name: weights[kinds[n.name][1]] for n in phs
             if kinds[n.name][0] == "buffer" and kinds[n.name][1] not in mutated}
    fixed = [n for n in phs if kinds[n.name][0] in ("param", "buffer")]
    after = fixed[-1] if fixed else None
    if after is None:  # nothing but inputs: the folded buffers go first
        with gm.graph.inserting_before(phs[0]):
            after = gm.graph.placeholder("_fold_anchor")
    folded = fold_unlowerable_constants(gm, lowerable_ops(), after=after, seeds=seeds)
    if after.name == "_fold_anchor":
        gm.graph.erase_node(after)
    for name, fqn, val in folded:
        buffer_names.append(fqn)
        weights[fqn] = val
        kinds[name] = ("buffer", fqn)
    return [(n.name, *kinds[n.name]) for n in gm.graph.nodes if n.op == "placeholder"]


# ---------------------------------------------------------------- mutations

def _refuse_mutated_inputs(sig, input_names: list[str]) -> None:
    """An in-place update of a user input or a parameter inside the forward has no packaged form (the
    runtime writes back buffers only): refused, naming what is written."""
    if sig.user_inputs_to_mutate:
        names = [input_names[sig.user_inputs.index(ph)] if ph in sig.user_inputs else ph
                 for ph in sig.user_inputs_to_mutate.values()]
        raise BuildError(f"the training forward writes into its input(s) {', '.join(map(repr, names))} in place",
                         remedy="compute on a copy (x = x.clone(), or an out-of-place op) instead of "
                                "updating the caller's tensor")
    to_params = getattr(sig, "parameters_to_mutate", None) or {}
    if to_params:
        names = [_strip(f) for f in to_params.values()]
        raise BuildError(f"the training forward writes into parameter(s) {', '.join(map(repr, names))} in place",
                         remedy="update parameters outside the forward (an optimizer step), or register "
                                "the tensor as a buffer if it is not trained")


def _buffer_updates(outs: list, sig, weights: dict) -> tuple[list, list[str]]:
    """The buffer-update outputs aot_autograd puts first, and the fqn each one writes. Each new value
    has its buffer's shape and dtype (the runtime copies it into the buffer)."""
    to_buffers = dict(sig.buffers_to_mutate)  # output name -> fqn
    n_mut, n_user = len(to_buffers), len(sig.user_outputs)
    names = [getattr(n, "name", None) for n in outs]
    if len(outs) < n_mut + n_user or sorted(names[:n_mut]) != sorted(to_buffers) or \
            names[n_mut:n_mut + n_user] != list(sig.user_outputs):
        # e.g. two buffers updated to the same tensor: one output name for two mutations
        raise BuildError(f"joint graph: cannot tell its buffer updates ({sorted(to_buffers.values())}) from its "
                         f"{n_user} output(s)", remedy="give each updated buffer a value of its own")
    updates, mutated = list(outs[:n_mut]), []
    for n in updates:
        fqn = _strip(to_buffers[n.name])
        val, buf = n.meta.get("val"), weights[fqn]
        if not isinstance(val, torch.Tensor) or tuple(val.shape) != tuple(buf.shape) or val.dtype != buf.dtype:
            got = f"{getattr(val, 'dtype', type(val).__name__)}{list(getattr(val, 'shape', []))}"
            raise BuildError(f"the update of buffer {fqn!r} is {got}, the buffer is {buf.dtype}{list(buf.shape)}",
                             remedy="update buffers in place with values of their own shape and dtype")
        mutated.append(fqn)
    return updates, mutated


# ---------------------------------------------------------------- trace

def _faked(model: torch.nn.Module, example_inputs: tuple, symbolic=None):
    """A copy of the model whose parameters and buffers are fake tensors, and the example inputs as fake
    tensors, of one fake mode: aot_autograd traces with it, so the joint trace never runs the model's
    real math (it did: 53 s of the anchor GPT's 59 s build on 2 cores). The real values are read from
    the original model afterwards (weights, folded constants).

    symbolic: dynamic dims (joint/dims.SymbolicInputs): the mode gets a ShapeEnv, the inputs it names
    get symbolic sizes on their dynamic axes (everything else, weights included, stays static)."""
    import copy

    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

    mode = symbolic.mode() if symbolic is not None else FakeTensorMode()
    with FakeCopyMode(mode):
        fake_model = copy.deepcopy(model)
    if symbolic is not None:
        return mode, fake_model, symbolic.fake_inputs(mode, example_inputs)
    return mode, fake_model, tuple(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs)


def _freeze_unused(wrapped, fake_inputs, input_names) -> list[str]:
    """Set requires_grad False on the (fake) parameters the loss does not depend on; an input that requires grad
    but gets none is refused (the archive would have no gradient for it). Returns the frozen names."""
    named = [(n, p) for n, p in wrapped.named_parameters() if p.requires_grad]
    ins = [(i, t) for i, t in enumerate(fake_inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    loss = wrapped(*fake_inputs)[0]
    grads = torch.autograd.grad(loss, [p for _, p in named] + [t for _, t in ins], allow_unused=True)
    dead_in = [input_names[i] if i < len(input_names) else f"#{i}" for (i, _), g in zip(ins, grads[len(named):])
               if g is None]
    if dead_in:
        raise BuildError(f"input(s) {', '.join(repr(n) for n in dead_in)} require grad but the loss does not depend "
                         "on them", remedy="build with those example inputs not requiring grad (x.detach())")
    frozen = [n for (n, p), g in zip(named, grads[:len(named)]) if g is None]
    for (n, p), g in zip(named, grads[:len(named)]):
        if g is None:
            p.requires_grad_(False)
    return frozen


@contextlib.contextmanager
def _compiling():
    """`torch.compiler.is_compiling()` / `is_exporting()` are True while the joint graph is traced, as
    they are under torch.export (which the inference capture uses).

    Model code reads these flags to leave out eager-only, data-dependent Python checks: transformers'
    masking_utils skips `if (packed_sequence_mask[:, -1] == 0).all(): return None` (a `.item()` on a
    tensor, which fake tensors cannot answer: `DataDependentOutputException:
    aten._local_scalar_dense`) and keeps the branch-free form, which gives the same numbers."""
    import torch.compiler as tc

    old = tc._is_compiling_flag, tc._is_exporting_flag
    tc._is_compiling_flag = tc._is_exporting_flag = True
    try:
        yield
    finally:
        tc._is_compiling_flag, tc._is_exporting_flag = old


def _realify(gm, placeholders: list, weights: dict) -> None:
    """export/complex.py on the joint graph: a complex buffer (a rotary embedding's rotations) is stored as its real
    pairs; a complex parameter or input is refused (its gradient would be complex)."""
    kinds = {name: (kind, ref) for name, kind, ref in placeholders}
    for ph in realify(gm):
        kind, ref = kinds.get(ph, ("?", None))
        if kind != "buffer":
            raise BuildError(f"{kind} {ref if ref is not None else ph!r} is complex: complex parameters and inputs are "
                             "not supported in training",
                             remedy="keep the real and imaginary parts as real tensors (torch.view_as_real)")
        weights[ref] = as_real_weight(weights[ref])


def trace_joint(model: torch.nn.Module, example_inputs=(), *, example_kwargs: dict | None = None,
                loss_index: int = 0, dynamic: tuple = ()) -> JointGraph:
    """Trace `model(*example_inputs, **example_kwargs)` into a joint forward/backward FX graph.

    The call returns the loss: a scalar tensor, output `loss_index` of a tuple, or the "loss" entry
    of a dict / transformers ModelOutput (`model(input_ids=ids, labels=ids)`). In the joint graph's
    outputs the loss comes first (`JointGraph.loss_index` is then 0); `outputs_tree` records the
    model's output structure and `loss_leaf` where the loss sits in it.

    dynamic: DynamicDim requests (export/dynamic.py, checked): those axes are traced as symbols
    (joint/dims.py); the graph's sizes are expressions of them, and `dims` / `symmap` / `shape_env`
    say which."""
    if not dynamic:
        return _trace_joint(model, example_inputs, example_kwargs, loss_index, None)
    from .dims import trace_symbolic

    return trace_symbolic(lambda symbolic: _trace_joint(model, example_inputs, example_kwargs, loss_index, symbolic),
                          model, example_inputs, example_kwargs, dynamic)


def _trace_joint(model, example_inputs, example_kwargs, loss_index: int, symbolic) -> JointGraph:
    from torch._functorch.aot_autograd import aot_export_module

    from ..export.capture import call_inputs, split_example

    t0 = time.perf_counter()
    args, kw_tensors, kw_consts = split_example(model, example_inputs, example_kwargs)
    example_inputs = args + tuple(kw_tensors.values())
    try:
        mode, fake_model, fake_inputs = _faked(model, example_inputs, symbolic)
        wrapped = _TupleOut(fake_model, len(args), tuple(kw_tensors), kw_consts, loss_index)
        with _compiling(), mode, call_sites() as sites, sdpa_math_mode() as attention, cross_entropy_mode(), \
                adaptive_pool_mode(), lstm_mode(), grid_sample_mode(), nearest_upsample_mode(), uniform_compare_mode(), \
                cumulative_average_batchnorm(fake_model):
            wrapped.register_forward_pre_hook(lambda *_: attention.new_run())
            try:
                gm, sig = aot_export_module(wrapped, fake_inputs, trace_joint=True, output_loss_index=0,
                                            decompositions=training_decompositions())
            except AssertionError as exc:
                if "did not receive a gradient" not in str(exc):
                    raise
                # aot_autograd wants a gradient for every parameter and input that requires one; eager leaves
                # .grad None where the loss does not depend on it (an unused head, a pooler): those are traced
                # frozen (on the fake copy only), so their .grad stays None as in eager
                _freeze_unused(wrapped, fake_inputs, input_names=_input_names(model, len(args)) + list(kw_tensors))
                gm, sig = aot_export_module(wrapped, fake_inputs, trace_joint=True, output_loss_index=0,
                                            decompositions=training_decompositions())
        attribute(gm, sites.sites)  # the model lines refusals name (aot_autograd's stack traces end in its own code)
    except AotfuseError:
        raise
    except Exception as exc:
        msg = str(exc).splitlines()[0] if str(exc) else ""
        dd = data_dependent_error(exc, "joint (forward+backward) trace")
        if dd is not None:
            raise dd from exc
        if "backward_output_names" in msg:  # torch's aot_export_module, mapping gradients to parameters by node name
            raise BuildError("joint (forward+backward) trace failed: two parameters get the very same gradient node in "
                             "the backward (a fused op's backward returning one tensor for both; nn.LSTM is routed "
                             "around this, joint/rnn.py), which torch's aot_export_module cannot map to parameters ("
                             + msg + ")",
                             remedy="write the op that uses both parameters with one op per parameter (nn.Linear "
                                    "layers, an explicit add), as joint/rnn.py does for nn.LSTM") from exc
        if "requires gradients, and received a mutation" in msg:  # aot_autograd's words, before any signature
            raise BuildError("the training forward writes in place into a tensor that requires grad (a parameter, "
                             "or an input that requires grad)",
                             remedy="update parameters outside the forward (an optimizer step) and compute on a "
                                    "copy of inputs (x = x.clone())") from exc
        raise BuildError(f"joint (forward+backward) trace failed: {type(exc).__name__}: {msg}",
                         remedy="the model's forward must return the scalar loss (first output); "
                                "check that loss.backward() works eagerly") from exc
    input_names = _input_names(model, len(args)) + list(kw_tensors)
    _refuse_mutated_inputs(sig, input_names)
    graph = gm.graph
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    placeholders = []
    param_names, buffer_names = [], []
    for n in phs:
        if n.name in sig.inputs_to_parameters:
            fqn = _strip(sig.inputs_to_parameters[n.name])
            param_names.append(fqn)
            placeholders.append((n.name, "param", fqn))
        elif n.name in sig.inputs_to_buffers:
            fqn = _strip(sig.inputs_to_buffers[n.name])
            buffer_names.append(fqn)
            placeholders.append((n.name, "buffer", fqn))
        elif n.name in sig.user_inputs:
            placeholders.append((n.name, "input", sig.user_inputs.index(n.name)))
        else:
            raise BuildError(f"joint graph placeholder {n.name} is neither a parameter, a buffer nor an input")
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    weights = {f: state[f].detach().contiguous().cpu() for f in param_names + buffer_names}

    outs = list(_output_args(gm))
    n_user = len(sig.user_outputs)
    updates, mutated = _buffer_updates(outs, sig, weights)
    outs = outs[len(updates):]  # aot_autograd puts the mutations first: (*updates, *user_outputs, *grads)
    user_outputs, grad_nodes = outs[:n_user], outs[n_user:]
    bw = sig.backward_signature
    grads = []
    p_order = [f for f in param_names if f in {_strip(v) for v in bw.gradients_to_parameters.values()}]
    i_order = sorted(set(bw.gradients_to_user_inputs.values()), key=lambda nm: sig.user_inputs.index(nm))
    expected = [("param", f) for f in p_order] + [("input", sig.user_inputs.index(nm)) for nm in i_order]
    if len(expected) != len(grad_nodes):
        raise BuildError(f"joint graph has {len(grad_nodes)} gradient outputs, expected {len(expected)}")
    for g, exp in zip(grad_nodes, expected):
        name = getattr(g, "name", None)
        if name in bw.gradients_to_parameters and exp[0] == "param" and \
                list(bw.gradients_to_parameters).count(name) == 1:
            got = _strip(bw.gradients_to_parameters[name])
            if got != exp[1]:
                raise BuildError(f"gradient output {name} is for {got}, expected {exp[1]}")
        grads.append(exp)
    placeholders = _rename_placeholders(phs, placeholders, input_names)
    loss_index = 0  # _TupleOut put it first
    loss = user_outputs[loss_index]
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    out_node.args = (tuple(user_outputs + updates + grad_nodes),)  # ours: (*user_outputs, *updates, *grads)
    tangent, mode = _insert_tangent(gm, loss, user_outputs, grad_nodes)
    placeholders.append((tangent.name, "tangent", None))
    graph.eliminate_dead_code()
    placeholders = _lift_constants(gm, placeholders, buffer_names, weights)
    from ..export.checks import drop_metadata_checks

    drop_metadata_checks(gm)
    rewrite_fallback_experts(gm)  # transformers' float32 grouped experts and their backward (export/experts.py)
    _realify(gm, placeholders, weights)  # complex values as real pairs (export/complex.py)
    _simplify_masks(gm, placeholders, weights, set(mutated))
    placeholders = _fold(gm, placeholders, param_names, buffer_names, weights, set(mutated))
    _cse(graph)
    sums = merge_product_sums(gm)
    tied = fuse_tied_embedding_grads(gm)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()

    ph_by_name = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    input_ph = {ref: name for name, kind, ref in placeholders if kind == "input"}
    specs = [InputSpec.of(input_ph[idx], ph_by_name[input_ph[idx]], t) for idx, t in enumerate(example_inputs)]
    return JointGraph(gm=gm, param_names=tuple(param_names), buffer_names=tuple(buffer_names), weights=weights,
                      inputs=tuple(specs), grads=tuple(grads), placeholders=tuple(placeholders),
                      num_user_outputs=n_user, loss_index=loss_index, tangent=tangent.name, tangent_mode=mode,
                      seconds=time.perf_counter() - t0,
                      call=call_inputs(len(args), kw_tensors, kw_consts),
                      outputs_tree=output_structure(wrapped.out_spec), loss_leaf=wrapped.loss_leaf,
                      decisions=tuple(attention.decisions), mutated_buffers=tuple(mutated),
                      product_sums=tuple(sums), tied_embeddings=tuple(tied))
