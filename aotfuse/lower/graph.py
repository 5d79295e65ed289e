"""lower: the captured FX graph -> LoopGraph (one node per computing op; views are index math)."""
from __future__ import annotations

import dataclasses

import operator

import torch
import torch.fx

from ..contract.manifest import same_layout
from ..errors import UnsupportedOpError
from ..export import CapturedGraph
from ..fxgraph import model_frames
from ..ir.loop import Extern, LoopGraph, OutputRef
from ..ir.views import View
from .ctx import LoweringCtx, dtype_name, out_shape
from ..layouts import CHANNELS_LAST, attention_perm, channels_last_perm, node_layout
from .extern import mm_residual
from .registry import registry
from .residual import sites as residual_sites
from .conv_layout import choose as conv_layout
from ..ir.sizes import DataDependentSize, current_dims, size, sizes


def _map_args(x, env):
    if isinstance(x, torch.fx.Node):
        return env[x]
    if isinstance(x, (list, tuple)):
        return type(x)(_map_args(a, env) for a in x)
    return x


def _is_const(x, consts) -> bool:
    if isinstance(x, torch.fx.Node):
        return x in consts
    if isinstance(x, (list, tuple)):
        return all(_is_const(a, consts) for a in x)
    return True


def lower(cg: CapturedGraph, program: str = "forward") -> tuple[LoopGraph, LoweringCtx]:
    """Lower one program's graph. Folded constants are named __const__.<program>.<buf> in the archive."""
    ctx = LoweringCtx()
    ctx.decisions.extend(dict(d) for d in cg.decisions)  # export's (a GELU fused into its matmul)
    env: dict[torch.fx.Node, object] = {}
    consts: dict[torch.fx.Node, torch.Tensor] = {}
    inputs, weights = [], []
    ph = {name: (kind, ref) for name, kind, ref in cg.placeholders}
    outputs = []
    const_id = 0
    rules = registry()
    # residual adds the matmul feeding them takes in its call (lower/residual.py): the matmul lowers with
    # its residual, the add is bound to the (reshaped) result
    cl_weights: set = set()
    if not cg.contiguous_outputs:  # inference: a half-precision CNN served NCHW runs its convs NHWC
        ctx.cl_nodes, cl_weights, cl_rec = conv_layout(cg.gm, cg.weights, cg.placeholders)
        if cl_rec is not None:
            ctx.decisions.append(cl_rec)
    fused, records = residual_sites(cg.gm)
    ctx.decisions.extend(records)
    fused_adds = {s.add: s.operand for s in fused.values()}
    for node in cg.gm.graph.nodes:
        if node.op == "placeholder":
            kind, ref = ph[node.name]
            val = node.meta["val"]
            dt = dtype_name(val.dtype, node.name)
            if kind == "weight":
                name = f"w{len(weights)}"
                perm = None if cg.contiguous_outputs else channels_last_perm(cg.weights.get(ref))
                if perm is None and ref in cl_weights:
                    perm = CHANNELS_LAST[len(val.shape)]
                if perm is not None:
                    # An inference archive stores a channels-last weight (a CNN's conv filters after
                    # model.to(memory_format=torch.channels_last)) in that order: the convolution reads it
                    # in place, where a row-major copy made cuDNN convert it on every call (ResNet-18:
                    # 17 copies, 71 us per call on an H100). The archive holds the permuted tensor.
                    stored = tuple(int(val.shape[p]) for p in perm)
                    ctx.add_buffer(name, stored, dt, "weight")
                    ctx.weight_perms[name] = perm
                    weights.append((name, ref))
                    env[node] = View.of_buffer(name, stored, dt).permute([perm.index(i) for i in range(len(perm))])
                    continue
                ctx.add_buffer(name, val.shape, dt, "weight")
                weights.append((name, ref))
            else:
                name = f"in{ref}"
                ctx.add_buffer(name, val.shape, dt, "input")
                inputs.append((ref, name))
                stride = getattr(cg.inputs[ref], "stride", None) if ref < len(cg.inputs) else None
                if stride is not None:  # a channels-last (dense, permuted) input, read in place
                    env[node] = View.strided(name, val.shape, stride, dt)
                    continue
            env[node] = View.of_buffer(name, val.shape, dt)
        elif node.op == "call_function":
            if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat)):  # a size of a dynamic dim (or a
                # ratio of sizes: BatchNorm's n / (n - 1)): its expression, a constant the kernels compute
                try:
                    env[node] = size(node.meta["val"])
                except DataDependentSize as exc:  # a count read off the data (an .item(), a nonzero's length)
                    raise UnsupportedOpError(str(node.target), node.name,
                                             f"a size that depends on the data ({exc}) {_where(node)}",
                                             remedy="keep every shape a function of the input shapes (a mask or "
                                                    "a where instead of selecting the rows the data picks)") from exc
                continue
            if node.target is operator.getitem:
                env[node] = env[node.args[0]][node.args[1]]
                if node.args[0] in consts:
                    consts[node] = consts[node.args[0]][node.args[1]]
                continue
            if rules.get(node.target) is None and isinstance(node.meta.get("val"), (tuple, list)):
                # a multi-output op with no rule: named as such, before an empty secondary output (EmbeddingBag's
                # offset2bag when the bags are given by offsets) could be blamed instead
                raise UnsupportedOpError(str(node.target), node.name, _where(node),
                                         remedy=KNOWN_REMEDIES.get(str(node.target)))
            empty = _empty_shape(node.meta.get("val"))
            if empty is not None:  # kernels index by division by sizes: an empty tensor has none to run
                if isinstance(node.meta.get("val"), torch.Tensor):
                    # nothing to compute; a concatenation leaves it out (a rotary embedding's empty pass-through
                    # half, Phi-3: q[..., rotary_dim:] with rotary_dim == head_dim, and its gradient's slice).
                    # An empty computed from an empty keeps the first one's op, which an error names.
                    src = next((env[a] for a in node.all_input_nodes if isinstance(env.get(a), Empty)), None)
                    env[node] = src or Empty(str(node.target), node.name, tuple(empty))
                    continue
                raise UnsupportedOpError(str(node.target), node.name, f"its result is empty (shape {empty})",
                                         remedy="leave the empty computation out of the model (zero-size tensors "
                                                "are not lowered)")
            reads = [a for a in node.all_input_nodes if isinstance(env.get(a), Empty)]
            if reads and node.target not in CATS:
                raise env[reads[0]].error(f"{node.name} ({node.target}) reads it")
            if node in fused:
                env[node] = mm_residual(ctx, node, _map_args(node.args, env), env[fused[node].residual])
                continue
            if node in fused_adds:
                env[node] = env[fused_adds[node]]
                continue
            info = rules.get(node.target)
            if info is None:
                raise UnsupportedOpError(str(node.target), node.name, _where(node),
                                         remedy=KNOWN_REMEDIES.get(str(node.target)))
            if info.category in ("pointwise", "view") and node.all_input_nodes \
                    and all(_is_const(a, consts) for a in node.args):
                # Depends only on folded values: fold at build time into a stored constant. Filled
                # tensors and ranges (category "constant") are NOT folded: they lower to index
                # expressions (Const, IndexValue) that cost no memory traffic and inline into their
                # readers; a folded arange(32000) was loaded from memory by every row of a
                # cross-entropy, 8 bytes per logit.
                val = node.target(*_map_args(node.args, consts), **_map_args(node.kwargs, consts))
                consts[node] = val
                if isinstance(val, torch.Tensor):
                    name = f"c{const_id}"
                    const_id += 1
                    val = val.detach().contiguous()
                    ctx.add_buffer(name, val.shape, dtype_name(val.dtype, node.name), "weight")
                    ctx.constants[name] = val
                    weights.append((name, f"__const__.{program}.{name}"))
                    env[node] = View.of_buffer(name, val.shape, dtype_name(val.dtype, node.name))
                    ctx.decisions.append({"folded": node.name, "into": name})
                    continue
            args = _map_args(node.args, env)
            kwargs = _map_args(dict(node.kwargs), env)
            if info.category == "pointwise":  # channels-last values stay channels-last (aotfuse/layouts.py)
                lay = node_layout(node.meta.get("val"))
                if lay is None and (perm := attention_perm(node)) is not None:
                    lay = (perm, tuple(node.meta["val"].shape))
                if lay is None and node in ctx.cl_nodes:
                    lay = (ctx.cl_nodes[node], tuple(node.meta["val"].shape))
                if lay is not None:
                    ctx.layout, ctx.layout_shape = lay[0], sizes(lay[1])
            guards = len(cg.shape_env.guards) if cg.shape_env is not None else 0
            try:
                env[node] = info.fn(ctx, node, args, kwargs)
                if cg.shape_env is not None and len(cg.shape_env.guards) != guards:
                    # the rule read a dynamic size as a Python int or bool: torch specialized it to the
                    # example's value (a wrong program at every other size): refuse, naming the op
                    new = cg.shape_env.guards[guards:]
                    raise UnsupportedOpError(str(node.target), node.name,
                                             f"its lowering would fix a dynamic dim to the example's size "
                                             f"({', '.join(str(g.expr) for g in new[:3])})",
                                             remedy="build with static shapes, or keep the dims this op sees static")
            except UnsupportedOpError:
                raise
            except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
                if current_dims() and any(not isinstance(d, int) for d in _shapes_of(node)):
                    raise UnsupportedOpError(str(node.target), node.name,
                                             f"not supported with dynamic dims yet (sizes {_shapes_of(node)}; "
                                             f"{type(exc).__name__}: {exc})",
                                             remedy="build with static shapes, or keep the dims this op sees static") from exc
                raise UnsupportedOpError(str(node.target), node.name,
                                         f"this form of the op cannot be lowered ({type(exc).__name__}: {exc})") from exc
            finally:
                ctx.layout = ctx.layout_shape = None
        elif node.op == "output":
            for k, out in enumerate(node.args[0]):
                v = env[out]
                if isinstance(v, Empty):
                    raise v.error(f"it reaches output {k}")
                if not isinstance(v, View):
                    raise UnsupportedOpError("output", str(out), "model outputs must be tensors")
                t = ctx.tensor_arg(v, "output is not strided")
                keep = cg.output_layouts.get(k)
                if keep is not None and t.offset == 0 and same_layout(t.shape, t.stride, keep):
                    pass  # a channels-last parameter's gradient, already in its layout (autograd takes it so)
                elif cg.contiguous_outputs and not _dense(t):
                    # the next program reads this output as a row-major buffer (a saved tensor, a gradient)
                    t = ctx.realize(v, "a program-to-program output is read as a row-major buffer").as_strided()
                outputs.append(OutputRef(t))
        elif node.op == "get_attr":
            raise UnsupportedOpError("get_attr", node.name, "unlifted module attribute")
    inputs.sort()
    nodes, buffers = _drop_unread(ctx, outputs)
    graph = LoopGraph(buffers, nodes, tuple(n for _, n in inputs), tuple(weights), tuple(outputs), ctx.rng)
    return graph, ctx


