"""Extern lowerings: matmuls, convolution and attention, kept whole and called on strided views.
(Embedding is kept whole by export too, but lowers to a gather kernel: lower/gather.py.)"""
from __future__ import annotations

import torch

from ..runtime import attention as _attention_ops  # noqa: F401 (defines torch.ops.aotfuse.*)
from ..runtime import embedding_grad as _embedding_grad
from ..runtime.mm_residual import mm_residual as _mm_residual_op

from ..errors import UnsupportedOpError
from ..sdpa_shapes import plan as sdpa_plan
from ..ir.sizes import sizes, static
from ..knobs import knobs
from ..ir.views import View
from ..ir.indexing import syms
from ..ir.loop import Const, Op, compute_dtype
from .ctx import as_dtype, dtype_name, out_dtype, out_shape, pad_row
from ..schedule.attention import choose as attention_choice
from .attention import lower_attention
from .embedding import arange_length, positional_grad
from .matmul import add_bias, try_template
from ..layouts import channels_last_perm, node_layout
from .rules import collector

aten = torch.ops.aten
RULES: list = []
rule = collector(RULES)


# ---------------------------------------------------------------- externs

def _targ(ctx, v, node, what, transposable: bool = False, storage=None):
    """The strided tensor argument of an extern; a view that is not strided is copied (transposable: a matmul
    operand, which may be copied in its transposed order; storage: the copy's memory order; LowerCtx.realize)."""
    if not isinstance(v, View):
        raise UnsupportedOpError(str(node.target), node.name, f"{what} is not a tensor")
    return ctx.tensor_arg(v, f"{what} of {node.name} is not strided", transposable, storage)


def _bthe(ctx, node, views, names):
    """Attention operands ([B, H, T, E]): a copy, when one is needed, is stored [B, T, H, E], the layout the
    attention kernels write their results in when the query has it (aotfuse/layouts.py)."""
    return [_targ(ctx, t, node, n, storage=_BTHD if len(getattr(t, "shape", ())) == 4 else None)
            for t, n in zip(views, names)]


def _operands(ctx, node, a, b, names=("lhs", "rhs")):
    return _targ(ctx, a, node, names[0], True), _targ(ctx, b, node, names[1], True)


_PAD_DTYPES = ("bfloat16", "float16", "float32")


def _padded_mm(ctx, node, a, b, bias=None) -> View | None:
    """A 2-D matmul with a size that is not a multiple of 16 bytes' worth of elements (a vocabulary of 50257),
    computed over sizes padded to one (AOTFUSE_MM_PAD): operands copied into zero-padded matrices where they
    grow (LoweringCtx.pad_matrix; a producer fuses into the copy), the result written into a padded buffer and
    used as its leading slice. cuBLAS otherwise runs an sm_75 `align1` kernel (GPT-2's LM head on an H100: 6.6 ms
    against 0.9 padded). bias: addmm's (1-D over N or 2-D), padded alike. None when it does not apply (recorded
    when it does)."""
    if not knobs.mm_pad or not (isinstance(a, View) and isinstance(b, View)):
        return None
    if bias is not None and (not isinstance(bias, View) or bias.dtype != out_dtype(node) or len(bias.shape) > 2):
        return None
    shape = out_shape(node)
    dt = out_dtype(node)
    if dt not in _PAD_DTYPES or a.dtype != dt or b.dtype != dt or len(shape) != 2 or len(a.shape) != 2:
        return None
    if not all(static(x) for x in (*shape, *a.shape, *(() if bias is None else bias.shape))):
        return None
    (m, k), n = (int(x) for x in a.shape), int(shape[1])
    mp, np_, kp = pad_row(m, dt), pad_row(n, dt), pad_row(k, dt)
    if (mp, np_, kp) == (m, n, k) or min(m, n, k) < 64 or m * n * k < 1 << 24:
        return None
    why = f"{node.name}: {m}x{n}x{k} computed as {mp}x{np_}x{kp}"
    pa = ctx.pad_matrix(a, mp, kp, f"lhs of {why}")
    pb = ctx.pad_matrix(b, kp, np_, f"rhs of {why}")
    ta, tb = _operands(ctx, node, pa, pb)
    ctx.decisions.append({"matmul": node.name, "pad": f"{m}x{n}x{k} computed as {mp}x{np_}x{kp}, the result its "
                          f"[{m}, {n}] slice (sizes of 16-byte multiples: cuBLAS's TMA kernels; unpadded it runs an "
                          "sm_75 align1 kernel)"})
    if bias is None:
        return ctx.extern("aten.mm.out", (ta, tb), {}, shape, dt, True, padded=(mp, np_))
    if len(bias.shape) == 2:  # [M, N], or broadcast [1, N] / [M, 1]
        rows, cols = (mp if int(bias.shape[0]) == m else 1), (np_ if int(bias.shape[1]) == n else 1)
        pbias = ctx.pad_matrix(bias, rows, cols, f"bias of {why}")
    else:  # [N] (or a broadcast [1])
        cols = np_ if int(bias.shape[0]) == n else 1
        pbias = ctx.pad_matrix(bias.reshape([1, int(bias.shape[0])]), 1, cols, f"bias of {why}").reshape([cols])
    tbias = _targ(ctx, pbias, node, "bias")
    return ctx.extern("aten.addmm.out", (tbias, ta, tb), {}, shape, dt, True, padded=(mp, np_))


