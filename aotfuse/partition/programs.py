"""--train, the partition stage's output: the forward and backward FX graphs as two CapturedGraphs for the
scheduler (or, for a fused step, the one stitched graph: partition/step.py), and the train info the runtime
needs to bind them (parameters, gradients, saved tensors).

Forward program inputs: the trainable parameters, then the buffers the forward updates (train-mode
BatchNorm's running statistics, `TrainInfo.mutated_buffers`), then the user inputs (the other
buffers are archive weights). Its outputs: the loss, then the buffers' new values (the runtime
writes them into the module's buffers), then the tensors saved for the backward. Backward program
inputs: the saved tensors, then the tangent (d loss); outputs: the gradients in `joint.grads` order.
Parameters and updated buffers are program inputs, not baked weights, so an optimizer that updates
them (or a load_state_dict that replaces them), and the previous call's statistics, are seen on the
next call.
"""
from __future__ import annotations

import dataclasses

from ..contract.manifest import TrainInfo
from ..errors import BuildError
from ..export import CapturedGraph, InputSpec
from ..ir.sizes import sizes


def _placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _spec(node, name: str) -> InputSpec:
    val = node.meta["val"]
    kind = "bool" if val.dtype.is_floating_point is False and str(val.dtype) == "torch.bool" else (
        "float" if val.dtype.is_floating_point else "int")
    return InputSpec(name, sizes(val.shape), val.dtype, kind)  # ints, or expressions of the dims


def _param_spec(node, name: str) -> InputSpec:
    """A parameter's spec: with its strides when its value is channels-last (a CNN's conv filter after
    model.to(memory_format=torch.channels_last)), so the programs read it in place and cuDNN converts
    nothing (ResNet-18 training: 33 conversions, 139 us per step on an H100, when they were row-major)."""
    from ..layouts import channels_last_perm

    spec = _spec(node, name)
    val = node.meta["val"]
    if channels_last_perm(val) is not None and all(type(d) is int for d in val.shape):
        return dataclasses.replace(spec, stride=tuple(int(st) for st in val.stride()))
    return spec


def _physical(val):
    """The permutation that puts a dense, non-contiguous tensor's dims in memory order (its permute by it
    is contiguous), or None for a contiguous tensor or one no permutation makes contiguous."""
    import torch

    if not isinstance(val, torch.Tensor) or val.dim() < 2 or val.is_contiguous():
        return None
    perm = sorted(range(val.dim()), key=lambda d: (-val.stride(d), d))
    return perm if val.permute(perm).is_contiguous() else None


def _layout_kept(node) -> bool:
    """Whether the lowering keeps this node's FX layout: an extern's result (through getitem), whose
    kernel writes the strides its meta says, or a channels-last pointwise result or an attention operand stored
    [B, T, H, E] (aotfuse/layouts.py).
    Any other pointwise or reduction result is laid out row-major whatever strides the FX trace gave it."""
    import operator

    from ..layouts import attention_perm, channels_last_perm, node_layout
    from ..lower.registry import registry
    from ..runtime.externs import keep_whole

    if getattr(node, "op", None) != "call_function":
        return False
    if node.target is not operator.getitem:
        info = registry().get(node.target)
        if info is not None and info.category == "pointwise" and (channels_last_perm(node.meta.get("val"))
                                                                  or attention_perm(node)):
            return True
    else:
        node = node.args[0]
        # a result of a pointwise node of several results stored in the layout they share
        # (layouts.node_layout: max_pool2d_with_indices' values and indices)
        info = registry().get(getattr(node, "target", None))
        if info is not None and info.category == "pointwise" and node_layout(node.meta.get("val")) is not None:
            return True
    return getattr(node, "target", None) in keep_whole(train=True)


