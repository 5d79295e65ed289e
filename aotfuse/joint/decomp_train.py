"""Decompositions for training: backward ops become primitives the scheduler can lower and fuse.

`training_decompositions()` is the table handed to aot_autograd when it traces the joint
forward/backward graph. It is torch.export's core-ATen table, minus the ops we keep whole
(externs: mm, addmm, bmm, convolution, embedding, and embedding_dense_backward, which becomes
an allow-listed extern), plus our inference composites (`aotfuse.export.decomp.OURS`), plus the
backward decompositions below. Every one of them produces pointwise ops, reductions
(sum/amax/amin/mean), views, comparisons, `where`, casts, `arange`/`full` constants and the
externs; none uses gather/scatter/index ops.

Conventions (as in export/decomp.py): half inputs are upcast to fp32 for the math and the result is
cast back to the dtype the op would return.

Notes
- nll_loss uses the one-hot form `arange(C) == target[:, None]`; `ignore_index` rows get zero loss
  and zero gradient; reduction='mean' divides by the (weighted) count of non-ignored targets.
  A `joint.trace` pass recognises `eq(arange(C), target)` to record the target range [0, C).
- scaled_dot_product_attention becomes the fused op `aotfuse::attention` (an extern; its backward
  `aotfuse::attention_backward`, see runtime/attention.py), so no B x H x T x T tensor exists in the
  training graphs. Where the fused ops cannot apply (`fused_attention_refusal`) it becomes its math
  form (bmm, scale, causal mask from an `arange` comparison + `where`, softmax, bmm) whose backward
  is bmm + softmax-backward. dropout_p must be 0. aot_autograd dispatches sdpa's
  CompositeImplicitAutograd kernel in C++ above autograd (a table entry never sees it);
  `sdpa_math_mode()` is the TorchFunctionMode that `trace_joint` uses to route it.
- native_dropout(x, p, train) -> (x * mask * 1/(1-p), mask) with mask = `aten.rand(x.shape) >= p`
  (fp32 uniforms). The lowering implements `aten.rand.default` from a Philox seed input; the
  partitioner never recomputes it, so the mask drawn in the forward is the one the backward uses.
- max_pool2d_with_indices_backward is decomposed (without the indices) when windows do not overlap
  (stride == kernel, no padding, dilation 1, floor mode, sizes divisible by the kernel): the
  gradient goes to the first maximum of each window, as ATen does (NaN windows excepted); other
  configurations keep the op.
- _native_batch_norm_legit_functional (train-mode BatchNorm with running statistics, as
  functionalization hands it over) -> two-pass batch mean and biased variance, the normalized
  output, and the new running statistics by ATen's rule (unbiased variance), in the buffers'
  dtype; the trace returns those as buffer updates (joint/trace.py). `_native_batch_norm_legit.no_stats`
  (track_running_stats=False, and InstanceNorm) is the same without the update (export/decomp.py's
  decomposition, in OURS: inference needs it too). Their backward is native_batch_norm_backward above.
- native_group_norm is decomposed by OURS (export/decomp.py: rows of [N, groups, C/groups * HW], its
  statistics in fp32); native_group_norm_backward below reads them, LayerNorm's backward per row.
- gelu_backward with approximate='tanh' is written with the forward's sigmoid (s = sigmoid(2u)):
  s + 2 x s (1 - s) u', not aten's 0.5 (1 + tanh(u)) + ..., which cancels on the negative tail.
- convolution_backward stays whole (runtime/externs.py): cuDNN's dgrad/wgrad kernels. Written as
  convolutions (grad_weight as a convolution of the transposed input with the transposed gradient,
  the batch as channels) it ran 4x slower than eager on a ResNet-18 step.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from ..fxgraph import size_hint
from torch.overrides import TorchFunctionMode

from ..export.decomp import OURS, batch_norm_batch_stats
from ..runtime.externs import keep_whole

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def _up(x):
    return x.float() if x.dtype in _HALF else x


def _sum(x, dims, keepdim=False):
    return aten.sum.dim_IntList(x, list(dims), keepdim)


# ---------------------------------------------------------------- normalization

def _native_layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    n_norm = len(normalized_shape)
    axes = list(range(x.dim() - n_norm, x.dim()))
    outer = list(range(x.dim() - n_norm))
    g, xf = _up(grad_out), _up(x)
    xhat = (xf - mean) * rstd
    gi = gw = gb = None
    if output_mask[0]:
        gx = g * _up(weight) if weight is not None else g
        a = torch.mean(gx, axes, keepdim=True)
        b = torch.mean(gx * xhat, axes, keepdim=True)
        gi = (rstd * (gx - a - xhat * b)).to(x.dtype)
    if output_mask[1] and weight is not None:
        gw = (_sum(g * xhat, outer) if outer else g * xhat).to(weight.dtype)
    if output_mask[2] and bias is not None:
        gb = (_sum(g, outer) if outer else g).to(bias.dtype)
    return gi, gw, gb


def _native_batch_norm_backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                                output_mask):
    shape = [1, -1] + [1] * (x.dim() - 2)
    axes = [0] + list(range(2, x.dim()))
    g, xf = _up(grad_out), _up(x)
    if train:
        mean, invstd = _up(save_mean), _up(save_invstd)
    else:
        mean, invstd = _up(running_mean), torch.rsqrt(_up(running_var) + eps)
    mean, invstd = mean.reshape(shape), invstd.reshape(shape)
    xhat = (xf - mean) * invstd
    w = _up(weight).reshape(shape) if weight is not None else None
    gi = gw = gb = None
    if output_mask[0]:
        scale = invstd * w if w is not None else invstd
        if train:
            a = torch.mean(g, axes, keepdim=True)
            b = torch.mean(g * xhat, axes, keepdim=True)
            gi = (scale * (g - a - xhat * b)).to(x.dtype)
        else:
            gi = (g * scale).to(x.dtype)
    if output_mask[1] and weight is not None:
        gw = _sum(g * xhat, axes).to(weight.dtype)
    if output_mask[2]:
        gb = _sum(g, axes).to(weight.dtype if weight is not None else x.dtype)
    return gi, gw, gb


def _native_group_norm_backward(grad_out, x, mean, rstd, weight, N, C, HxW, group, output_mask):
    """GroupNorm's backward, as LayerNorm's over each (sample, group) row of x [N, C, *spatial] seen as
    [N, group, C // group, HxW] (views), with mean/rstd [N, group] from the forward (export/decomp.py):

        xhat = (x - mean) * rstd,   gx = grad * weight[c]
        grad_x = rstd * (gx - mean_row(gx) - xhat * mean_row(gx * xhat))
        grad_weight[c] = sum_{n, hw} grad * xhat,   grad_bias[c] = sum_{n, hw} grad

    in fp32 for half inputs; xhat is recomputed from x (never a saved normalized copy)."""
    n = x.shape[0]
    rows = [n, group, C // group, -1]
    g, xf = _up(grad_out).reshape(rows), _up(x).reshape(rows)
    stat = [n, group, 1, 1]
    xhat = (xf - _up(mean).reshape(stat)) * _up(rstd).reshape(stat)
    gi = gw = gb = None
    if output_mask[0]:
        gx = g * _up(weight).reshape(1, group, C // group, 1) if weight is not None else g
        a = torch.mean(gx, [2, 3], keepdim=True)
        b = torch.mean(gx * xhat, [2, 3], keepdim=True)
        gi = (_up(rstd).reshape(stat) * (gx - a - xhat * b)).reshape(x.shape).to(x.dtype)
    if output_mask[1] and weight is not None:
        gw = _sum(g * xhat, [0, 3]).reshape(C).to(weight.dtype)
    if output_mask[2]:
        gb = _sum(g, [0, 3]).reshape(C).to(weight.dtype if weight is not None else x.dtype)
    return gi, gw, gb


def _batch_norm_train_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """Train-mode BatchNorm with running statistics, as functionalization hands it over:
    (out, save_mean, save_rstd, new_running_mean, new_running_var). The new running statistics follow
    ATen's rule, `momentum * batch + (1 - momentum) * running` with the unbiased variance
    (n / (n - 1)), in the buffers' dtype: the runtime writes them into the module's buffers
    (joint/trace.py, runtime/training.py). save_mean/save_rstd are in the computation dtype, as
    the op's meta kernel says; the backward (`_native_batch_norm_backward`) reads them."""
    if not training:
        return NotImplemented  # eval mode arrives as _native_batch_norm_legit_no_training
    n = x.numel() // x.shape[1]
    out, save_mean, save_rstd, var = batch_norm_batch_stats(x, weight, bias, eps)
    unbiased = var * (n / max(n - 1, 1))
    new_mean = momentum * save_mean + (1.0 - momentum) * _up(running_mean)
    new_var = momentum * unbiased + (1.0 - momentum) * _up(running_var)
    return out, save_mean, save_rstd, new_mean.to(running_mean.dtype), new_var.to(running_var.dtype)


# ---------------------------------------------------------------- activations

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_K_TANH = math.sqrt(2.0 / math.pi)


def _gelu_backward(grad, x, approximate="none"):
    g, xf = _up(grad), _up(x)
    if approximate == "tanh":
        # With u = k (x + 0.044715 x^3) and s = sigmoid(2u) = 0.5 (1 + tanh(u)): 1 - tanh(u)^2 = 4 s (1 - s), so
        # aten's 0.5 (1 + t) + 0.5 x (1 - t^2) u' is s + 2 x s (1 - s) u'. No 1 + t to cancel on the negative
        # tail: s keeps its relative accuracy there (aten's form is exactly 0 below x = -5.5 in fp32); s (1 - s)
        # is taken before x and u' multiply it, so where s is 0 a huge |x| gives 0, not 0 * inf. The
        # sigmoid's argument is spelled as the forward's decomposition spells it (export/decomp._gelu), so a
        # backward kernel that also recomputes the GELU (the partition's choice) computes one sigmoid.
        s = torch.sigmoid((2.0 * _K_TANH) * (xf + 0.044715 * xf * xf * xf))
        d_inner = _K_TANH * (1.0 + 3.0 * 0.044715 * (xf * xf))
        d = s + (2.0 * xf) * (s * (1.0 - s)) * d_inner
    else:
        cdf = 0.5 * (1.0 + torch.erf(xf * _SQRT1_2))
        pdf = torch.exp(-0.5 * xf * xf) * _INV_SQRT_2PI
        d = cdf + xf * pdf
    return (g * d).to(grad.dtype)


def _threshold_backward(grad, x, threshold):
    return torch.where(x <= threshold, 0.0, grad)


def _sigmoid_backward(grad, y):
    yf = _up(y)
    return (_up(grad) * (yf * (1.0 - yf))).to(grad.dtype)


def _tanh_backward(grad, y):
    yf = _up(y)
    return (_up(grad) * (1.0 - yf * yf)).to(grad.dtype)


def _silu_backward(grad, x):
    xf = _up(x)
    s = torch.sigmoid(xf)
    return (_up(grad) * (s * (1.0 + xf * (1.0 - s)))).to(grad.dtype)


def _softmax_backward_data(grad, out, dim, input_dtype):
    g, y = _up(grad), _up(out)
    gy = g * y
    return (gy - y * _sum(gy, [dim], True)).to(input_dtype)


def _log_softmax_backward_data(grad, out, dim, input_dtype):
    g = _up(grad)
    return (g - torch.exp(_up(out)) * _sum(g, [dim], True)).to(input_dtype)


# ---------------------------------------------------------------- dropout

def _native_dropout(x, p, train):
    if train is not None and not train:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    if p >= 1.0:
        return x * 0.0, torch.zeros_like(x, dtype=torch.bool)
    u = aten.rand.default(list(x.shape), dtype=torch.float32, device=x.device)
    mask = u >= p
    out = (_up(x) * mask * (1.0 / (1.0 - p))).to(x.dtype)
    return out, mask


def _native_dropout_backward(grad, mask, scale):
    return (_up(grad) * mask * scale).to(grad.dtype)


# ---------------------------------------------------------------- losses

_REDUCTION_NONE, _REDUCTION_MEAN, _REDUCTION_SUM = 0, 1, 2


def _nll_rows(self, target, weight, ignore_index):
    """One-hot selection for nll_loss: (x [N, C] upcast, onehot [N, C] bool, w [N] row weight, valid [N])."""
    x = _up(self)
    if self.dim() == 1:
        x, target = x.unsqueeze(0), target.unsqueeze(0)
    c = x.shape[1]
    classes = aten.arange.default(c, dtype=target.dtype, device=self.device)
    onehot = classes.unsqueeze(0) == target.unsqueeze(1)
    valid = target != ignore_index
    if weight is not None:
        w = _sum(torch.where(onehot, _up(weight).unsqueeze(0), 0.0), [1])
        w = torch.where(valid, w, 0.0)
    else:
        w = valid.to(x.dtype)
    return x, onehot, w, valid


def _nll_loss_forward(self, target, weight, reduction, ignore_index):
    x, onehot, w, valid = _nll_rows(self, target, weight, ignore_index)
    picked = _sum(torch.where(onehot, x, 0.0), [1])
    losses = torch.where(valid, -picked * w, 0.0)
    if reduction == _REDUCTION_NONE:
        out = losses if self.dim() == 2 else losses.squeeze(0)
        return out.to(self.dtype), torch.zeros((), dtype=self.dtype, device=self.device)
    total = _sum(w, [0])
    s = _sum(losses, [0])
    out = s / total if reduction == _REDUCTION_MEAN else s
    return out.to(self.dtype), total.to(self.dtype)


def _nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    x, onehot, w, valid = _nll_rows(self, target, weight, ignore_index)
    g = _up(grad_output)
    if reduction == _REDUCTION_MEAN:
        g = g / _up(total_weight)
    if reduction == _REDUCTION_NONE and self.dim() == 1:
        g = g.unsqueeze(0)
    row = -(w * g)  # [N]
    keep = torch.logical_and(onehot, valid.unsqueeze(1))
    gi = torch.where(keep, row.unsqueeze(1), 0.0)
    if self.dim() == 1:
        gi = gi.squeeze(0)
    return gi.to(self.dtype)


def _mse_loss(x, target, reduction=_REDUCTION_MEAN):
    d = _up(x) - _up(target)
    sq = d * d
    if reduction == _REDUCTION_MEAN:
        sq = torch.mean(sq)
    elif reduction == _REDUCTION_SUM:
        sq = _sum(sq, list(range(sq.dim())))
    return sq.to(x.dtype)


def _mse_loss_backward(grad, x, target, reduction):
    norm = 2.0 / x.numel() if reduction == _REDUCTION_MEAN else 2.0
    return (_up(grad) * norm * (_up(x) - _up(target))).to(x.dtype)


# ---------------------------------------------------------------- attention (math form)

def sdpa_math(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """scaled_dot_product_attention as bmm -> scale -> mask -> softmax -> bmm."""
    if dropout_p:
        from ..errors import UnsupportedOpError

        raise UnsupportedOpError("aten.scaled_dot_product_attention", "sdpa", "attention dropout in training",
                                 remedy="set dropout_p=0 (or put dropout after the attention)")
    L, S, E, Ev = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]

        def widen(t):
            lead = list(t.shape[:-3])
            h = t.shape[-3]
            t = t.unsqueeze(-3).expand(*lead, h, rep, t.shape[-2], t.shape[-1])
            return t.reshape(*lead, h * rep, t.shape[-2], t.shape[-1])
        k, v = widen(k), widen(v)
    batch = list(q.shape[:-2])
    nb = 1
    for d in batch:
        nb *= d
    q3, k3, v3 = q.reshape(nb, L, E), k.reshape(nb, S, E), v.reshape(nb, S, Ev)
    scores = _up(aten.bmm.default(q3, k3.transpose(1, 2)))
    scores = scores * (scale if scale is not None else 1.0 / math.sqrt(E))
    if is_causal:
        rows = aten.arange.default(L, device=q.device).unsqueeze(1)
        cols = aten.arange.default(S, device=q.device).unsqueeze(0)
        scores = torch.where(rows >= cols, scores, float("-inf"))
    if attn_mask is not None:
        m = attn_mask.expand(*batch, L, S).reshape(nb, L, S)
        scores = torch.where(m, scores, float("-inf")) if m.dtype == torch.bool else scores + _up(m)
    p = torch.softmax(scores, -1)
    out = aten.bmm.default(p.to(v.dtype), v3)
    return out.reshape(*batch, L, Ev)


def fused_attention_refusal(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False) -> str | None:
    """Why this attention call cannot use the fused ops (runtime/attention.py), or None when it can."""
    from ..runtime.attention import shapes

    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "query, key and value must be tensors"
    why = shapes(tuple(q.shape), tuple(k.shape), tuple(v.shape),
                 None if attn_mask is None else tuple(attn_mask.shape), bool(enable_gqa))
    if why:
        return why
    if not (q.dtype == k.dtype == v.dtype and q.dtype.is_floating_point):
        return f"query, key, value of dtypes {q.dtype}, {k.dtype}, {v.dtype}"
    if attn_mask is not None:
        if attn_mask.requires_grad and (attn_mask.dtype == torch.bool or q.shape[-1] > 128):
            # a learned bias's gradient comes from the efficient kernel (aotfuse::attention_backward_bias),
            # whose backward takes head dims up to 128
            return f"the attention mask requires grad with a head dim of {q.shape[-1]} (the fused backward's " \
                   "bias gradient takes head dims up to 128)"
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            return f"attention mask of dtype {attn_mask.dtype}"
        if is_causal:
            return "an attention mask with is_causal=True"
    return None


class sdpa_math_mode(TorchFunctionMode):
    """Routes F.scaled_dot_product_attention while the joint graph is traced: to the fused op
    `aotfuse::attention` (runtime/attention.py; its autograd formula puts `aotfuse::attention_backward`
    in the backward, and the partition saves q, k, v, out and the fp32 logsumexp), or, where the fused
    ops cannot apply (`fused_attention_refusal`: a learned mask with a head dim above 128, 3-d inputs, a value head
    dim other than the query's, ...), to its math form `sdpa_math`. Attention dropout is refused either way.

    sdpa's CompositeImplicitAutograd kernel picks a flash kernel above autograd, so a decomposition
    table entry alone never sees it; this mode intercepts it at the torch-function level. `decisions`
    records each call's choice (the partition report's "attention" list, shown by `aotfuse explain`)."""

    def __init__(self, fused: bool = True):
        super().__init__()
        self.fused = fused
        self.decisions: list[dict] = []

    def new_run(self) -> None:
        """The model's forward starts again (aot_autograd runs it more than once: metadata collection,
        then the joint trace; each run makes the same calls): keep the last run's decisions."""
        self.decisions = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention or \
                func is torch._C._nn.scaled_dot_product_attention:
            return self._sdpa(*args, **kwargs)
        if func is torch.nn.functional.multi_head_attention_forward:
            return self._mha(func, args, kwargs)
        return func(*args, **kwargs)

    def _mha(self, func, args, kwargs):
        """nn.MultiheadAttention (nn.TransformerEncoder, torchvision's ViT): F.multi_head_attention_forward's
        Python body calls sdpa through the module's global name while this mode is off (a mode does not see
        the calls of the function it is handling, and turning it on again re-enters this call). That name is
        routed here for the duration of the call."""
        F = torch.nn.functional
        real = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._sdpa
        try:
            return func(*args, **kwargs)
        finally:
            F.scaled_dot_product_attention = real

    def _sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p:
            sdpa_math(q, k, v, dropout_p=dropout_p)  # raises the refusal, with its remedy
        from ..sdpa_shapes import plan

        bc = plan(tuple(q.shape), tuple(k.shape), tuple(v.shape)) if all(
            isinstance(t, torch.Tensor) for t in (q, k, v)) else None
        if bc is not None:  # broadcast leading dims (Falcon's one key/value head): grouped heads, or expanded
            if bc.gqa:
                enable_gqa = True
            else:
                q, k, v = (t.expand(*bc.lead, *t.shape[-2:]) for t in (q, k, v))
        why = fused_attention_refusal(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) \
            if self.fused else "fused attention is off"
        i = len(self.decisions)
        shape = [size_hint(s) for s in q.shape]  # a dynamic dim: its example size (no guard)
        if why is None:
            from ..runtime.attention import attention

            s = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
            self.decisions.append({"attention": i, "kernel": "fused", "query": shape, "causal": bool(is_causal),
                                   "mask": attn_mask is not None, "gqa": bool(enable_gqa and k.shape[1] != q.shape[1]),
                                   "why": "aotfuse::attention: no B x H x T x T tensor; saves q, k, v, out, lse"})
            if bc is not None:
                self.decisions[-1]["why"] += f"; {bc.why}"
            if attn_mask is not None and attn_mask.dtype == torch.bool and q.dtype.is_floating_point:
                # the additive mask (0 / -inf in q's dtype) the runtime would make from a bool one in every layer's
                # forward and backward, made once in the graph (the layers' equal conversions merge: _cse)
                attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(q.dtype)
                self.decisions[-1]["why"] += "; its bool mask made additive (0 / -inf) once in the graph"
            return attention(q, k, v, attn_mask, bool(is_causal), s, bool(enable_gqa))[0]
        self.decisions.append({"attention": i, "kernel": "math", "query": shape,
                               "why": why + (f"; {bc.why}" if bc is not None else "")})
        return sdpa_math(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


# ---------------------------------------------------------------- pooling / convolution

def _max_pool2d_with_indices_backward(grad_out, x, kernel, stride, padding, dilation, ceil_mode, indices):
    kh, kw = (kernel[0], kernel[-1]) if len(kernel) else (1, 1)
    sh, sw = (stride[0], stride[-1]) if stride else (kh, kw)
    pads = list(padding) if isinstance(padding, (list, tuple)) else [padding]
    dils = list(dilation) if isinstance(dilation, (list, tuple)) else [dilation]
    H, W = x.shape[-2], x.shape[-1]
    if (sh, sw) != (kh, kw) or any(pads) or any(d != 1 for d in dils) or ceil_mode or H % kh or W % kw:
        return NotImplemented
    lead = list(x.shape[:-2])
    ho, wo = H // kh, W // kw
    xw = x.reshape(*lead, ho, kh, wo, kw)
    mx = aten.amax.default(xw, [-3, -1], True)
    hit = xw == mx
    pos = (aten.arange.default(kh, dtype=torch.float32, device=x.device).reshape(kh, 1, 1) * kw
           + aten.arange.default(kw, dtype=torch.float32, device=x.device).reshape(1, 1, kw))
    first = aten.amin.default(torch.where(hit, pos, float(kh * kw)), [-3, -1], True)
    sel = pos == first
    g = grad_out.reshape(*lead, ho, 1, wo, 1)
    return torch.where(sel, g, 0.0).to(grad_out.dtype).reshape(x.shape)


# ---------------------------------------------------------------- slices

def _slice_scatter(base, src, dim=0, start=None, end=None, step=1):
    """The backward of a slice (RoPE's rotate_half, x[..., :n]): base with src written over
    [start, end) of dim, as a cat of base's two outer slices around src (step 1; else kept)."""
    if step != 1:
        return NotImplemented
    dim = dim % base.dim()
    size = base.shape[dim]
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    start, end = max(0, min(start, size)), max(0, min(end, size))
    if end - start != src.shape[dim]:
        return NotImplemented
    parts = []
    if start > 0:
        parts.append(aten.slice.Tensor(base, dim, 0, start))
    parts.append(src.to(base.dtype))
    if end < size:
        parts.append(aten.slice.Tensor(base, dim, end, size))
    if len(parts) == 1:
        return parts[0].clone()
    out = torch.cat(parts, dim)
    if not base.is_contiguous():
        # slice_scatter's result has base's strides, and functionalization replays the views of an in-place op on
        # it with them (Funnel's `positional_attn *= cls_mask` on views of a permuted einsum: a row-major cat made
        # the replayed view impossible, "Cannot view a tensor with shape ... and strides ...")
        out = aten.copy.default(torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device=base.device),
                                out)
    return out


def _unfold_backward(grad, input_size, dimension, size, step):
    """Tensor.unfold's gradient: each input element sums the window elements that read it. Element i of dim is
    read by window i // step - k at offset i % step + k * step, for k < ceil(size / step): with the window dim
    padded to a multiple of step, term k is grad's [W, step] block k flattened and shifted k * step along dim.
    Pads, slices and adds only (one pointwise kernel), no scatter; overlapping (step < size), tiling and gapped
    (step > size) windows alike."""
    nd = len(input_size)
    if nd == 0:
        return grad.squeeze(0)
    dim = dimension % nd
    length, windows = int(input_size[dim]), int(grad.shape[dim])
    g = grad.movedim(-1, dim + 1)  # [..., W, size, ...]
    k_max = -(-size // step)
    if k_max * step > size:
        g = _pad_dim(g, dim + 1, 0, k_max * step - size)
    out = None
    for k in range(k_max):
        n = min(windows * step, length - k * step)
        if n <= 0:
            break
        flat = aten.slice.Tensor(g, dim + 1, k * step, (k + 1) * step).flatten(dim, dim + 1)
        term = _pad_dim(aten.slice.Tensor(flat, dim, 0, n), dim, k * step, length - k * step - n)
        out = term if out is None else out + term
    return out


def _pad_dim(x, dim: int, before: int, after: int):
    """x with `before` / `after` zeros along dim."""
    if not before and not after:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [before, after]
    return aten.constant_pad_nd.default(x, pad, 0.0)


def _cdist_backward(grad, x1, x2, p, dist):
    """_cdist_forward's gradient for x1 (autograd calls it with the operands swapped for x2), ATen's formulas per
    p: 0 where the distance is 0 (and for p < 1 where a coordinate difference is), a tie of the inf-norm
    passing the whole gradient to every tied coordinate."""
    diff = x1.unsqueeze(-2) - x2.unsqueeze(-3)  # [..., P, R, M]
    g, d = grad.unsqueeze(-1), dist.unsqueeze(-1)
    if p == 0:
        return torch.zeros_like(x1)
    if p == 1:
        term = g * torch.sign(diff)
    elif p == math.inf:
        term = g * torch.sign(diff) * (diff.abs() == d).to(diff.dtype)
    else:
        if p == 2:
            raw = g * diff / d
        elif p < 2:
            raw = torch.sign(diff) * diff.abs().pow(p - 1) * g / d.pow(p - 1)
        else:
            raw = diff * diff.abs().pow(p - 2) * g / d.pow(p - 1)
        zero = d == 0
        if p < 1:
            zero = zero | (diff == 0)
        term = torch.where(zero, 0.0, raw)
    return term.sum(-2).to(x1.dtype)


# ---------------------------------------------------------------- the table

TRAIN: dict = {
    aten.native_layer_norm_backward.default: _native_layer_norm_backward,
    aten.native_batch_norm_backward.default: _native_batch_norm_backward,
    aten.native_group_norm_backward.default: _native_group_norm_backward,
    aten._native_batch_norm_legit_functional.default: _batch_norm_train_functional,
    aten.gelu_backward.default: _gelu_backward,
    aten.threshold_backward.default: _threshold_backward,
    aten.sigmoid_backward.default: _sigmoid_backward,
    aten.tanh_backward.default: _tanh_backward,
    aten.silu_backward.default: _silu_backward,
    aten._softmax_backward_data.default: _softmax_backward_data,
    aten._log_softmax_backward_data.default: _log_softmax_backward_data,
    aten.native_dropout.default: _native_dropout,
    aten.native_dropout_backward.default: _native_dropout_backward,
    aten.nll_loss_forward.default: _nll_loss_forward,
    aten.nll_loss_backward.default: _nll_loss_backward,
    aten.mse_loss.default: _mse_loss,
    aten.mse_loss_backward.default: _mse_loss_backward,
    aten.scaled_dot_product_attention.default: sdpa_math,
    aten.max_pool2d_with_indices_backward.default: _max_pool2d_with_indices_backward,
    aten.slice_scatter.default: _slice_scatter,
    aten.unfold_backward.default: _unfold_backward,
    aten._cdist_backward.default: _cdist_backward,
}

# Kept whole in training graphs: the inference externs (minus sdpa, which training decomposes)
# and embedding_dense_backward (runtime/externs.py says which).
KEEP_WHOLE_TRAIN: tuple = keep_whole(train=True)


def training_decompositions() -> dict:
    """op -> decomposition for aot_autograd's joint trace (core ATen + OURS + TRAIN)."""
    table = dict(torch.export.default_decompositions())
    for op in KEEP_WHOLE_TRAIN:
        table.pop(op, None)
    table.update(OURS)
    table.update(TRAIN)
    return table


def train_ops() -> Sequence:
    """The ops this module decomposes itself (for docs and tests)."""
    return tuple(TRAIN)