@rule(aten.mm.default, category="extern", note="a Triton template when the cost model prefers it (lower/matmul.py)")
def _mm(ctx, node, args, kwargs):
    if (t := try_template(ctx, node, args[0], args[1], "mm")) is not None:  # matmul template
        return t
    if (p := _padded_mm(ctx, node, args[0], args[1])) is not None:
        return p
    a, b = _operands(ctx, node, args[0], args[1])
    return ctx.extern("aten.mm.out", (a, b), {}, out_shape(node), out_dtype(node), True)


@rule(aten.bmm.default, category="extern", note="a Triton template when the cost model prefers it (lower/matmul.py)")
def _bmm(ctx, node, args, kwargs):
    if (t := try_template(ctx, node, args[0], args[1], "bmm")) is not None:  # matmul template
        return t
    a, b = _operands(ctx, node, args[0], args[1])
    return ctx.extern("aten.bmm.out", (a, b), {}, out_shape(node), out_dtype(node), True)


@rule(aten.addmm.default, category="extern",
          note="kept whole when only externs consume it; else mm + a bias add that fuses with its consumers")
def _addmm(ctx, node, args, kwargs):
    bias, a, b = args[:3]
    beta = kwargs.get("beta", 1)
    alpha = kwargs.get("alpha", 1)
    if (t := try_template(ctx, node, a, b, "addmm", bias=bias, alpha=alpha, beta=beta)) is not None:  # template
        return t
    consumers_fusible = _feeds_fusible(node)
    stored = _stored(node)
    shape = out_shape(node)
    dt = out_dtype(node)
    if (not consumers_fusible or stored) and beta == 1 and alpha == 1:
        if (p := _padded_mm(ctx, node, a, b, bias)) is not None:
            ctx.decisions.append({"addmm": node.name, "kept": True, "why": "padded sizes, the bias added by cuBLAS"})
            return p
        ta, tb = _operands(ctx, node, a, b)
        tbias = _targ(ctx, bias, node, "bias")
        why = f"the biased result is stored anyway ({stored}): cuBLAS adds the bias as it writes it, a consumer " \
              f"kernel reads it once" if stored else "no fusible consumer: cuBLAS adds the bias"
        ctx.decisions.append({"addmm": node.name, "kept": True, "why": why})
        return ctx.extern("aten.addmm.out", (tbias, ta, tb), {}, shape, dt, True)
    ctx.decisions.append({"addmm": node.name, "kept": False, "why": "bias add fuses into the consumer"})
    mm = _padded_mm(ctx, node, a, b)
    if mm is None:
        ta, tb = _operands(ctx, node, a, b)
        mm = ctx.extern("aten.mm.out", (ta, tb), {}, shape, dt, True)
    return add_bias(ctx, mm, bias, shape, dt, alpha, beta)


@rule(aten._addmm_activation.default, category="extern",
      note="addmm + tanh GELU in one call (export/mm_gelu.py fuses them): cuBLASLt's GELU_BIAS epilogue")
def _addmm_activation(ctx, node, args, kwargs):
    bias, a, b = args[:3]
    tb = _targ(ctx, bias, node, "bias")
    ta, tm = _operands(ctx, node, a, b, ("mat1", "mat2"))
    kw = {"use_gelu": bool(kwargs.get("use_gelu", False))}
    kw.update((k, kwargs[k]) for k in ("beta", "alpha") if kwargs.get(k, 1) != 1)
    return ctx.extern("aten._addmm_activation.out", (tb, ta, tm), kw, out_shape(node), out_dtype(node), True)


