"""--train with a scalar loss: the forward and the backward stitched into ONE program, "step".

Why it is exact: a backward is linear in the loss's gradient `g` (every gradient is `g` times the
gradient for `g = 1`). So the step program runs the forward and then the backward with `g = 1` in
one program, and returns the loss and every gradient; the runtime's backward multiplies them in
place by the `g` autograd hands it, with a kernel that does nothing when `g` is 1 (a plain
`loss.backward()`), so the usual step costs no extra pass (runtime/training.py).

What it buys over two programs:
- nothing crosses from forward to backward: the values the backward reads are the program's own
  intermediates, planned in one arena with the rest, freed at their last use (no saved set held
  between the calls, no bit-packing, no copies into memory order; a view the split partition saves as a
  dense copy, `partition_view_copies`, is still copied here, the copy freed at its last use);
- fusion sees both halves: a loss's forward and backward share kernels (cross-entropy's logsumexp
  and its gradient read the logits in one pass; a norm's statistics and its gradient likewise).
The min cut still decides what the backward half recomputes rather than keeps (its memory trade-off
is the same: a kept value lives from its forward producer to its last backward use).

Conditions (`step_mode`): the caller asked for it (`step="auto"` or `"step"`; the default,
knobs.train_step, is "split": measured on an H100 the fused step wins where a loss's forward and
backward share a large input, but not yet on a whole GPT step, knobs.py has the figures) and the loss
has one element (the scaling kernel reads one value). Costs, documented for users: a forward whose
loss is never backpropagated (an evaluation under grad mode, or under no_grad with a train archive)
still computes the gradients; a second backward through the same forward is refused (the gradients
were handed over to autograd by the first); communication cannot overlap a backward that already ran
inside the forward (DDP all-reduces after the step's program).
"""
from __future__ import annotations

import torch

from ..errors import BuildError
from ..packops import PACK, POOL_INDICES, POOL_OFFSETS, UNPACK

STEP_MODES = ("auto", "step", "split")


def step_mode(joint, want: str = "auto") -> tuple[str, str]:
    """("step" | "split", why) for this joint graph and the caller's choice."""
    if want not in STEP_MODES:
        raise BuildError(f"step={want!r} is not one of {', '.join(STEP_MODES)}",
                         remedy="step='auto' (one program when the loss is a scalar), 'step' or 'split'")
    tangent = next(n for n in joint.gm.graph.nodes if n.op == "placeholder" and n.name == joint.tangent)
    val = tangent.meta.get("val")
    numel = val.numel() if isinstance(val, torch.Tensor) else 0
    if want == "split":
        return "split", "two programs (forward, backward): step='split' (the default; 'auto' fuses a scalar loss's step)"
    if numel != 1:
        why = (f"the loss has {numel} elements (shape {list(getattr(val, 'shape', ()))}): one program needs a "
               "scalar loss, whose gradient scales every gradient")
        if want == "step":
            raise BuildError(f"step='step' needs a scalar loss: {why}", remedy="reduce the loss to one element, "
                             "or build with step='split'")
        return "split", why
    dynamic = [n.name for n in joint.grad_output_nodes if isinstance(n, torch.fx.Node) and
               any(isinstance(d, torch.SymInt) for d in getattr(n.meta.get("val"), "shape", ()))]
    if dynamic:
        why = (f"gradient(s) of a dynamic shape ({', '.join(dynamic[:3])}: an input's): the fused step's in-place "
               "scaling kernels are sized at build time")
        if want == "step":
            raise BuildError(f"step='step' with dynamic dims: {why}", remedy="build with step='split' (or 'auto')")
        return "split", why
    return "step", ("the loss is a scalar: forward and backward run as one program with loss gradient 1; "
                    "the backward scales the gradients in place by the actual one (nothing when it is 1)")


def step_graph(part) -> torch.fx.GraphModule:
    """The partition's forward graph followed by its backward graph in one graph: the backward's saved
    placeholders become the forward's values, its tangent a constant 1. Outputs: the forward's user
    outputs and buffer updates, then the gradients. Placeholders: the forward's, in order."""
    aten = torch.ops.aten
    g = torch.fx.Graph()
    env: dict = {}
    fout = None
    for n in part.fwd_gm.graph.nodes:
        if n.op == "output":
            fout = n
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
    if fout is None:
        raise BuildError("the partition's forward graph has no output")
    fouts = [env[o] if isinstance(o, torch.fx.Node) else o for o in fout.args[0]]
    n_fwd = part.num_forward_outputs
    bph = [n for n in part.bwd_gm.graph.nodes if n.op == "placeholder"]
    saved = fouts[n_fwd:]
    if len(bph) != len(saved) + 1:
        raise BuildError(f"the backward graph takes {len(bph)} inputs; expected the {len(saved)} saved tensors "
                         "and the loss gradient")
    benv = dict(zip(bph[:-1], saved))
    tangent = bph[-1]
    tval = tangent.meta["val"]
    one = g.create_node("call_function", aten.full.default, ([int(s) for s in tval.shape], 1.0),
                        {"dtype": tval.dtype}, name="loss_grad_one")
    one.meta["val"] = tval
    benv[tangent] = one
    bout = None
    for n in part.bwd_gm.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            bout = n
            continue
        benv[n] = g.node_copy(n, lambda a: benv[a])
    grads = [benv[o] if isinstance(o, torch.fx.Node) else o for o in bout.args[0]]
    g.output(tuple(fouts[:n_fwd] + grads))
    _drop_crossing_ops(g)
    g.eliminate_dead_code()
    g.lint()
    return torch.fx.GraphModule(part.fwd_gm, g, class_name="AotfuseStep")


def _drop_crossing_ops(g: torch.fx.Graph) -> None:
    """What only served the crossing between two programs: unpack(pack(v)) is v, as is
    pool_indices(pool_offsets(v)); the copy of a buffer the
    runtime overwrites after the forward (partition's "buffer_copy") is the buffer itself, which the step
    program never writes."""
    aten = torch.ops.aten
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target is UNPACK and isinstance(n.args[0], torch.fx.Node) and n.args[0].target is PACK:
            n.replace_all_uses_with(n.args[0].args[0])
        elif n.target is POOL_INDICES and isinstance(n.args[0], torch.fx.Node) and n.args[0].target is POOL_OFFSETS:
            n.replace_all_uses_with(n.args[0].args[0])
        elif (n.target is aten.copy.default and n.args[0] is n.args[1] and isinstance(n.args[0], torch.fx.Node)
              and n.args[0].op == "placeholder"):
            n.replace_all_uses_with(n.args[0])
