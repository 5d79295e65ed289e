"""Attention masks that are constants of the model's shapes become flags.

Under tracing, transformers materializes masks it skips in eager: ViT's `create_bidirectional_mask`
builds an all-true B x 1 x T x T mask (eager passes None), and Llama's `create_causal_mask` builds the
lower-triangular one (eager's sdpa path passes `is_causal=True` when it can). A materialized mask costs a
kernel to build it, a B x H x T x T read per attention, and it keeps attention off the flash kernels
(cuDNN and flash take no arbitrary mask; memory-efficient attention wants an aligned one, else PyTorch
falls back to the math form). This pass evaluates each attention's mask once at build time when it
depends on nothing but shapes and fixed buffers, and rewrites the call exactly:

- every position kept (bool all true, additive all zero): the mask is dropped;
- kept exactly where `tril(ones(L, S))` (sdpa's `is_causal` alignment: top-left) and masked elsewhere:
  the mask is dropped and the call becomes causal;
- kept exactly where 0 <= i - j < W for some W < L, L == S (a causal sliding window, Gemma-3's and Mistral's
  local layers), on training's fused attention (`aotfuse::attention` and its backward): the mask is dropped,
  the call becomes causal with `window=W`, and the runtime runs flash's local attention, which visits only
  the blocks inside the window (runtime/attention.py). sdpa itself has no window argument: an inference sdpa
  whose shapes the local kernel takes (fp16/bf16, head dim <= 256; `runtime.attention.window_refusal`)
  becomes `aotfuse::attention(..., window=W)[0]`, else its mask stays;
- anything else (padding, bottom-right causal with L != S): the mask stays.

A mask of dynamic size is classified from its value at the range's end when export/mask_range.py proves that
value holds at every size (its ops never let a size enter an element's value); a window then needs the query
and key lengths to be one dim.

An additive float mask counts as masked where it is -inf or the dtype's lowest value (transformers
uses `finfo.min`): exp of a score plus either underflows to exactly 0, and a causal pattern never masks
a whole row. The decision is written on the attention node (`meta["aotfuse_mask"]`) and the lowering
records it for `aotfuse explain`.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from .fold import _map, _pure
from .mask_range import shape_at_range_end, value_at_range_end

aten = torch.ops.aten
META_KEY = "aotfuse_mask"
MAX_MASK_ELEMENTS = 1 << 26  # a larger constant mask is left alone (its evaluation would cost the build)
# what a decision on a mask of dynamic size adds (export/mask_range.py)
_EVERY_SIZE = (" at every size in range (its ops keep each element whatever the sizes: evaluated at the range's end, "
               "export/mask_range.py)")


def _attention_ops() -> dict:
    """attention op -> (mask arg index, causal arg index); aotfuse's ops register with the runtime."""
    from ..runtime import attention  # noqa: F401  (registers torch.ops.aotfuse.*)

    return {aten.scaled_dot_product_attention.default: (3, 5, None),
            torch.ops.aotfuse.attention.default: (3, 4, 7),
            torch.ops.aotfuse.attention_backward.default: (4, 7, 10)}


def _arg(node: torch.fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _set(node: torch.fx.Node, i: int, name: str, value) -> None:
    if len(node.args) > i:
        args = list(node.args)
        args[i] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, name: value}


def _on_cpu(kwargs: dict) -> dict:
    return {k: (torch.device("cpu") if k == "device" and v is not None else v) for k, v in kwargs.items()}


class _Evaluator:
    """Values of constant nodes (pure ATen ops over seeded placeholders), computed once on the CPU."""

    def __init__(self, seeds: dict):
        self.seeds = {k: v.detach().cpu() for k, v in seeds.items()}
        self.env: dict[torch.fx.Node, object] = {}
        self.dead: set[torch.fx.Node] = set()

    def value(self, node: torch.fx.Node):
        order, stack, seen = [], [node], set()
        while stack:  # the ancestors; any that is not constant makes the whole value unknown
            n = stack.pop()
            if n in seen or n in self.env:
                continue
            if n in self.dead:
                return None
            seen.add(n)
            if n.op == "placeholder":
                if n.name not in self.seeds:
                    self.dead.add(n)
                    return None
                self.env[n] = self.seeds[n.name]
                continue
            if not _pure(n):
                self.dead.add(n)
                return None
            order.append(n)
            stack.extend(n.all_input_nodes)
        for n in sorted(order, key=_position(node.graph)):
            self.env[n] = n.target(*_map(n.args, self.env), **_on_cpu(_map(dict(n.kwargs), self.env)))
        return self.env[node]


def _position(graph: torch.fx.Graph):
    pos = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: pos[n]


def _erase_dead_constants(graph: torch.fx.Graph, evaluated: dict) -> None:
    """Erase the evaluated constant nodes nothing reads any more. Export's metadata checks
    (aten._assert_tensor_metadata, which DCE keeps as side effects) on them go too: the values they
    check are constants of the build, checked when export traced them."""
    check = aten._assert_tensor_metadata.default
    for n in reversed(list(graph.nodes)):
        if n not in evaluated or n.op == "placeholder":
            continue
        if n.users and all(u.target is check for u in n.users):
            for u in list(n.users):
                graph.erase_node(u)
        if not n.users:
            graph.erase_node(n)


