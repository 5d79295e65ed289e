"""torch.export capture: module + example inputs -> core-ATen FX graph, weights, input specs."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.fx

from ..contract.manifest import InputSpec as ContractInputSpec
from ..layouts import channels_last_perm
from ..dtypes import input_kind
from ..errors import BuildError
from .decomp import decomposition_table
from .complex import as_real_weight, realify
from .experts import rewrite_fallback_experts
from .mm_gelu import decompose
from .checks import drop_metadata_checks
from .fold import fold_unlowerable_constants, lowerable_ops
from .masks import simplify_attention_masks
from .ranges import int_range
from .dynamic import export_spec, read_dims
from ..ir.sizes import foreign_symbols, sizes


@dataclasses.dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # "float" | "int" | "bool"
    low: int | None = None  # for int inputs: the valid value range [low, high)
    high: int | None = None
    stride: tuple[int, ...] | None = None  # a dense non-row-major layout (channels-last) read in place

    def to_contract(self) -> ContractInputSpec:
        """The manifest's form (dtype spelled as torch prints it, "torch.float32"; a dynamic dim by its
        symbol's name, "s0")."""
        shape = tuple(s if isinstance(s, int) else str(s) for s in self.shape)
        return ContractInputSpec(self.name, shape, str(self.dtype), self.kind, self.low, self.high, self.stride)

    @classmethod
    def of(cls, name: str, ph: torch.fx.Node, t: torch.Tensor) -> "InputSpec":
        """The spec of example input `t` at placeholder `ph` (exported or joint graph alike). An example
        laid out channels-last fixes that layout: the archive reads it in place and its guard asks for
        it; any other example layout means a contiguous input."""
        kind = input_kind(t.dtype)
        lo, hi = int_range(ph, t) if kind == "int" else (None, None)
        stride = None
        if channels_last_perm(t) is not None:  # other permutations (x.t()) mean a contiguous input, as before
            stride = tuple(int(s) for s in t.stride())
        return cls(name, tuple(t.shape), t.dtype, kind, lo, hi, stride)


@dataclasses.dataclass(frozen=True)
class CapturedGraph:
    """The export stage's value: an FX graph in core ATen plus what its placeholders mean."""

    gm: torch.fx.GraphModule
    # placeholder name -> ("weight", fqn) | ("input", index)
    placeholders: tuple[tuple[str, str, Any], ...]
    weights: dict[str, torch.Tensor]  # fqn -> tensor (parameters, buffers, lifted constants)
    inputs: tuple[InputSpec, ...]
    single_output: bool
    seconds: float
    # How the model is called and what it returns (see `call_structure` / `output_structure`):
    # {"positional": n, "keywords": [name, ...]}: the flat inputs are the n positional tensors, then the
    # keyword tensors in this order; `None` for graphs that are not a model's call (the backward).
    call: dict | None = None
    # {"kind": "tensor"} | {"kind": "tuple"|"list", "items": [...]} |
    # {"kind": "dict", "class": "module.QualName", "keys": [...], "items": [...]}: the model's output
    # as a tree whose leaves are the program's outputs in order (ModelOutput fields, dict keys, tuple).
    outputs_tree: dict | None = None
    # Program-to-program outputs (the training programs): every output is a dense row-major buffer,
    # because the program that reads it (the backward, or autograd's .grad) takes it as one. Lowering
    # copies an output whose view is not (lower/graph.py); an inference output may stay a strided view.
    contiguous_outputs: bool = False
    # ... except these outputs (index -> strides): gradients of parameters with a channels-last layout, kept
    # in it when the value already has it (partition/programs.grad_layouts)
    output_layouts: dict = dataclasses.field(default_factory=dict)
    # Dynamic dims (ir/sizes.Dim, symbols s0, s1, ...) and torch's size symbols -> ours (export/dynamic.py)
    dims: tuple = ()
    symmap: dict = dataclasses.field(default_factory=dict)
    shape_env: Any = None  # torch's ShapeEnv of the dynamic dims: a guard it gains while lowering is a specialization
    # What export decided that lowering's report records first (export/mm_gelu.py: GELUs fused into matmuls)
    decisions: tuple = ()