def _drop_unread(ctx: LoweringCtx, outputs: list) -> tuple[tuple, tuple]:
    """The lowered nodes without the computed values nothing reads (neither a node nor an output), and the
    buffers without theirs. Such a value is a graph node whose reader takes only its shape: a backward's pool
    gradient reads its input's size, and the partition recomputed that input (a `mul`) in the backward; left in,
    it became a kernel that stored nothing, which the archive's validation refuses at load. Externs are kept (a
    library call is never dropped here); each dropped value is a decision in the report."""
    from ..schedule.deps import node_reads

    live = {o.view.buf for o in outputs}
    kept, gone = [], set()
    for n in reversed(ctx.nodes):
        if not isinstance(n, Extern) and n.name not in live:
            ctx.decisions.append({"unread": n.name})
            gone.add(n.name)
            continue
        kept.append(n)
        live.update(d.buf for d in node_reads(n))
    buffers = tuple(b for b in ctx.buffers.values() if b.name not in gone)
    return tuple(reversed(kept)), buffers


# ops with no rule that come from a known model pattern: what to do instead
KNOWN_REMEDIES: dict[str, str] = {}

CATS = (torch.ops.aten.cat.default,)  # rules that skip an empty operand (lower/concat._cat)


@dataclasses.dataclass(frozen=True)
class Empty:
    """The value of a node whose result has no elements: no buffer, no kernel. `op`, `node`: where the empty
    value began (an empty computed from it keeps them)."""

    op: str
    node: str
    shape: tuple

    def error(self, how: str) -> UnsupportedOpError:
        return UnsupportedOpError(self.op, self.node, f"its result is empty (shape {list(self.shape)}) and {how}; "
                                  "only a concatenation may read an empty tensor (it leaves it out)",
                                  remedy="leave the empty computation out of the model (zero-size tensors are not "
                                         "lowered)")