def classify(mask: torch.Tensor, L: int, S: int) -> str | None:
    """"all" (every position kept), "causal" (kept exactly on tril(ones(L, S))), "window:W" (kept exactly where
    0 <= i - j < W, W < L == S) or None (a real mask)."""
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        masked = torch.isneginf(mask) | (mask <= torch.finfo(mask.dtype).min)
        if not bool((masked | (mask == 0)).all()):
            return None
        keep = ~masked
    else:
        return None
    try:
        keep = keep.expand(*keep.shape[:-2], L, S)
    except RuntimeError:
        return None
    if bool(keep.all()):
        return "all"
    tril = torch.ones(L, S, dtype=torch.bool).tril()
    if bool((keep == tril).all()):
        return "causal"
    if L == S and L > 1:
        w = int(keep[(0,) * (keep.dim() - 2)][-1].sum())  # the last query's keys: the window's width
        if 0 < w < L and bool((keep == (tril & torch.ones(L, S, dtype=torch.bool).triu(-(w - 1)))).all()):
            return f"window:{w}"
    return None


def simplify_attention_masks(gm: torch.fx.GraphModule, seeds: dict | None = None) -> list[dict]:
    """Rewrite attention calls whose mask is a constant "all kept" or causal pattern (module docstring).
    `seeds`: placeholder name -> tensor for placeholders fixed at build time. Returns the decisions."""
    ops = _attention_ops()
    ev = _Evaluator(seeds or {})
    decisions = []
    changed = False
    for node in list(gm.graph.nodes):
        spec = ops.get(node.target) if node.op == "call_function" else None
        if spec is None:
            continue
        mi, ci, wi = spec
        mask = _arg(node, mi, "attn_mask")
        if not isinstance(mask, torch.fx.Node):
            continue
        qi = 1 if node.target is torch.ops.aotfuse.attention_backward.default else 0  # after grad_out
        q, k = node.args[qi], node.args[qi + 1]
        L, S = _hint(q.meta["val"].shape[-2]), _hint(k.meta["val"].shape[-2])
        mval = mask.meta.get("val")
        rec = {"attention": node.name, "mask": mask.name}
        dynamic = mval is not None and any(isinstance(d, torch.SymInt) for d in mval.shape)
        val = err = None
        if dynamic:
            # a value at the example says nothing of other sizes (a sliding window wider than the example looks
            # causal there); a prefix-consistent mask's value at the range's end says it for every size
            ends = shape_at_range_end((q.meta["val"].shape[-2], k.meta["val"].shape[-2]))
            val, why_not = value_at_range_end(mask, ev.seeds, MAX_MASK_ELEMENTS) if ends else (None, "no upper end")
            if val is None:
                rec.update(kept=True, why=f"the mask's size is a dynamic dim: kept (computed per call): {why_not}")
            else:
                L, S = ends
                rec["at_range_end"] = True
        elif mval is not None and mval.numel() > MAX_MASK_ELEMENTS:
            rec.update(kept=True, why=f"mask of {mval.numel()} elements: not evaluated at build time")
        else:
            try:
                val = ev.value(mask)
            except Exception as exc:  # an op that will not run on the CPU at build time: leave the mask
                err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
        if "kept" not in rec:
            kind = None if not isinstance(val, torch.Tensor) else classify(val, L, S)
            if err is not None:
                rec.update(kept=True, why=f"the constant mask could not be evaluated at build time ({err})")
            elif val is None:
                rec.update(kept=True, why="the mask depends on the inputs")
            elif kind is None:
                rec.update(kept=True, why="a constant mask that is neither all-kept nor causal" +
                           (" at the range's end" if dynamic else ""))
            elif kind.startswith("window:") and dynamic and not _same_length(q, k):
                rec.update(kept=True, why=f"a sliding window ({kind[7:]} keys at the range's end) with query and key "
                                          "lengths that are not the same dim: the mask stays")
            elif kind.startswith("window:") and wi is None:
                why, fused = _sdpa_window(gm.graph, node, int(kind[7:]))
                if why:
                    rec.update(kept=True, why=f"a sliding window ({kind[7:]} keys) on sdpa: the mask stays ({why})")
                else:
                    changed = True
                    fused.meta[META_KEY] = rec
                    rec.update(kept=False, window=int(kind[7:]), why=f"constant sliding-window mask ({kind[7:]} keys): "
                               f"sdpa -> aotfuse::attention(is_causal=True, window={kind[7:]}), flash's local attention "
                               "on CUDA" + (_EVERY_SIZE if dynamic else ""))
            elif kind.startswith("window:") and (_arg(node, ci, "is_causal", False) or
                                                  _arg(node, wi, "window", 0)):
                rec.update(kept=True, why=f"a sliding window ({kind[7:]} keys) on a call that is already causal or "
                                          "windowed: the mask stays")
            elif kind.startswith("window:") and (refused := _window_refusal(node, qi)):
                rec.update(kept=True, why=f"a sliding window ({kind[7:]} keys) the local kernel does not take: the "
                                          f"mask stays ({refused})")
            elif kind.startswith("window:"):
                w = int(kind[7:])
                _set(node, mi, "attn_mask", None)
                _set(node, ci, "is_causal", True)
                _set_window(node, wi, w)
                changed = True
                rec.update(kept=False, window=w, why=f"constant sliding-window mask ({w} keys) -> is_causal=True, "
                                                     f"window={w}: flash's local attention on CUDA" +
                           (_EVERY_SIZE if dynamic else ""))
            else:  # a causal call with a causal (or all-kept) mask is causal: dropping the mask is exact
                _set(node, mi, "attn_mask", None)
                if kind == "causal":
                    _set(node, ci, "is_causal", True)
                changed = True
                rec.update(kept=False, why=("constant all-kept mask dropped" if kind == "all" else
                                            "constant causal mask (tril) -> is_causal=True") +
                           (_EVERY_SIZE if dynamic else ""))
        node.meta[META_KEY] = rec
        decisions.append(rec)
    if changed:
        _erase_dead_constants(gm.graph, ev.env)
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return decisions