def _qualname(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def output_structure(spec) -> dict:
    """A pytree spec of the model's output as plain data (msgpack/JSON-able), leaves in flat order.

    Dicts and dict-like classes (transformers' ModelOutput, which registers itself as a pytree node
    keyed by its non-None fields) keep their class and keys so a runtime can rebuild an equivalent
    dict (or the class itself, where importable)."""
    if spec.is_leaf():
        return {"kind": "tensor"}
    items = [output_structure(c) for c in spec.children()]
    t = spec.type
    if t in (tuple, list):
        return {"kind": t.__name__, "items": items}
    if isinstance(spec.context, (list, tuple)) and all(isinstance(k, str) for k in spec.context) and \
            len(spec.context) == len(items):
        return {"kind": "dict", "class": _qualname(t), "keys": list(spec.context), "items": items}
    # a namedtuple (pytree's node type is collections.namedtuple, the class its context), or a structseq
    # such as torch.return_types.max (its fields in __match_args__)
    import collections

    if t is collections.namedtuple and isinstance(spec.context, type):
        t = spec.context
    fields = None
    if isinstance(t, type) and issubclass(t, tuple):
        fields = getattr(t, "_fields", None) or getattr(t, "__match_args__", None)
    if fields and len(fields) == len(items):
        return {"kind": "dict", "class": _qualname(t), "keys": list(fields), "items": items}
    raise BuildError(f"the model returns a {_qualname(t)}, whose structure cannot be recorded",
                     remedy="return a tensor, a tuple/list or a dict of tensors")


def _signature_order(model, kwargs: dict) -> dict:
    """kwargs in the order of the forward's parameters (then the rest as given): the order of the
    keyword inputs does not depend on how the caller happened to write the call."""
    import inspect

    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        names = []
    first = [k for k in names if k in kwargs]
    return {k: kwargs[k] for k in first + [k for k in kwargs if k not in first]}


def split_example(model, example_inputs, example_kwargs) -> tuple[tuple, dict, dict]:
    """Check the example call: (positional tensors, keyword tensors, keyword constants), keywords
    in the forward signature's order.

    Positional inputs must be tensors. Keyword values may be tensors (program inputs, named by the
    keyword) or constants (None, bool, int, float, str: specialized into the program, as torch.export does)."""
    args = tuple(example_inputs)
    for i, x in enumerate(args):
        if not isinstance(x, torch.Tensor):
            raise BuildError(f"example input {i} is a {type(x).__name__}; only tensors are supported",
                             remedy="pass non-tensor arguments by keyword (example_kwargs) or wrap them in the forward")
    tensors, consts = {}, {}
    for k, v in _signature_order(model, example_kwargs or {}).items():
        if isinstance(v, torch.Tensor):
            tensors[k] = v
        elif v is None or isinstance(v, (bool, int, float, str)):
            consts[k] = v
        else:
            raise BuildError(f"example keyword argument {k!r} is a {type(v).__name__}; only tensors and "
                             "None/bool/int/float/str constants are supported",
                             remedy="wrap structures in the model's forward")
    return args, tensors, consts


def call_inputs(positional: int, keywords, constants: dict) -> dict:
    """The manifest's `call.inputs`: the positional count, the keyword tensors' names in program order, and the
    keyword constants baked into the program (`constants`, written only when there are any: a call may pass
    them again with the same values, runtime/calling.flatten)."""
    from ..runtime.calling import plain_constant

    out = {"positional": positional, "keywords": list(keywords)}
    if constants:
        out["constants"] = {k: plain_constant(v) for k, v in constants.items()}
    return out


def capture(model: torch.nn.Module, example_inputs: tuple = (), *, example_kwargs: dict | None = None,
            train: bool = False, dynamic: tuple = ()) -> CapturedGraph:
    """Export `model(*example_inputs, **example_kwargs)`. Program inputs: the positional tensors, then
    the keyword tensors in the order `CapturedGraph.call` records (the order torch.export flattens them).
    dynamic: DynamicDim requests (export/dynamic.py, checked): those axes stay symbolic."""
    t0 = time.perf_counter()
    example_inputs, kw_tensors, kw_consts = split_example(model, example_inputs, example_kwargs)
    kwargs = {**kw_tensors, **kw_consts}
    dyn_spec = export_spec(model, dynamic, len(example_inputs), list(kw_tensors)) if dynamic else None
    if dyn_spec is not None and kw_consts:
        dyn_spec.update({k: None for k in kw_consts})
    try:
        try:
            ep = torch.export.export(model, example_inputs, kwargs or None, strict=False, dynamic_shapes=dyn_spec)
        except Exception as exc:
            if not dynamic or "Constraints violated" not in str(exc):
                raise
            # named Dims must name equal axes alike; let torch find the relations (export/dynamic.py)
            dyn_spec = export_spec(model, dynamic, len(example_inputs), list(kw_tensors), hints=True)
            if kw_consts:
                dyn_spec.update({k: None for k in kw_consts})
            ep = torch.export.export(model, example_inputs, kwargs or None, strict=False, dynamic_shapes=dyn_spec)
        # a tanh GELU of a matmul's result becomes one extern with it (export/mm_gelu.py)
        ep, export_decisions = decompose(ep, decomposition_table())
        rewrite_fallback_experts(ep.graph_module)  # transformers' float32 grouped experts (export/experts.py)
    except Exception as exc:  # torch raises many types here; name the stage and the cause
        from ..joint.trace import data_dependent_error

        dd = data_dependent_error(exc, "torch.export")
        if dd is not None:
            raise dd from exc
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        why = lines[0] if lines else ""
        if dynamic and "Constraints violated" in why:  # say which dim and why: torch's next lines tell
            why += " " + " ".join(ln for ln in lines[1:] if "specializ" in ln or "must" in ln or "equal" in ln)[:400]
        raise BuildError(f"torch.export failed: {type(exc).__name__}: {why}",
                         remedy="check that the model exports with torch.export.export(model, inputs)" + (
                             "; with dynamic dims, mark every input axis that must equal a dynamic one dynamic too"
                             if dynamic else "")) from exc
    complex_phs = realify(ep.graph_module)  # complex values as real pairs (export/complex.py)
    env0 = _shape_env_of(ep) if dynamic else None
    n_guards = len(env0.guards) if env0 is not None else 0
    sig = ep.graph_signature
    written = list((getattr(sig, "user_inputs_to_mutate", None) or {}).values())
    if written:  # the archive has no output for the caller's tensor: refused, as in training (joint/trace.py)
        raise BuildError(f"the forward writes into its input(s) {', '.join(map(repr, written))} in place",
                         remedy="compute on a copy (x = x.clone(), or an out-of-place op) instead of updating the "
                                "caller's tensor")
    kinds = torch.export.graph_signature.OutputKind
    updated = [(s.kind, s.target) for s in sig.output_specs if s.kind in (kinds.BUFFER_MUTATION, kinds.PARAMETER_MUTATION)]
    if updated:  # the program would return them as extra outputs the call's structure has no place for
        what = ", ".join(f"{'parameter' if k == kinds.PARAMETER_MUTATION else 'buffer'} {t!r}" for k, t in updated[:4])
        raise BuildError(f"the forward updates {what}{' and more' if len(updated) > 4 else ''} in place: an inference "
                         "archive's weights and buffers are fixed",
                         remedy="an update made once (RWKV rescales its weights on its first call in eval mode): run "
                                "one forward before building; a state updated on every call (a static KV cache, "
                                "BatchNorm statistics) is not supported in an inference archive (train-mode buffers: "
                                "build with --train)")
    state = dict(ep.state_dict)
    state.update(ep.constants)
    for ph in complex_phs:  # a complex buffer (a rotary embedding's rotations) stored as its real pairs
        fqn = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}.get(ph)
        if fqn is None:
            raise BuildError(f"input {ph!r} is complex: complex inputs are not supported",
                             remedy="pass torch.view_as_real(x) and call torch.view_as_complex in the model")
        state[fqn] = as_real_weight(state[fqn])
    # Constant subgraphs lowering has no rule for (the causal mask's cumsum/index on arange ids; BERT's
    # gather of its token-type buffer) are evaluated now: buffers are fixed in an inference archive.
    fixed = {ph: state[fqn] for ph, fqn in {**sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}.items()}
    # Masks transformers materializes under tracing (all-true, causal) become flags first, so that their
    # constant subgraphs die instead of being folded into stored weights.
    drop_metadata_checks(ep.graph_module)  # (export/checks.py: the dead code they kept alive goes with them)
    simplify_attention_masks(ep.graph_module, seeds=fixed)
    folded = fold_unlowerable_constants(ep.graph_module, lowerable_ops(), seeds=fixed)
    if env0 is not None and len(env0.guards) != n_guards:
        raise BuildError("dynamic dims: folding the model's constant subgraphs (an attention mask built from "
                         f"positions, say) would fix a dynamic dim ({', '.join(str(g.expr) for g in env0.guards[n_guards:][:3])})",
                         remedy="not supported yet for this model: build with static shapes, or keep that dim static")
    folded_fqn = {name: fqn for name, fqn, _ in folded}
    state.update({fqn: val for _, fqn, val in folded})
    ph_map: dict[str, Any] = {}
    ph_map.update({k: v for k, v in sig.inputs_to_parameters.items()})
    ph_map.update({k: v for k, v in sig.inputs_to_buffers.items()})
    ph_map.update({k: v for k, v in sig.inputs_to_lifted_tensor_constants.items()})
    user_inputs = [s.arg.name for s in sig.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT
                   and isinstance(s.arg, torch.export.graph_signature.TensorArgument)]
    # the flat tensor inputs in export's order: positional, then keywords as its in_spec lists them
    in_spec = ep.call_spec.in_spec
    kw_order = [k for k in (in_spec.child(1).context if in_spec.num_children > 1 else []) if k in kw_tensors]
    flat_inputs = list(example_inputs) + [kw_tensors[k] for k in kw_order]
    if len(flat_inputs) != len(user_inputs):
        raise BuildError(f"torch.export kept {len(user_inputs)} tensor inputs, expected {len(flat_inputs)}")
    const_inputs = {s.arg.name for s in sig.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT
                    and not isinstance(s.arg, torch.export.graph_signature.TensorArgument)}
    dead: list = []
    placeholders = []
    weights = {}
    ph_by_name = {}
    for node in ep.graph_module.graph.nodes:
        if node.op != "placeholder":
            continue
        ph_by_name[node.name] = node
        if node.name in ph_map or node.name in folded_fqn:
            fqn = ph_map.get(node.name) or folded_fqn[node.name]
            w = state[fqn].detach()
            # a channels-last weight keeps its layout: an inference archive stores it so (lower/graph.py)
            weights[fqn] = w if channels_last_perm(w) is not None else w.contiguous()
            placeholders.append((node.name, "weight", fqn))
        elif node.name in user_inputs:
            placeholders.append((node.name, "input", user_inputs.index(node.name)))
        elif node.name in const_inputs and not node.users:
            dead.append(node)  # a keyword constant (flag=True): specialized, its placeholder unused
            continue
        else:
            raise BuildError(f"placeholder {node.name} is neither a user input nor a weight")
    for node in dead:
        ep.graph_module.graph.erase_node(node)
    if dead:
        ep.graph_module.recompile()
    dims, symmap = (), {}
    if dynamic:
        names = _flat_names(model, len(example_inputs), kw_order)
        dims, symmap = read_dims([ph_by_name[n] for n in user_inputs], flat_inputs, names, dynamic,
                                 ep.range_constraints)
    specs = [InputSpec.of(name, ph_by_name[name], flat_inputs[idx]) for idx, name in enumerate(user_inputs)]
    if dims:
        with foreign_symbols(symmap):
            specs = [dataclasses.replace(sp, shape=sizes(ph_by_name[sp.name].meta["val"].shape)) for sp in specs]
        if any(sp.stride is not None and not all(isinstance(s, int) for s in sp.shape) for sp in specs):
            raise BuildError("a channels-last input with dynamic dims is not supported yet",
                             remedy="pass it contiguous, or keep its dims static")
    out_spec = ep.call_spec.out_spec
    single = out_spec is not None and out_spec.num_leaves == 1 and out_spec.type not in (tuple, list)
    return CapturedGraph(ep.graph_module, tuple(placeholders), weights, tuple(specs), single,
                         time.perf_counter() - t0, call=call_inputs(len(example_inputs), kw_order, kw_consts),
                         outputs_tree=output_structure(out_spec) if out_spec is not None else None,
                         dims=dims, symmap=symmap, shape_env=env0 if dims else None,
                         decisions=tuple(export_decisions))


def _shape_env_of(ep):
    """torch's ShapeEnv of an export with dynamic dims (the one every SymInt of the graph belongs to)."""
    for node in ep.graph_module.graph.nodes:
        if node.op == "placeholder":
            for s in getattr(node.meta.get("val"), "shape", ()):
                if isinstance(s, torch.SymInt):
                    return s.node.shape_env
    return None


def _flat_names(model, n_pos: int, kw_order) -> list[str]:
    from .dynamic import _input_names

    return _input_names(model, n_pos, list(kw_order))