def mm_residual(ctx, node, args, residual: View) -> View:
    """An mm / addmm with the residual its sum adds (lower/residual.py chose it): one
    `aotfuse.mm_residual.out` extern, D = a @ b (+ bias) + residual; the residual is read as D's M x N matrix
    (a reshape of the sum's operand, which lower/residual.py found row-major)."""
    if node.target is aten.addmm.default:
        bias, a, b = args[:3]
    else:
        (a, b), bias = args[:2], None
    if not isinstance(residual, View):
        raise UnsupportedOpError(str(node.target), node.name, "the residual is not a tensor")
    from ..ir.sizes import text
    from ..schedule.templates import TEMPLATE_DTYPES, library_epilogue_estimate, mode

    def dim(x):
        return int(x) if static(x) else text(x)

    m, n = out_shape(node)
    k, dt = a.shape[-1], out_dtype(node)
    rec = {"matmul": node.name, "op": "addmm" if bias is not None else "mm", "dtype": dt,
           "shape": {"B": 1, "M": dim(m), "N": dim(n), "K": dim(k)}, "mode": mode(),
           "epilogue": ["add"] + (["bias"] if bias is not None else []), "choice": "extern",
           "why": "cuBLASLt adds the residual (C, beta 1)" + (" and the bias" if bias is not None else "")
                  + " in its call (lower/residual.py)"}
    if all(static(x) for x in (m, n, k)) and dt in TEMPLATE_DTYPES:
        rec["cost_us"] = library_epilogue_estimate(int(m), int(n), int(k), dt)
    ctx.decisions.append(rec)
    return _mm_residual_call(ctx, node, a, b, residual.reshape(out_shape(node)), bias)


def _mm_residual_call(ctx, node, a, b, residual: View, bias) -> View:
    ta, tb = _operands(ctx, node, a, b)
    tr = _targ(ctx, residual, node, "residual")
    tbias = None if bias is None else _targ(ctx, bias, node, "bias")
    return ctx.extern("aotfuse.mm_residual.out", (ta, tb, tr, tbias), {}, out_shape(node), out_dtype(node), True)


@rule(_mm_residual_op, category="extern",
      note="a matmul with its bias and a residual added by cuBLASLt (C with beta 1); lower/residual.py makes it")
def _mm_residual(ctx, node, args, kwargs):
    a, b, residual, bias = (list(args) + [kwargs.get("bias")])[:4]
    return _mm_residual_call(ctx, node, a, b, residual, bias)


def _stored(node) -> str | None:
    """Why the addmm's result (or a view of it) is written to memory whatever fuses with it: a program
    output (a training forward saves it for the backward), or an extern's operand. Then splitting off
    the bias would write the unbiased product and read it back to write the biased one too."""
    import operator

    from .registry import registry

    for user in node.users:
        if user.op == "output":
            return "a program output"
        if isinstance(user.meta.get("val"), (torch.SymInt, torch.SymFloat)):  # sym_size: reads the shape, not data
            continue
        if user.target is operator.getitem:  # a piece of a split view
            if (why := _stored(user)) is not None:
                return why
            continue
        info = registry().get(user.target)
        if info is None or info.category == "extern":
            return f"read by {user.name}"
        if info.category == "view" and (why := _stored(user)) is not None:
            return why
    return None


def _feeds_fusible(node) -> bool:
    """Does a pointwise or reduction op consume node, directly or through views?"""
    from .registry import registry

    for user in node.users:
        info = registry().get(user.target)
        if info is None:
            continue
        if info.category in ("pointwise", "reduction"):
            return True
        if info.category == "view" and _feeds_fusible(user):
            return True
    return False


@rule(aten.index_put.default, category="extern",
      note="a scatter by index tensors (accumulate: a scatter-add, the gradient of x[idx]): torch's kernel, "
           "its result bound as the buffer")
def _index_put(ctx, node, args, kwargs):
    x, indices, values = args[:3]
    accumulate = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
    tx, tv = _targ(ctx, x, node, "self"), _targ(ctx, values, node, "values")
    if any(t is not None and t.dtype in ("bool", "uint8") for t in indices):  # uint8: torch's deprecated mask
        return _masked_write(ctx, node, x, indices, values, accumulate)
    tidx = [None if t is None else _targ(ctx, t, node, "indices") for t in indices]
    return ctx.extern("aten.index_put.default", (tx, tidx, tv, accumulate), {}, out_shape(node), out_dtype(node),
                      False)


