"""Our min-cut partition of the joint graph into forward and backward graphs, with recompute.

The flow network (networkx max-flow / min-cut). Every joint node v the forward or the backward
needs is split into v_in -> v_out:
- v_in -> v_out has the cost of SAVING v: its bytes (bit-packed size for bool tensors of two or
  more elements), 0 for parameters, buffers and user inputs (the backward gets them anyway), but
  the bytes of a buffer the forward updates (the runtime overwrites it after the forward, so the
  backward gets a copy of the value the forward read: `_build_forward`),
  for views (view/permute/expand/slice/clone/...) 1.5x their bytes: such a view is saved as a dense
  copy of it, which the forward makes (`partition_view_copies`; a view costs nothing to recompute, but
  recomputed in the backward it keeps its whole base saved); infinite with the knob off, for empty and
  bool views, and for tuple-valued nodes (their getitems are the tensors);
- u_out -> v_in is infinite for every data edge u -> v: a node on the backward side needs all of
  its inputs on the backward side (saved, or recomputed there);
- source -> v_in is infinite for what must be computed in the forward: parameters, buffers, user
  inputs, and ops banned from recompute: externs (mm, addmm, bmm, convolution, attention,
  embedding, embedding_dense_backward), random ops (rand, rand_like, native_dropout, ...), and ops
  this module does not know (conservative);
- source -> v_in has capacity B * r(v) for the other forward nodes: r(v) is the runtime cost of
  recomputing v in the backward (B is `memory_budget`), paid when v lands on the backward side;
- v_in -> sink is infinite for backward nodes (those that depend on the tangent, or that only the
  gradients need), and v_out -> sink for every gradient output.
Buffer updates (train-mode BatchNorm's running statistics, `JointGraph.mutated_buffers`) are forward
outputs like the loss: computed once, in the forward, and never in the backward.
The source side of the min cut is what the forward computes and the backward does not touch; a
node with v_in on the source side and v_out on the sink side is SAVED (a forward output); forward
nodes with v_in on the sink side are RECOMPUTED in the backward.

Costs (one unit = one byte of memory traffic, halved: saving a tensor costs a write in the
forward plus a read in the backward, and its save edge counts its bytes once):
- views and constants (arange, full, ...): r = 0;
- pointwise ops: r = numel / 128, transcendental ones (exp, log, erf, tanh, sigmoid, rsqrt, pow,
  div, ...) numel / 32: a recomputed pointwise chain fuses into the backward kernel that consumes
  it, so it costs a few flops per element (about 20 flops cost as much as one byte on an H100),
  not memory traffic; the small r also breaks ties toward saving the tensor the backward reads
  rather than its inputs;
- reductions (sum, mean, amax, ...) and windowed ops (pooling): r = bytes(inputs) / 2: recomputing
  one re-reads its whole input in a separate reduction pass;
- copies (cat, ...): r = bytes(out).
So at B = 1 the cut minimizes saved bytes + recompute cost (the runtime-optimal split in this
model): small statistics (LayerNorm mean and rstd, softmax max/sum) are saved, pointwise chains
are recomputed. At B = 0 only bytes count (minimum memory: everything recomputable is recomputed
unless saving it is strictly smaller). Capacities are integers: with B = p/q exactly and M larger
than the node count, the objective is q * M * bytes + q * (#recomputed) + p * (N + 1) * R (the
node count only breaks ties), linear in B, so the saved bytes of the optimal cut are
non-decreasing in B (parametric min cut).

Deviation from the textbook network, on purpose: a node only the backward needs that does NOT
depend on the tangent (the backward's own recomputations of forward values, e.g. a pooling
backward's window max) is not tied to the sink: computing it once costs the same in either pass,
so it floats and the cut may compute it in the forward and save it when that is cheaper (an edge
v_in -> u_in keeps its floating inputs in the forward with it). The joint graph is CSE'd by
`trace_joint`, so such duplicates of forward values are mostly merged already.
"""
from __future__ import annotations

