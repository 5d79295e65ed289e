"""--train, the partition stage's output: the forward and backward FX graphs as two CapturedGraphs for the
scheduler, and the train info the runtime needs to bind them (parameters, gradients, saved tensors).

Forward program inputs: the trainable parameters, then the user inputs (non-trainable buffers are
archive weights). Its outputs: the loss, then the tensors saved for the backward. Backward program
inputs: the saved tensors, then the tangent (d loss); outputs: the gradients in `joint.grads` order.
Parameters are program inputs, not baked weights, so an optimizer that updates them (or a
load_state_dict that replaces them) is seen on the next call.
"""
from __future__ import annotations

from ..contract.manifest import TrainInfo
from ..errors import BuildError
from ..export import CapturedGraph, InputSpec


def _placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _spec(node, name: str) -> InputSpec:
    val = node.meta["val"]
    kind = "bool" if val.dtype.is_floating_point is False and str(val.dtype) == "torch.bool" else (
        "float" if val.dtype.is_floating_point else "int")
    return InputSpec(name, tuple(int(s) for s in val.shape), val.dtype, kind)


def train_graphs(joint, part):
    n_p, n_b = len(joint.param_names), len(joint.buffer_names)
    fph = _placeholders(part.fwd_gm)
    if len(fph) != n_p + n_b + len(joint.inputs):
        raise BuildError(f"forward graph has {len(fph)} placeholders; expected params+buffers+inputs = "
                         f"{n_p}+{n_b}+{len(joint.inputs)}")
    placeholders = []
    for i, node in enumerate(fph):
        if i < n_p:
            placeholders.append((node.name, "input", i))
        elif i < n_p + n_b:
            placeholders.append((node.name, "weight", joint.buffer_names[i - n_p]))
        else:
            placeholders.append((node.name, "input", i - n_b))
    fwd_specs = tuple(_spec(fph[i], f"param:{joint.param_names[i]}") for i in range(n_p)) + tuple(joint.inputs)
    buffers = {b: joint.weights[b] for b in joint.buffer_names}
    fwd = CapturedGraph(part.fwd_gm, tuple(placeholders), buffers, fwd_specs, False, 0.0)
    bph = _placeholders(part.bwd_gm)
    bwd_specs = tuple(_spec(n, n.name) for n in bph)
    bwd = CapturedGraph(part.bwd_gm, tuple((n.name, "input", i) for i, n in enumerate(bph)), {}, bwd_specs,
                        False, 0.0)
    info = TrainInfo(params=tuple(joint.param_names), buffers=tuple(joint.buffer_names),
                     user_inputs=tuple(s.to_contract() for s in joint.inputs),
                     grads=tuple((str(k), ref) for k, ref in joint.grads), n_saved=len(bph) - 1,
                     saved_bytes=int(part.saved_bytes))
    return fwd, bwd, info