@rule(aten.scatter_add.default, category="extern",
      note="a scatter-add along a dim (segment sums, torch_scatter-style pooling): torch's kernel, its result bound "
           "as the buffer")
def _scatter_add(ctx, node, args, kwargs):
    x, dim, index, src = args[:4]
    tx, ti, ts = (_targ(ctx, t, node, n) for t, n in ((x, "self"), (index, "index"), (src, "src")))
    return ctx.extern("aten.scatter_add.default", (tx, int(dim), ti, ts), {}, out_shape(node), out_dtype(node), False)


def scatter_extern(ctx, node, x, dim, index, val) -> View:
    """aten.scatter (src or value) by torch's kernel, its result bound as the buffer: what lower/gather.py's
    compare-and-where form does not cover (more than SCATTER_PER_ROW_MAX indices per row, an index smaller than
    self). Duplicate indices along a row leave one of their values, as torch's kernel does."""
    tx, ti = _targ(ctx, x, node, "self"), _targ(ctx, index, node, "index")
    if isinstance(val, View):
        return ctx.extern("aten.scatter.src", (tx, int(dim), ti, _targ(ctx, val, node, "src")), {}, out_shape(node),
                          out_dtype(node), False)
    return ctx.extern("aten.scatter.value", (tx, int(dim), ti, val), {}, out_shape(node), out_dtype(node), False)


@rule(aten.topk.default, aten.sort.default, category="extern",
      note="torch's kernel, two results: the values and their int64 indices (MoE routing, top-k sampling, argsort)")
def _topk_sort(ctx, node, args, kwargs):
    results = tuple((tuple(v.shape), dtype_name(v.dtype, node.name), None) for v in node.meta["val"])
    narrow = _narrow_sort(ctx, node, args)
    if narrow is not None:  # int64 keys known to be small: sorted as int16, the values widened back
        key, bound = narrow
        tkey = _targ(ctx, key, node, "self")
        vals, idx = ctx.extern_results(str(node.target), (tkey,) + tuple(args[1:]), dict(kwargs),
                                       ((results[0][0], "int16", None), results[1]))
        ctx.decisions.append({"narrow_sort": node.name, "why": f"int64 keys below {bound} (indices along a dim of "
                              f"that size) sorted as int16: a radix sort of 2 byte-digit passes, not 8"})
        return _widen(ctx, vals, "int64"), idx
    tx = _targ(ctx, args[0], node, "self")
    return ctx.extern_results(str(node.target), (tx,) + tuple(args[1:]), dict(kwargs), results)


def _index_bound(n) -> int | None:
    """An exclusive upper bound of an int64 tensor that holds indices along a dim of static size, looking through
    views: topk's or sort's indices, argmax's or argmin's (an MoE's chosen experts); None otherwise. (Never
    negative: these ops index from 0.)"""
    import operator

    from .matmul import _source

    src = _source(n)
    t = getattr(src, "target", None)
    if t is operator.getitem and src.args[1] == 1 and \
            getattr(src.args[0], "target", None) in (aten.topk.default, aten.sort.default):
        op = src.args[0]
        at = 2 if op.target is aten.topk.default else 1  # the dim argument's position
        x, dim = op.args[0], op.args[at] if len(op.args) > at else op.kwargs.get("dim", -1)
    elif t in (aten.argmax.default, aten.argmin.default) and len(src.args) > 1 and src.args[1] is not None:
        x, dim = src.args[0], src.args[1]
    else:
        return None
    val = x.meta.get("val")
    size = val.shape[dim] if val is not None and val.dim() else None
    return size if isinstance(size, int) else None


def _narrow_sort(ctx, node, args):
    """(the keys cast to int16, their bound) for a sort of int64 indices known to be below 2**15, else None. CUDA
    sorts int64 keys by radix over all 64 bits (8 passes; an MoE's sort of its routed experts took 194 us a call
    of Mixtral's 2886), int16 keys in 2; the order is the same, ties included (the same stable algorithm)."""
    val = node.meta.get("val")
    if node.target is not aten.sort.default or not knobs.narrow_sort or not isinstance(args[0], View) or \
            args[0].dtype != "int64" or not isinstance(val, (tuple, list)):
        return None
    bound = _index_bound(node.args[0])
    if bound is None or bound > 1 << 15:
        return None
    return _widen(ctx, args[0], "int16"), bound