import dataclasses
import operator
from fractions import Fraction
from typing import Any

import networkx as nx
import torch
import torch.fx

from ..dtypes import name_of
from ..errors import BuildError
from ..knobs import knobs
from ..fxgraph import ancestors, descendants, size_hint
from ..opclass import BANNED_CLASSES, TUPLE_VIEW_OPS, op_class
from .sink import sink_recomputation
from ..packops import PACK, POOL_INDICES, POOL_OFFSETS, UNPACK, packed_nbytes

def is_banned(node: torch.fx.Node) -> bool:
    """May this node NOT be recomputed in the backward?"""
    return node.op == "call_function" and op_class(node) in BANNED_CLASSES


# ---------------------------------------------------------------- sizes

def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def tensor_nbytes(val) -> int:
    """Bytes of a tensor value (a dynamic dim at the build's example: costs compare at the example)."""
    if isinstance(val, torch.Tensor):
        return size_hint(val.numel()) * val.element_size()
    return 0


def _packable(val) -> bool:
    """A bool tensor saved bit-packed. Not with a dynamic dim: the backward unpacks to a shape it must
    spell, and its program holds no symbol of its own (a mask of a dynamic shape is saved as bytes)."""
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool:
        return False
    if any(isinstance(s, torch.SymInt) for s in val.shape):
        return False
    return packed_nbytes(val.numel()) < val.numel()