def _saved_in_memory_order(fwd_gm, bwd_gm, n_user: int, strided_inputs: frozenset = frozenset()) -> list:
    """Saved tensors cross from the forward program to the backward as contiguous buffers (lowering
    copies any that is not: CapturedGraph.contiguous_outputs). An extern result whose layout is a
    permutation (fused attention's out, stored [B, T, H, E] for the [B, H, T, E] result) is returned
    permuted into memory order (a free view in the forward) and permuted back in the backward (a
    view), so nothing is copied. So is a user input read in place with its own layout (`strided_inputs`:
    placeholder names of channels-last inputs, InputSpec.stride). Returns the (saved index, permutation)
    pairs."""
    import torch

    aten = torch.ops.aten
    out = next(n for n in reversed(fwd_gm.graph.nodes) if n.op == "output")
    outs = list(out.args[0])
    bph = _placeholders(bwd_gm)
    done = []
    for i, ph in enumerate(bph[:len(outs) - n_user]):
        node = outs[n_user + i]
        if not (_layout_kept(node) or getattr(node, "name", None) in strided_inputs):
            continue  # our lowering lays it out row-major: its permutation would be a copy, not a view
        val = getattr(node, "meta", {}).get("val")
        perm = _physical(val)
        if perm is None or _physical(ph.meta.get("val")) != perm:
            continue
        with fwd_gm.graph.inserting_before(out):
            fp = fwd_gm.graph.call_function(aten.permute.default, (node, perm))
        fp.meta["val"] = val.permute(perm)
        outs[n_user + i] = fp
        inverse = [perm.index(d) for d in range(len(perm))]
        logical = ph.meta["val"]
        ph.meta["val"] = logical.permute(perm)
        ph.meta.pop("tensor_meta", None)
        with bwd_gm.graph.inserting_after(ph):
            bp = bwd_gm.graph.call_function(aten.permute.default, (ph, inverse))
        bp.meta["val"] = logical
        ph.replace_all_uses_with(bp, delete_user_cb=lambda u: u is not bp)
        done.append((i, perm))
    if done:
        out.args = (tuple(outs),)
        for gm in (fwd_gm, bwd_gm):
            gm.graph.lint()
            gm.recompile()
    return done


def _forward_placeholders(joint, fph) -> list[tuple[str, str, object]]:
    """(name, kind, ref) per forward placeholder: parameters are program inputs 0..P-1, the buffers the
    forward updates inputs P..P+M-1 (in `mutated_buffers` order), the user inputs after them; the other
    buffers are archive weights."""
    kinds = joint.placeholder_kinds()
    n_p, n_m = len(joint.param_names), len(joint.mutated_buffers)
    param_index = {f: i for i, f in enumerate(joint.param_names)}
    mut_index = {f: i for i, f in enumerate(joint.mutated_buffers)}
    out = []
    for node in fph:
        kind, ref = kinds.get(node.name, (None, None))
        if kind == "param":
            out.append((node.name, "input", param_index[ref]))
        elif kind == "buffer" and ref in mut_index:
            out.append((node.name, "input", n_p + mut_index[ref]))
        elif kind == "buffer":
            out.append((node.name, "weight", ref))
        elif kind == "input":
            out.append((node.name, "input", n_p + n_m + ref))
        else:
            raise BuildError(f"forward graph placeholder {node.name} is not a parameter, buffer or input of the joint graph")
    return out


def _forward_inputs(joint, gm):
    """(placeholders, input specs, baked buffers) of a program that takes the forward's inputs: the
    trainable parameters, the buffers the forward updates, then the user inputs."""
    n_p, n_b = len(joint.param_names), len(joint.buffer_names)
    mutated = tuple(joint.mutated_buffers)
    fph = _placeholders(gm)
    if len(fph) != n_p + n_b + len(joint.inputs):
        raise BuildError(f"forward graph has {len(fph)} placeholders; expected params+buffers+inputs = "
                         f"{n_p}+{n_b}+{len(joint.inputs)}")
    placeholders = _forward_placeholders(joint, fph)
    by_input = {ref: node for node, (_, kind, ref) in zip(fph, placeholders) if kind == "input"}
    specs = tuple(_param_spec(by_input[i], f"param:{joint.param_names[i]}") for i in range(n_p))
    specs += tuple(_spec(by_input[n_p + j], f"buffer:{fqn}") for j, fqn in enumerate(mutated))
    specs += tuple(joint.inputs)
    buffers = {b: joint.weights[b] for b in joint.buffer_names if b not in mutated}
    return tuple(placeholders), specs, buffers, by_input


def _train_info(joint, buffers, n_saved: int, saved_bytes: int, specs, mode: str = "split") -> TrainInfo:
    strides = tuple(sp.stride for sp in specs[:len(joint.param_names)])
    return TrainInfo(params=tuple(joint.param_names), buffers=tuple(buffers),
                     user_inputs=tuple(s.to_contract() for s in joint.inputs),
                     grads=tuple((str(k), ref) for k, ref in joint.grads), n_saved=n_saved,
                     saved_bytes=int(saved_bytes), mutated_buffers=tuple(joint.mutated_buffers), mode=mode,
                     param_strides=strides if any(st is not None for st in strides) else ())