def _widen(ctx, v: View, dtype: str) -> View:
    """v cast to dtype, a pointwise node over v's shape."""
    shape = tuple(v.shape)
    pv = syms("p", len(shape))
    return ctx.pointwise(shape, dtype, as_dtype(ctx.load(v, list(pv), dict(zip(pv, shape))), dtype), hint="cast")


def _masked_write(ctx, node, x, indices, values, accumulate: bool) -> View:
    """x[mask] = v (x[mask] += v) with one boolean mask over x's leading dims and one value for every selected
    element: a pointwise where, no scatter. Any other boolean-mask write (values per selected element, whose
    positions depend on the data) is refused by name."""
    from ..ir.indexing import syms
    from ..ir.loop import Const, Op, compute_dtype
    from .ctx import as_dtype

    mask = indices[0] if len(indices) == 1 else None
    if mask is None or not isinstance(mask, View) or mask.dtype not in ("bool", "uint8") or \
            not isinstance(values, View) or \
            values.numel != 1 or tuple(mask.shape) != tuple(x.shape[:len(mask.shape)]):
        raise UnsupportedOpError(str(node.target), node.name,
                                 "a boolean-mask index with other than one value for every selected element",
                                 remedy="write it as torch.where(mask, v, x)")
    shape, dt = out_shape(node), out_dtype(node)
    cdt = compute_dtype(dt) if dt != "bool" else "bool"
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    old = as_dtype(ctx.load(x, list(pv), ranges), cdt)
    new = as_dtype(ctx.load(values, [0] * len(values.shape), ranges), cdt)
    hit = as_dtype(ctx.load(mask, list(pv[:len(mask.shape)]), ranges), "bool")
    body = Op("add", (old, Op("where", (hit, new, as_dtype(Const(0, "float32"), cdt)), cdt)), cdt) if accumulate \
        else Op("where", (hit, new, old), cdt)
    return ctx.pointwise(shape, dt, body, hint="masked")


@rule(aten.convolution.default, category="extern",
      note="the functional op, its result bound as the buffer (convolution.out copies); channels-last kept")
def _convolution(ctx, node, args, kwargs):
    x, w, b = args[:3]
    rest = tuple(tuple(a) if isinstance(a, (list, tuple)) else a for a in args[3:])
    tx, tw = _targ(ctx, x, node, "input"), _targ(ctx, w, node, "weight")
    # cuDNN writes the layout of its input: the buffer is planned so (aotfuse/layouts.py), then bound, not copied
    perm = channels_last_perm(node.meta.get("val")) or ctx.cl_nodes.get(node)
    if b is None or not knobs.conv_bias_split or not isinstance(b, View) or len(b.shape) != 1:
        tb = None if b is None else _targ(ctx, b, node, "bias")
        return ctx.extern("aten.convolution.default", (tx, tw, tb) + rest, {}, out_shape(node), out_dtype(node),
                          False, storage_perm=perm)
    # The bias as a pointwise add over the channels, which fuses into the conv's consumer (a GroupNorm's
    # statistics, an activation): torch adds a convolution's bias in a kernel of its own after cuDNN's, a read
    # and a write of the whole output (a diffusion UNet's 23 biased convs: 261 us of 1617 per call on an H100).
    shape, dt = out_shape(node), out_dtype(node)
    conv = ctx.extern("aten.convolution.default", (tx, tw, None) + rest, {}, shape, dt, False, storage_perm=perm)
    bias = b.reshape((b.shape[0],) + (1,) * (len(shape) - 2))  # one value per channel: [C, 1, ..., 1]
    ctx.decisions.append({"conv_bias": node.name, "why": "a per-channel add that fuses into the conv's consumer, not "
                                                         "torch's separate bias kernel (AOTFUSE_CONV_BIAS_SPLIT)"})
    lay = node_layout(node.meta.get("val")) or ((perm, tuple(node.meta["val"].shape)) if perm else None)
    old = ctx.layout, ctx.layout_shape
    if lay is not None:  # the add keeps the conv's channels-last order where it is stored
        ctx.layout, ctx.layout_shape = lay[0], sizes(lay[1])
    try:
        return add_bias(ctx, conv, bias, shape, dt)
    finally:
        ctx.layout, ctx.layout_shape = old


@rule(aten.convolution_backward.default, category="extern",
      note="cuDNN's dgrad/wgrad (training): the outputs output_mask asks for, channels-last kept")