def pool_offsets_args(n: torch.fx.Node) -> tuple | None:
    """(kernel, stride, padding, dilation, width) when `n` is max_pool2d_with_indices' indices (static
    shapes, at most 127 taps) and only max_pool2d_with_indices_backward reads it, as its indices: saved as
    int8 window offsets (aotfuse::pool_offsets, 1 byte per element instead of 8), restored in the backward
    by aotfuse::pool_indices (index math the pool backward's kernel inlines). Else None."""
    aten = torch.ops.aten
    if n.target is not operator.getitem or n.args[1] != 1:
        return None
    pool = n.args[0]
    if getattr(pool, "target", None) is not aten.max_pool2d_with_indices.default:
        return None
    val = n.meta.get("val")
    x = pool.args[0].meta.get("val") if isinstance(pool.args[0], torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(x, torch.Tensor) or val.dtype != torch.int64 \
            or val.dim() != 4 or any(not isinstance(d, int) for d in (*val.shape, *x.shape)):
        return None
    if not n.users or any(u.target is not aten.max_pool2d_with_indices_backward.default or u.args[7] is not n
                          or n in u.args[:7] for u in n.users):
        return None

    def pair(v, default):
        v = default if v is None or (isinstance(v, (list, tuple)) and not v) else v
        v = list(v) if isinstance(v, (list, tuple)) else [v]
        return [int(v[0]), int(v[-1])]

    args = pool.args
    kernel = pair(args[1], None)
    stride = pair(args[2] if len(args) > 2 else None, kernel)
    padding = pair(args[3] if len(args) > 3 else 0, [0, 0])
    dilation = pair(args[4] if len(args) > 4 else 1, [1, 1])
    if kernel[0] * kernel[1] > 127:
        return None
    return kernel, stride, padding, dilation, int(x.shape[-1])


def _save_bytes(n: torch.fx.Node, val) -> int:
    """save_nbytes, with max-pool indices at one byte per element (pool_offsets_args)."""
    if isinstance(val, torch.Tensor) and pool_offsets_args(n) is not None:
        return size_hint(val.numel())
    return save_nbytes(val)


def save_nbytes(val) -> int:
    """Bytes to keep `val` for the backward (bit-packed when it is a bool tensor that packing shrinks)."""
    if _packable(val):
        return packed_nbytes(val.numel())
    return tensor_nbytes(val)


COST_UNIT = 256  # recompute costs are integers in 1/256 byte


def _view_copy_bytes(val) -> int | None:
    """The save cost of a view kept as a dense copy of it (knobs.partition_view_copies): 1.5x its elements' bytes
    (the copy's read and write in the forward, its read in the backward, halved like every save cost); None where
    a view is never saved (the knob off, a non-tensor, a bool tensor, an empty view)."""
    if not knobs.partition_view_copies or not isinstance(val, torch.Tensor) or val.dtype == torch.bool:
        return None
    nbytes = tensor_nbytes(val)
    if nbytes == 0:  # an empty view (a rotary pass-through slice of width 0): never saved, recomputed for free
        return None
    return nbytes + nbytes // 2


def recompute_cost(node: torch.fx.Node) -> int | None:
    """The cost of recomputing `node` in the backward, in 1/256 byte of memory traffic (halved, like
    the save cost it competes with: saving costs a write in the forward plus a read in the backward,
    and a save edge counts the bytes once); None if the node may not be recomputed."""
    cls = op_class(node)
    if cls in BANNED_CLASSES:
        return None
    val = _val(node)
    numel = size_hint(val.numel()) if isinstance(val, torch.Tensor) else 0
    if cls in ("view", "constant", "item"):
        return 0
    if cls == "pointwise":  # ~1 flop/element, fused into the consumer: 1/128 byte per element
        return 2 * numel
    if cls == "transcendental":  # a few flops/element: 1/32 byte per element
        return 8 * numel
    if cls == "reduction":  # re-reads its whole input in a separate pass
        return COST_UNIT // 2 * sum(tensor_nbytes(_val(a)) for a in node.all_input_nodes)
    return COST_UNIT * tensor_nbytes(val)  # copy: read + write its output


# ---------------------------------------------------------------- result

@dataclasses.dataclass(frozen=True)
class SavedTensor:
    name: str  # the joint node's name
    nbytes: int  # bytes kept (packed size when packed)
    producer_op: str  # the op that produces it ("placeholder" for params/buffers/inputs)
    why: str
    packed: bool = False  # stored as aotfuse::pack_bits (1 bit per element)
    # activation | param | buffer | input (passed through) | buffer_copy (a buffer the forward updates,
    # saved as a copy of the value it read)
    kind: str = "activation"
    shape: tuple[int, ...] = ()
    dtype: str = ""  # dtype of the tensor before packing
    # max-pool indices saved as int8 window offsets: (kernel, stride, padding, dilation, width) (pool_offsets_args)
    pool_offsets: tuple | None = None
    copied: bool = False  # a view saved as a dense copy of it (knobs.partition_view_copies), its base not kept

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclasses.dataclass(frozen=True)
class Partition:
    """fwd_gm(*params, *buffers, *user_inputs) -> (*user_outputs, *buffer_updates, *saved);
    bwd_gm(*saved, tangent) -> grads (in `grads` order). The loss is user output `loss_index` (0);
    buffer update i is the new value of buffer `mutated_buffers[i]`."""

    fwd_gm: torch.fx.GraphModule
    bwd_gm: torch.fx.GraphModule
    saved: tuple[SavedTensor, ...]
    recomputed: tuple[str, ...]  # joint node names recomputed in the backward
    saved_bytes: int  # forward-produced tensors kept for the backward (packed size), not params/inputs
    memory_budget: float
    num_user_outputs: int
    loss_index: int
    grads: tuple[tuple[str, Any], ...]  # as JointGraph.grads
    recompute_ops: tuple[str, ...] = ()  # op of each recomputed node (parallel to `recomputed`)
    cut_cost: int = 0  # the min cut's value (internal units)
    mutated_buffers: tuple[str, ...] = ()  # as JointGraph.mutated_buffers
    buffer_updates: tuple[tuple[str, str], ...] = ()  # (buffer fqn, joint node of its new value)

    @property
    def num_forward_outputs(self) -> int:
        return self.num_user_outputs + len(self.mutated_buffers)

    def report(self) -> dict:
        acts = [s for s in self.saved if s.kind in ("activation", "buffer_copy")]  # counted in saved_bytes
        others = [s for s in self.saved if s.kind not in ("activation", "buffer_copy")]
        unpacked = sum(s.nbytes if not s.packed else s.nbytes * 8 for s in acts)
        return {
            "memory_budget": self.memory_budget,
            "saved_bytes": self.saved_bytes,
            "saved_tensors": len(acts),
            "packed_tensors": sum(1 for s in acts if s.packed),
            "bytes_saved_by_packing": max(0, unpacked - self.saved_bytes),
            "passed_through": {"count": len(others), "bytes": sum(s.nbytes for s in others),
                               "note": "params/buffers/inputs the backward reads; not counted in saved_bytes"},
            "recomputed_nodes": len(self.recomputed),
            "saved": [s.to_dict() for s in self.saved],
            "recomputed": [{"name": n, "op": op} for n, op in zip(self.recomputed, self.recompute_ops)],
            **({"buffer_updates": [{"buffer": b, "node": n, "note": "computed in the forward, returned after "
                                    "the loss and written into the buffer by the runtime"}
                                   for b, n in self.buffer_updates]} if self.buffer_updates else {}),
            "forward_nodes": sum(1 for n in self.fwd_gm.graph.nodes if n.op == "call_function"),
            "backward_nodes": sum(1 for n in self.bwd_gm.graph.nodes if n.op == "call_function"),
        }


# ---------------------------------------------------------------- partition

def _fake_call(op, *args):
    """meta['val'] of op(*args) from its fake kernel, under the fake mode of args' values."""
    from torch._guards import detect_fake_mode

    vals = [a for a in args if isinstance(a, torch.Tensor)]
    mode = detect_fake_mode(vals)
    if mode is not None:
        with mode:
            return op(*args)
    metas = [torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v for v in args]
    return op(*metas)


def _dense_val(val):
    """A row-major tensor value of `val`'s shape and dtype (a saved view's dense copy)."""
    return _fake_call(lambda t: t.contiguous(), val)


def _opname(node) -> str:
    if node.op == "placeholder":
        return "placeholder"
    t = node.target
    return "getitem" if t is operator.getitem else str(t)


def _materialized_in_backward(n: torch.fx.Node, bwd_only: set) -> bool:
    """Whether a backward extern (a weight-gradient matmul) reads `n`, directly or through views: recomputed
    in the backward, `n` is then written to memory there, not fused into the kernel that reads it."""
    todo, seen = list(n.users), set()
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        cls = op_class(u)
        if cls == "view":
            todo.extend(u.users)
        elif cls == "extern" and u in bwd_only:
            return True
    return False


def partition(joint, memory_budget: float = 1.0) -> Partition:
    """Split `joint` (a JointGraph) into forward and backward graphs by min cut."""
    if memory_budget < 0:
        raise BuildError(f"memory_budget must be >= 0, got {memory_budget}")
    gm = joint.gm
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    out_node = next(n for n in reversed(nodes) if n.op == "output")
    outs = list(out_node.args[0])
    n_fwd = joint.num_forward_outputs
    user_outputs = outs[:n_fwd]  # the user outputs, then the buffer updates
    grad_outputs = outs[n_fwd:]
    ph_kind = {name: kind for name, kind, _ in joint.placeholders}
    mutated = set(joint.mutated_buffers)
    # buffers the runtime overwrites after the forward: the backward must get the value the forward read
    overwritten = {name for name, kind, ref in joint.placeholders if kind == "buffer" and ref in mutated}
    tangent = next(n for n in nodes if n.op == "placeholder" and n.name == joint.tangent)

    fwd = ancestors(user_outputs)
    if tangent in fwd:
        raise BuildError("a forward output depends on the tangent")
    need_bwd = ancestors([g for g in grad_outputs if isinstance(g, torch.fx.Node)])
    bwd_only = (need_bwd - fwd) - {tangent}
    tangent_dep = descendants(tangent)
    floating = {n for n in bwd_only if n not in tangent_dep and n.op == "call_function"}
    relevant = [n for n in nodes if (n in fwd or n in bwd_only) and n.op in ("placeholder", "call_function")]

    # Integer capacities: objective = q*M*bytes + q*(#recomputed) + p*(N+1)*R, with B = p/q.
    frac = Fraction(memory_budget).limit_denominator(10 ** 6)
    p, q = frac.numerator, frac.denominator
    n_nodes = len(relevant) + 1
    M = COST_UNIT * n_nodes

    G = nx.DiGraph()
    G.add_node("source")
    G.add_node("sink")
    for n in relevant:
        vin, vout = n.name + ".in", n.name + ".out"
        val = _val(n)
        is_tuple = isinstance(val, (tuple, list))
        if n.op == "placeholder":
            G.add_edge("source", vin)
            G.add_edge(vin, vout, capacity=q * M * save_nbytes(val) if n.name in overwritten else 0)
        elif n in floating:
            # Only the backward needs it, but it does not depend on the tangent: computing it once in
            # either pass costs the same, so it floats (in the forward it must be saved).
            if op_class(n) == "view" or is_tuple:
                G.add_edge(vin, vout)
            else:
                G.add_edge(vin, vout, capacity=q * M * _save_bytes(n, val))
            for a in n.all_input_nodes:
                if a in floating:  # computed in the forward => its floating inputs are too
                    G.add_edge(vin, a.name + ".in")
        elif n in bwd_only:
            G.add_edge(vin, vout)
            G.add_edge(vin, "sink")
        else:
            cls = op_class(n)
            copy_bytes = _view_copy_bytes(val) if cls == "view" and not is_tuple else None
            if copy_bytes is not None:  # a view saved as a dense copy of it (knobs.partition_view_copies)
                G.add_edge(vin, vout, capacity=q * M * copy_bytes)
            elif cls == "view" or is_tuple:
                G.add_edge(vin, vout)
            else:
                G.add_edge(vin, vout, capacity=q * M * _save_bytes(n, val))
            r = recompute_cost(n)
            if r is not None and knobs.partition_materialize and _materialized_in_backward(n, bwd_only):
                r += COST_UNIT * save_nbytes(val)  # its write in the backward and the extern's read, halved
            if r is None:
                G.add_edge("source", vin)
            else:
                G.add_edge("source", vin, capacity=q + p * n_nodes * r)
        for a in n.all_input_nodes:
            if a is tangent:
                continue
            G.add_edge(a.name + ".out", vin)
    for g in grad_outputs:
        if isinstance(g, torch.fx.Node) and g is not tangent:
            G.add_edge(g.name + ".out", "sink")
    try:
        cut_value, (src_side, _) = nx.minimum_cut(G, "source", "sink")
    except nx.NetworkXUnbounded as exc:
        raise BuildError("partition: no finite cut (a backward value can only come from a banned op "
                         "that the backward itself would have to recompute)") from exc

    def in_src(n, half):
        return (n.name + half) in src_side

    # Saved: v_in on the source side, v_out on the sink side. Walk back from the gradients.
    saved_nodes: set = set()
    bwd_compute: set = set()
    sizes: set = set()  # a dynamic size (a SymInt node): neither saved nor recomputed (see dim_value)
    todo = [g for g in grad_outputs if isinstance(g, torch.fx.Node)]
    while todo:
        n = todo.pop()
        if n is tangent or n in saved_nodes or n in bwd_compute:
            continue
        if isinstance(_val(n), (torch.SymInt, torch.SymFloat)):  # a size, or a ratio of sizes (n / (n - 1))
            sizes.add(n)
            continue
        if n.op == "placeholder" or ((n in fwd or n in floating) and in_src(n, ".in")):
            if n.op != "placeholder" and (isinstance(_val(n), (tuple, list)) or (
                    op_class(n) == "view" and (n in floating or _view_copy_bytes(_val(n)) is None))):
                raise BuildError(f"partition: view/tuple node {n.name} ended up saved")
            saved_nodes.add(n)
            continue
        if n in fwd and is_banned(n):
            raise BuildError(f"partition: banned node {n.name} ({n.target}) would be recomputed")
        bwd_compute.add(n)
        todo.extend(n.all_input_nodes)
    recomputed = sorted((n for n in bwd_compute if n in fwd), key=order.__getitem__)
    saved_list = sorted(saved_nodes, key=order.__getitem__)

    saved_infos = []
    saved_bytes = 0
    for n in saved_list:
        val = _val(n)
        copied = False
        users = sorted((u for u in n.users if u in bwd_compute), key=order.__getitem__)
        uses = ", ".join(u.name for u in users[:4]) + (", ..." if len(users) > 4 else "")
        if n.name in overwritten:
            kind, packed, nbytes = "buffer_copy", False, tensor_nbytes(val)
            why = (f"buffer read by the backward ({uses}) and updated by the forward: saved as a copy of the "
                   f"value the forward read (the runtime overwrites the buffer after the forward)")
            saved_bytes += nbytes
        elif n.op == "placeholder":
            kind = ph_kind.get(n.name, "input")
            why = {"param": "parameter", "buffer": "buffer", "input": "user input"}.get(kind, kind) + \
                f" read by the backward ({uses}); passed through, not counted"
            packed = False
            nbytes = tensor_nbytes(val)
        elif op_class(n) == "view":
            kind, packed, pool, copied = "activation", False, None, True
            nbytes = tensor_nbytes(val)
            base = n
            while base.op == "call_function" and op_class(base) in ("view", "item") and base.all_input_nodes:
                base = base.all_input_nodes[0]
            why = (f"a view of {base.name} that the backward reads ({uses}): saved as a dense copy ({nbytes} B, "
                   f"the copy made in the forward), less than keeping {base.name}")
            saved_bytes += nbytes
        else:
            kind = "activation"
            packed = _packable(val)
            pool = pool_offsets_args(n)
            nbytes = size_hint(val.numel()) if pool is not None else save_nbytes(val)
            cls = op_class(n)
            if n in floating:
                reason = (f"only the backward needs it, but it does not depend on the tangent: computed once "
                          f"in the forward and saved ({nbytes} B), cheaper than keeping its inputs")
            elif cls == "extern":
                reason = f"{_opname(n)} is an extern: never recomputed"
            elif cls == "random":
                reason = f"{_opname(n)} is random: never recomputed (the backward must see the same draw)"
            elif cls == "unknown":
                reason = f"{_opname(n)} is not known to be cheap: never recomputed"
            else:
                r = recompute_cost(n) or 0
                reason = (f"min cut: saving {nbytes} B costs less than recomputing it in the backward "
                          f"(with what its recompute would need; its own recompute cost {r / COST_UNIT:.1f} B "
                          f"x budget {float(memory_budget):g})")
            why = reason + f"; backward uses: {uses}" + ("; bit-packed" if packed else "") + \
                ("; saved as int8 window offsets (aotfuse::pool_offsets)" if pool is not None else "")
            saved_bytes += nbytes
        saved_infos.append(SavedTensor(
            name=n.name, nbytes=nbytes, producer_op=_opname(n), why=why, packed=packed, kind=kind,
            pool_offsets=pool if kind == "activation" else None, copied=copied,
            shape=tuple(size_hint(s) for s in val.shape) if isinstance(val, torch.Tensor) else (),
            dtype=name_of(val.dtype) if isinstance(val, torch.Tensor) else ""))

    fwd_nodes = ancestors(list(user_outputs) + saved_list)
    fwd_gm = _build_forward(gm, nodes, fwd_nodes, tangent, user_outputs, saved_list, saved_infos)
    bwd_gm = _build_backward(gm, nodes, bwd_compute, tangent, grad_outputs, saved_list, saved_infos, sizes)
    return Partition(fwd_gm=fwd_gm, bwd_gm=bwd_gm, saved=tuple(saved_infos),
                     recomputed=tuple(n.name for n in recomputed), saved_bytes=saved_bytes,
                     memory_budget=float(memory_budget), num_user_outputs=joint.num_user_outputs,
                     loss_index=joint.loss_index, grads=tuple(joint.grads),
                     recompute_ops=tuple(_opname(n) for n in recomputed), cut_cost=int(cut_value),
                     mutated_buffers=tuple(joint.mutated_buffers),
                     buffer_updates=tuple((b, getattr(u, "name", str(u)))
                                          for b, u in zip(joint.mutated_buffers, outs[joint.num_user_outputs:n_fwd])))


def _real_copy(g, v, name: str, val):
    """A node copying v into a buffer of its own (`aten.copy`: lowering treats clone as a view of its input)."""
    cp = g.create_node("call_function", torch.ops.aten.copy.default, (v, v), {}, name=name)
    cp.meta["val"] = val
    return cp


def _build_forward(gm, nodes, fwd, tangent, user_outputs, saved_list, saved_infos):
    g = torch.fx.Graph()
    env: dict = {}
    for n in nodes:
        if n.op == "placeholder" and n is not tangent:
            env[n] = g.node_copy(n)
    for n in nodes:
        if n.op == "call_function" and n in fwd:
            env[n] = g.node_copy(n, lambda a: env[a])
    outs = [env[u] for u in user_outputs]
    for n, info in zip(saved_list, saved_infos):
        v = env[n]
        if info.copied:  # a view saved dense
            v = _real_copy(g, v, n.name + "_dense", _dense_val(n.meta["val"]))
        if info.kind == "buffer_copy":
            v = _real_copy(g, v, n.name + "_read", n.meta["val"])
        if info.packed:
            pk = g.create_node("call_function", PACK, (v,), {}, name=n.name + "_packed")
            pk.meta["val"] = _fake_call(PACK, n.meta["val"])
            v = pk
        if info.pool_offsets is not None:
            off = g.create_node("call_function", POOL_OFFSETS, (v, *info.pool_offsets), {}, name=n.name + "_offsets")
            off.meta["val"] = _fake_call(POOL_OFFSETS, n.meta["val"], *info.pool_offsets)
            v = off
        outs.append(v)
    g.output(tuple(outs))
    g.lint()
    return torch.fx.GraphModule(gm, g, class_name="AotfuseForward")


def dim_value() -> int:
    """Stands in a backward graph for a size of the dynamic dims that the joint graph computed in its
    forward part (`sym_size(tokens, 1)`, `s0 * s1`): a program knows its dims (they are bound once per
    call, runtime/dims.py), so such a size is neither saved nor recomputed; lowering reads the node's
    meta['val'] (lower/graph.py). Never called."""
    raise AssertionError("dim_value is a placeholder for lowering, not a function to run")


def _build_backward(gm, nodes, bwd_compute, tangent, grad_outputs, saved_list, saved_infos, sizes=frozenset()):
    g = torch.fx.Graph()
    env: dict = {}
    for n in sorted(sizes, key=nodes.index):
        env[n] = g.create_node("call_function", dim_value, (), {}, name=n.name)
        env[n].meta["val"] = n.meta["val"]
    packed_ph, offsets_ph = [], []
    for n, info in zip(saved_list, saved_infos):
        if info.packed:
            ph = g.placeholder(n.name + "_packed")
            ph.meta["val"] = _fake_call(PACK, n.meta["val"])
            packed_ph.append((n, ph))
        elif info.pool_offsets is not None:
            ph = g.placeholder(n.name + "_offsets")
            ph.meta["val"] = _fake_call(POOL_OFFSETS, n.meta["val"], *info.pool_offsets)
            offsets_ph.append((n, ph, info.pool_offsets))
        elif info.copied:  # the forward's dense copy of a view
            ph = g.placeholder(n.name)
            ph.meta["val"] = _dense_val(n.meta["val"])
            env[n] = ph
        else:
            ph = g.placeholder(n.name)
            ph.meta.update({k: v for k, v in n.meta.items() if k in ("val", "tensor_meta")})
            env[n] = ph
    tph = g.placeholder(tangent.name)
    tph.meta.update({k: v for k, v in tangent.meta.items() if k in ("val", "tensor_meta")})
    env[tangent] = tph
    for n, ph in packed_ph:
        shape = [int(s) for s in n.meta["val"].shape]
        up = g.create_node("call_function", UNPACK, (ph, shape), {}, name=n.name)
        up.meta["val"] = _fake_call(UNPACK, ph.meta["val"], shape)
        env[n] = up
    for n, ph, args in offsets_ph:
        ix = g.create_node("call_function", POOL_INDICES, (ph, *args), {}, name=n.name)
        ix.meta["val"] = _fake_call(POOL_INDICES, ph.meta["val"], *args)
        env[n] = ix
    for n in nodes:
        if n in bwd_compute and n.op == "call_function":
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[x] if isinstance(x, torch.fx.Node) else x for x in grad_outputs))
    sink_recomputation(g, tph, keep=(dim_value,))
    g.lint()
    return torch.fx.GraphModule(gm, g, class_name="AotfuseBackward")