def _sdpa_window(graph: torch.fx.Graph, node: torch.fx.Node, w: int):
    """Replace an inference sdpa whose constant mask is a causal window of w keys by the fused op's output with
    window=w (sdpa has no window argument). Returns (why not, None), or (None, the fused op's node)."""
    from ..runtime.attention import attention, shapes, window_refusal

    q, k, v = node.args[:3]
    if _arg(node, 4, "dropout_p", 0.0) or _arg(node, 5, "is_causal", False):
        return "dropout or is_causal is set", None
    vals = [getattr(x, "meta", {}).get("val") for x in (q, k, v)]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in vals):
        return "query, key and value are not 4-d tensors", None
    qv, kv, vv = vals
    gqa = bool(node.kwargs.get("enable_gqa", False))
    why = window_refusal(tuple(qv.shape), tuple(kv.shape), qv.dtype) or \
        shapes(tuple(qv.shape), tuple(kv.shape), tuple(vv.shape), None, gqa)
    if why:
        return why, None
    scale = node.kwargs.get("scale")
    scale = float(scale) if scale is not None else 1.0 / float(qv.shape[-1]) ** 0.5
    mode = getattr(qv, "fake_mode", None)
    if mode is None:
        return "no fake tensors on the graph", None
    try:
        with mode:
            val = attention(qv, kv, vv, None, True, scale, gqa, w)
    except Exception as exc:  # noqa: BLE001 - the fused op refuses these operands: sdpa keeps its mask
        return f"the fused op refuses the operands ({type(exc).__name__})", None
    with graph.inserting_after(node):
        att = graph.call_function(attention, (q, k, v, None, True, scale, gqa, w))
        with graph.inserting_after(att):
            out = graph.call_function(operator.getitem, (att, 0))
    att.meta.update({key: val for key, val in node.meta.items() if key != "val"})
    att.meta["val"] = val
    out.meta.update(att.meta)
    out.meta["val"] = val[0]
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return None, att


def _window_refusal(node: torch.fx.Node, qi: int) -> str | None:
    """Why flash's local kernel would not take this fused call's shapes (dtype, head dim, T != S), or None; a call
    it would not take keeps its mask, made additive once in the graph (joint/decomp_train.py), rather than a mask
    rebuilt in every layer's forward and backward."""
    from ..runtime.attention import window_refusal

    q, k = (getattr(x, "meta", {}).get("val") for x in node.args[qi:qi + 2])
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
        return "query or key without a value"
    return window_refusal(tuple(q.shape), tuple(k.shape), q.dtype)


def _set_window(node: torch.fx.Node, i: int, w: int) -> None:
    """The optional trailing `window` argument: positional, the arguments before it all positional (the
    lowering reads them by position)."""
    args = list(node.args)
    if len(args) < i:  # the traced call spells out every argument before window (enable_gqa is not defaulted)
        raise AssertionError(f"{node.name}: {len(args)} positional arguments before window (index {i})")
    if len(args) == i:
        args.append(w)
    else:
        args[i] = w
    node.args = tuple(args)


def _same_length(q: torch.fx.Node, k: torch.fx.Node) -> bool:
    """Whether the query and key lengths are one expression (no guard: compared as sympy expressions)."""
    import sympy

    from ..layouts import size_expr

    return sympy.expand(size_expr(q.meta["val"].shape[-2]) - size_expr(k.meta["val"].shape[-2])) == 0


def _hint(n) -> int:
    """A size at the build's example, read without a guard: int() of a dynamic dim's SymInt would make
    torch fix the dim to that value (export/dynamic.py)."""
    if isinstance(n, int):
        return n
    hint = getattr(getattr(n, "node", None), "hint", None)
    return int(hint) if hint is not None else int(n)