def _convolution_backward(ctx, node, args, kwargs):
    g, x, w = args[:3]
    rest = tuple(tuple(a) if isinstance(a, (list, tuple)) else a for a in args[3:])
    # stride, padding, dilation, output_padding: one value per spatial dim (torch records padding="valid" as
    # [0] and broadcasts it; the runtime's check and cuDNN's call take one per dim: SigLIP's patch embedding)
    nsp = len(x.shape) - 2
    rest = tuple(a * nsp if i in (1, 2, 3, 5) and isinstance(a, tuple) and len(a) == 1 and nsp > 1 else a
                 for i, a in enumerate(rest))
    mask = list(rest[-1])
    tg, tx, tw = (_targ(ctx, t, node, n) for t, n in zip((g, x, w), ("grad_output", "input", "weight")))
    vals = node.meta["val"]
    wanted = [i for i in range(3) if mask[i] and vals[i] is not None]
    if not wanted:
        return (None, None, None)
    results = tuple((tuple(vals[i].shape), dtype_name(vals[i].dtype, node.name), channels_last_perm(vals[i]))
                    for i in wanted)
    views = ctx.extern_results("aten.convolution_backward.default", (tg, tx, tw) + rest, {}, results)
    out = [None, None, None]
    for i, v in zip(wanted, views):
        out[i] = v
    return tuple(out)


@rule(aten.scaled_dot_product_attention.default, category="extern",
          note="dropout_p must be 0; a Triton flash-attention template where schedule/attention.py takes it, else "
               "torch's sdpa; the result buffer is laid out [B, T, H, D] as the flash kernels write it")
def _sdpa(ctx, node, args, kwargs):
    q, k, v = args[:3]
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
    scale = kwargs.get("scale", args[6] if len(args) > 6 else None)
    gqa = kwargs.get("enable_gqa", False)
    if dropout:
        raise UnsupportedOpError(str(node.target), node.name, "attention dropout",
                                 remedy="set dropout_p=0 (or put dropout after the attention)")
    squeeze = all(isinstance(t, View) and len(t.shape) == 3 for t in (q, k, v))
    if squeeze:  # [B, L, E] (no head dim): attended as one head, [B, 1, L, E] (the kernels take 4-d views)
        q, k, v = (t.unsqueeze(1) for t in (q, k, v))
        if isinstance(mask, View):
            while len(mask.shape) < 3:
                mask = mask.unsqueeze(0)
            mask = mask.unsqueeze(1)
    bc = sdpa_plan(tuple(q.shape), tuple(k.shape), tuple(v.shape)) if all(isinstance(t, View) for t in (q, k, v)) \
        else None
    if bc is not None:  # broadcast leading dims (Falcon's one key/value head): grouped heads, or expanded views
        ctx.decisions.append({"attention_broadcast": node.name, "why": bc.why})
        if bc.gqa:
            gqa = True
        else:
            q, k, v = (t.expand((*bc.lead, *t.shape[-2:])) for t in (q, k, v))
    tq, tk, tv = _bthe(ctx, node, (q, k, v), ("query", "key", "value"))
    tm = None if mask is None else _targ(ctx, mask, node, "attn_mask")
    _mask_decision(ctx, node)
    shape = out_shape(node)
    if squeeze:
        shape = (shape[0], 1, *shape[1:])
    mdt = None if mask is None else mask.dtype
    template, rec = attention_choice(node.name, tq, tk, tv, tm, bool(causal), bool(gqa), out_dtype(node), mdt)
    ctx.decisions.append(rec)
    if template:  # a flash-attention kernel of our own (schedule/attention.py decides, lower/attention.py)
        out = lower_attention(ctx, node, tq, tk, tv, bool(causal), scale, shape, out_dtype(node), tm, mdt)
        return out.squeeze([1]) if squeeze else out
    perm = [0, 2, 1, 3] if len(shape) == 4 else None
    if tm is not None and mdt == "bool" and isinstance(mask, View) and out_dtype(node) in _ADDITIVE_DTYPES:
        # torch turns a bool mask into an additive one (0 where kept, -inf elsewhere: its
        # convert_boolean_attn_mask) on every call, two fills and a masked_fill per layer (BERT-base at 32 x 512:
        # 290 us of 8.9 ms, H100); made here, once per program (the layers' equal masks merge:
        # schedule/inline._merge_equal), it is what sdpa's kernels read
        tm = _targ(ctx, _additive_mask(ctx, mask, out_dtype(node)), node, "attn_mask")
        rec["mask_made_additive"] = True
    kw = {"is_causal": bool(causal), "scale": scale, "enable_gqa": bool(gqa), "dropout_p": 0.0}
    out = ctx.extern("aten.scaled_dot_product_attention.default", (tq, tk, tv, tm), kw, shape, out_dtype(node),
                     False, storage_perm=perm)
    return out.squeeze([1]) if squeeze else out