# ---------------------------------------------------------------- reference: torch's partitioner

def torch_min_cut_saved(joint) -> list[dict]:
    """What torch's own `min_cut_rematerialization_partition` saves on the same joint graph: one
    dict per forward-produced tensor it keeps (params, buffers and inputs excluded): name, op, bytes
    (from meta['val']), and `base`/`base_bytes`/`alias_of_input`: the tensor a view chain leads back
    to (a saved view keeps its base alive; a view of a parameter or input costs nothing). For
    comparisons; the joint graph is copied, not changed."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    g = torch.fx.Graph()
    out = g.graph_copy(joint.gm.graph, {})
    g.output(out)
    gm = torch.fx.GraphModule(joint.gm, g)
    i = 0
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        want = "tangents_1" if n.name == joint.tangent else f"primals_{i + 1}"
        i += n.name != joint.tangent
        n._rename(want)
        n.target = n.name
    gm.recompile()
    fw, _ = min_cut_rematerialization_partition(gm, None, num_fwd_outputs=joint.num_forward_outputs)
    fout = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    res = []
    for n in fout[joint.num_forward_outputs:]:
        if not isinstance(n, torch.fx.Node) or n.op == "placeholder":
            continue
        base = n
        while base.op == "call_function" and op_class(base) == "view":
            base = base.args[0]
            if base.op == "call_function" and base.target in TUPLE_VIEW_OPS:
                base = base.args[0]
        res.append({"name": n.name, "op": _opname(n), "bytes": tensor_nbytes(n.meta.get("val")),
                    "base": base.name, "base_bytes": tensor_nbytes(base.meta.get("val")),
                    "alias_of_input": base.op == "placeholder"})
    return res


def torch_saved_bytes(entries: list[dict]) -> tuple[int, int]:
    """(raw, kept_alive) bytes of torch_min_cut_saved's entries: raw sums every saved tensor's own
    bytes; kept_alive counts each distinct non-input base once (what the saved views keep alive)."""
    raw = sum(e["bytes"] for e in entries)
    bases = {e["base"]: e["base_bytes"] for e in entries if not e["alias_of_input"]}
    return raw, sum(bases.values())