def grad_layouts(joint, specs, first: int, grads: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    """{output index: strides}: the outputs of a program (from `first` on, the gradients `grads`, indices into
    joint.grads, in order) that are gradients of a parameter with a non-row-major layout, which they keep."""
    stride_of = {name: sp.stride for name, sp in zip(joint.param_names, specs) if sp.stride is not None}
    out = {}
    for k, gi in enumerate(grads):
        kind, ref = joint.grads[gi]
        if str(kind) == "param" and ref in stride_of:
            out[first + k] = stride_of[ref]
    return out


_VIEWS = ("view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
          "alias", "slice", "select", "as_strided", "detach", "narrow", "unflatten", "flatten", "split",
          "split_with_sizes", "unbind", "chunk", "view_as", "expand_as", "contiguous")


def _saved_params(joint, fwd_gm, by_input) -> dict[int, int]:
    """Saved index -> index into `joint.grads` of the parameter that saved tensor is (or is a view of: the
    backward reads the parameter's own storage). A staged backward hands that gradient over only after every
    read of the saved tensor, so an optimizer step in a gradient hook never changes what a later stage reads."""
    import operator

    grad_of = {ref: i for i, (kind, ref) in enumerate(joint.grads) if str(kind) == "param"}
    param_of = {by_input[i]: name for i, name in enumerate(joint.param_names)}
    out_node = next(n for n in reversed(fwd_gm.graph.nodes) if n.op == "output")
    saved = list(out_node.args[0])[joint.num_forward_outputs:]
    pinned = {}
    for i, node in enumerate(saved):
        while getattr(node, "op", None) == "call_function" and (
                node.target is operator.getitem or getattr(node.target, "__name__", "").split(".")[0] in _VIEWS):
            node = node.args[0]
        name = param_of.get(node)
        if name is not None and name in grad_of:
            pinned[i] = grad_of[name]
    return pinned


def train_graphs(joint, part, stages: int = 1):
    """(forward, [backward stage, ...], train info, staging): one backward graph, or `stages` of them
    (partition/stages.py) for a data-parallel wrapper to get gradients while the backward runs."""
    from .stages import stage_backward

    placeholders, fwd_specs, buffers, by_input = _forward_inputs(joint, part.fwd_gm)
    first_user = len(joint.param_names) + len(joint.mutated_buffers)
    strided = frozenset(by_input[first_user + j].name for j, spec in enumerate(joint.inputs) if spec.stride is not None)
    strided |= frozenset(by_input[i].name for i, sp in enumerate(fwd_specs[:len(joint.param_names)])
                         if sp.stride is not None)
    _saved_in_memory_order(part.fwd_gm, part.bwd_gm, joint.num_forward_outputs, strided)
    fwd = CapturedGraph(part.fwd_gm, placeholders, buffers, fwd_specs, False, 0.0, contiguous_outputs=True,
                        **_dims(joint))
    n_saved = len(_placeholders(part.bwd_gm)) - 1
    pinned = _saved_params(joint, part.fwd_gm, by_input) if stages > 1 else {}
    staging = stage_backward(part.bwd_gm, min(stages, 7), pinned)  # manifest: at most 8 programs
    bwds = []
    per_stage = staging.stages if len(staging.graphs) > 1 else (tuple(range(len(joint.grads))),)
    for gm, grads in zip(staging.graphs, per_stage):
        bph = _placeholders(gm)
        specs = tuple(_spec(n, n.name) for n in bph)
        bwds.append(CapturedGraph(gm, tuple((n.name, "input", i) for i, n in enumerate(bph)), {}, specs,
                                  False, 0.0, contiguous_outputs=True,
                                  output_layouts=grad_layouts(joint, fwd_specs, 0, tuple(grads)), **_dims(joint)))
    info = _train_info(joint, buffers, n_saved, part.saved_bytes, fwd_specs)
    if len(bwds) > 1:
        info = dataclasses.replace(info, stages=staging.stages, carries=staging.carries)
    return fwd, bwds, info, staging


def step_graphs(joint, part):
    """The one program of a fused step (partition/step.py): the forward's inputs; the loss, the buffer
    updates and the gradients out. Its TrainInfo's scale_kernels are filled in by the pipeline."""
    from .step import step_graph

    gm = step_graph(part)
    placeholders, specs, buffers, _ = _forward_inputs(joint, gm)
    first = 1 + len(joint.mutated_buffers)  # the loss, the buffer updates, then the gradients
    step = CapturedGraph(gm, placeholders, buffers, specs, False, 0.0, contiguous_outputs=True,
                         output_layouts=grad_layouts(joint, specs, first, tuple(range(len(joint.grads)))),
                         **_dims(joint))
    return step, _train_info(joint, buffers, 0, 0, specs, mode="step")


def _dims(joint) -> dict:
    """A program's dynamic dims: the joint trace's (every program of a step runs at the forward's dims)."""
    return {"dims": joint.dims, "symmap": joint.symmap, "shape_env": joint.shape_env} if joint.dims else {}