_ADDITIVE_DTYPES = ("bfloat16", "float16", "float32")


def _additive_mask(ctx, mask: View, dt: str) -> View:
    """`where(mask, 0, -inf)` in the query's dtype, over the mask's shape: the additive mask torch's sdpa makes
    of a bool one for its math and efficient kernels (convert_boolean_attn_mask). A row masked everywhere then
    gives what -inf gives, 0 on the GPU's kernels as in the template and the training op (runtime/attention.py);
    torch's own cuDNN path fills a bool mask with a finite value instead, so there such a row may differ from
    eager (every other row is the same: exp of the fill underflows to 0 either way). Not checked on a GPU yet."""
    pv = syms("p", len(mask.shape))
    ranges = dict(zip(pv, mask.shape))
    keep = as_dtype(ctx.load(mask, list(pv), ranges), "bool")
    cdt = compute_dtype(dt)
    body = Op("where", (keep, Const(0.0, cdt), Const(float("-inf"), cdt)), cdt)
    return ctx.pointwise(tuple(mask.shape), dt, body, hint="mask")


def _mask_decision(ctx, node) -> None:
    """What export/masks.py did with this attention's mask (dropped, made causal, kept and why)."""
    rec = node.meta.get("aotfuse_mask")
    if rec is not None:
        ctx.decisions.append({"attention_mask": rec["attention"], "kept": rec["kept"], "why": rec["why"]})


_BTHD = [0, 2, 1, 3]  # [B, H, T, E] results stored [B, T, H, E], as the flash kernels write them
_BIAS_ALIGN = 8  # elements: the strides (but the last) the attention kernels read a bias with (runtime/attention.py)