def _empty_shape(val) -> list | None:
    """The shape of a tensor value (or of one of several) with a static size of 0, else None."""
    for v in (val if isinstance(val, (tuple, list)) else (val,)):
        if isinstance(v, torch.Tensor) and any(type(d) is int and d == 0 for d in v.shape):
            return list(v.shape)
    return None


def _dense(t) -> bool:
    """A TensorArg that is a row-major buffer (size-1 dims' strides do not matter)."""
    want = 1
    for size, stride in reversed(list(zip(t.shape, t.stride))):
        if size != 1 and stride != want:
            return False
        want *= size
    return True


def _where(node) -> str:
    """The model line an op came from: the innermost frame outside torch and aotfuse (an inference graph's innermost
    is often torch.nn's module); a training graph's stack traces end in aot_autograd's own code, so there the model
    line of the call its op's name descends from (joint/origins.py); else the innermost frame."""
    stack = node.meta.get("stack_trace")
    if stack:
        last = [ln.strip() for ln in stack.strip().splitlines() if ln.strip()]
        user = model_frames(stack)
        if user:
            return f"from {user[-1]}"
    site = node.meta.get("aotfuse_call_site")  # a training graph's op: the model's call it descends from (joint/origins)
    if site:
        fn, lines = site
        return f"from {lines[0]} (the model's call of {fn}, matched by the op's name)"
    if stack:
        return f"from {last[-2] if len(last) > 1 else last[-1]}"
    return "no lowering registered"


def _shapes_of(node) -> list:
    """The sizes of a node's tensor inputs and result, as the IR holds them (dims as expressions)."""
    out = []
    for n in [*node.all_input_nodes, node]:
        val = n.meta.get("val")
        if hasattr(val, "shape"):
            try:
                out.extend(sizes(val.shape))
            except ValueError:
                pass
    return out