def _mask_arg(ctx, mask, node):
    """A training attention's (aotfuse::attention*) mask argument. A float bias over a key length off a multiple of 8 (Swin's 49-token windows) is
    stored with its rows padded to 8 elements, so the kernels read it as it is: otherwise the runtime copies it into
    padded rows in every forward and backward (torch's sdpa does the same). A dim the mask is broadcast along stays
    broadcast (its one row block is what gets padded)."""
    if mask is None:
        return None
    if not isinstance(mask, View) or mask.dtype == "bool" or not all(static(x) for x in mask.shape) \
            or int(mask.shape[-1]) % _BIAS_ALIGN == 0:
        return _targ(ctx, mask, node, "attn_mask")
    t = mask.as_strided()
    if t is not None and int(t.stride[-1]) == 1 and all(int(x) % _BIAS_ALIGN == 0 for x in (*t.stride[:-1], t.offset)):
        return t
    full = [int(x) for x in mask.shape]
    bcast = [d for d in range(len(full) - 1) if t is not None and int(t.stride[d]) == 0 and full[d] > 1]
    base = mask
    for d in bcast:
        base = base.slice(d, 0, 1)
    s = full[-1]
    padded = ctx.pad_rows(base, -(-s // _BIAS_ALIGN) * _BIAS_ALIGN, f"the attention bias of {node.name}: rows of {s} "
                          f"padded to a multiple of {_BIAS_ALIGN}, read by the kernels as they are")
    view = padded.slice(-1, 0, s)
    return _targ(ctx, view.expand(full) if bcast else view, node, "attn_mask")


@rule(torch.ops.aotfuse.attention.default, category="extern",
      note="training's fused attention (runtime/attention.py): (out [B,H,T,E] stored [B,T,H,E], lse fp32 [B,H,T])")
def _attention(ctx, node, args, kwargs):
    q, k, v, mask, causal, scale, gqa = args[:7]
    window = _window(args, 7)
    tq, tk, tv = _bthe(ctx, node, (q, k, v), ("query", "key", "value"))
    tm = _mask_arg(ctx, mask, node)
    _mask_decision(ctx, node)
    out, lse = (node.meta["val"][i] for i in range(2))
    ctx.decisions.append({"attention": node.name, "kernel": "fused", "why": "aotfuse::attention extern: out and "
                          "logsumexp, no B x H x T x T tensor"})
    return ctx.extern_results("aotfuse.attention.default", (tq, tk, tv, tm, bool(causal), float(scale), bool(gqa),
                                                            *window), {},
                              ((tuple(out.shape), dtype_name(out.dtype, node.name), _BTHD),
                               (tuple(lse.shape), dtype_name(lse.dtype, node.name), None)))


def _window(args, i: int) -> tuple:
    """The optional sliding-window argument (export/masks.py sets it): (W,) when set, else () so a call without one
    is written as before (the archive's bytes do not change)."""
    w = args[i] if len(args) > i else 0
    return (int(w),) if w else ()


def _attention_grads(ctx, node, args, target: str):
    """An attention backward extern: (dq, dk, dv) stored [B,T,H,E]; a fourth result (the mask's gradient) as is."""
    g, q, k, v, mask, out, lse, causal, scale, gqa = args[:10]
    window = _window(args, 10) if target == "aotfuse.attention_backward.default" else ()
    tensors = _bthe(ctx, node, (g, q, k, v), ("grad_out", "query", "key", "value"))
    tm = _mask_arg(ctx, mask, node)
    (to,) = _bthe(ctx, node, (out,), ("out",))
    tl = _targ(ctx, lse, node, "lse")
    return ctx.extern_results(target, (*tensors, tm, to, tl, bool(causal), float(scale), bool(gqa), *window), {},
                              tuple((tuple(x.shape), dtype_name(x.dtype, node.name), _BTHD if i < 3 else None)
                                    for i, x in enumerate(node.meta["val"])))


@rule(torch.ops.aotfuse.attention_backward.default, category="extern",
      note="training's fused attention backward (runtime/attention.py): (dq, dk, dv), stored [B,T,H,E]")
def _attention_backward(ctx, node, args, kwargs):
    return _attention_grads(ctx, node, args, "aotfuse.attention_backward.default")


@rule(torch.ops.aotfuse.attention_backward_bias.default, category="extern",
      note="training's fused attention backward with a learned bias (runtime/attention.py): (dq, dk, dv) stored "
           "[B,T,H,E] and the bias's gradient in its own shape")
def _attention_backward_bias(ctx, node, args, kwargs):
    return _attention_grads(ctx, node, args, "aotfuse.attention_backward_bias.default")


@rule(aten.embedding_dense_backward.default, category="extern",
      note="atomic adds into an fp32 accumulator (aotfuse::embedding_backward); aten's sorted kernel for "
           "scale_grad_by_freq")
def _embedding_backward(ctx, node, args, kwargs):
    grad, idx, num_weights, padding_idx, scale = args[:5]
    n = arange_length(node.args[1])
    if isinstance(grad, View) and n is not None and isinstance(num_weights, int) and n <= num_weights and \
            static(grad.shape[-1]) and grad.numel == n * int(grad.shape[-1]):
        # indices arange(n): each weight row read once, in order (a position embedding); scale_grad_by_freq
        # divides by a frequency of 1
        ctx.decisions.append({"embedding_backward": node.name, "kernel": "pointwise",
                              "why": f"indices are arange({n}): the weight gradient is the output gradient's "
                                     f"rows (lower/embedding.py), no atomics"})
        return positional_grad(ctx, grad, n, int(num_weights), int(padding_idx), out_dtype(node))
    tg, ti = _targ(ctx, grad, node, "grad"), _targ(ctx, idx, node, "indices")
    if not scale:
        return ctx.extern("aotfuse.embedding_backward.default", (tg, ti, int(num_weights), int(padding_idx)), {},
                          out_shape(node), out_dtype(node), False)
    return ctx.extern("aten.embedding_dense_backward.out", (tg, ti, num_weights, padding_idx, scale), {},
                      out_shape(node), out_dtype(node), True)


@rule(_embedding_grad.mm_embedding_backward, category="extern",
      note="a tied table's gradient (joint/tied_embedding.py): the projection's product with the embedding's rows "
           "added into it, one buffer (aotfuse::mm_embedding_backward)")
def _mm_embedding_backward(ctx, node, args, kwargs):
    a, b, grad, idx, num_weights, padding_idx = args[:6]
    ta, tb = _operands(ctx, node, a, b)
    tg, ti = _targ(ctx, grad, node, "grad"), _targ(ctx, idx, node, "indices")
    return ctx.extern("aotfuse.mm_embedding_backward.default", (ta, tb, tg, ti, int(num_weights), int(padding_idx)),
                      {}, out_shape(node), out_dtype(node), False)


def register_all(register) -> None:
    """Files this module's rules in the registry (called once, by registry.build, in a fixed order)."""
    for r in RULES:
        register(*r.ops, category=r.category, note=r.note)(r.fn)
