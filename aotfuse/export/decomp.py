"""Our decomposition table: composite ops become primitives the scheduler can fuse.

Starts from torch.export's default table (core ATen) and then
- keeps matmuls, convolution, attention and embedding whole (they become externs), and
- replaces the decompositions of the composites we care about with our own, written so that each
  one lowers to a few reductions and pointwise ops (one kernel each after fusion).
"""
from __future__ import annotations

import math

import torch
import torch._decomp

from ..runtime.externs import keep_whole
from .maxpool3d import max_pool3d_with_indices
from .upsample import UPSAMPLE

aten = torch.ops.aten

# Ops kept whole: the runtime calls them as allow-listed aten externs (the one table: runtime/externs.py).
KEEP_WHOLE = keep_whole(train=False)


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    mean = torch.mean(xf, dims, keepdim=True)
    centered = xf - mean
    var = torch.mean(centered * centered, dims, keepdim=True)
    out = centered * torch.rsqrt(var + eps)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return _as_eager_layout(out.to(x.dtype))


def _as_eager_layout(out):
    """LayerNorm's output is contiguous in eager (ATen's kernel normalizes a contiguous copy), whatever the input's
    strides; the decomposition's pointwise ops would keep a permuted input's. A consumer's decomposition picks by
    strides (matmul folds a contiguous [..., K] into one mm, but runs a permuted one as a bmm over all leading dims
    but one: ConvNeXt's channels-last LayerNorm after a permute fed 3584 matmuls of 56 rows to cuBLAS). The copy
    costs nothing: the kernel that computes the normalized values writes them in this order."""
    return out.contiguous()


def _native_layer_norm(x, normalized_shape, weight, bias, eps):
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    mean = torch.mean(xf, dims, keepdim=True)
    centered = xf - mean
    var = torch.mean(centered * centered, dims, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    out = centered * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return _as_eager_layout(out.to(x.dtype)), mean, rstd


def _channel_shape(x) -> list:
    """[1, C, 1, ...]: a per-channel vector broadcast over x [N, C, *spatial]."""
    return [1, -1] + [1] * (x.dim() - 2)


def _native_group_norm(x, weight, bias, N, C, HxW, group, eps):
    """GroupNorm: x [N, C, *spatial] seen as [N, group, C // group * HxW] (a view: index math), each row's
    mean and biased variance (the norm's Welford pair: mean, then the mean of squared deviations), in fp32 for
    half inputs. Returns (out in x's dtype, mean [N, group], rstd [N, group]); the statistics stay in the
    computation dtype, as for native_layer_norm, so the backward reads them unrounded."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    rows = xf.reshape(x.shape[0], group, -1)
    mean = torch.mean(rows, [2], keepdim=True)
    centered = rows - mean
    var = torch.mean(centered * centered, [2], keepdim=True)
    rstd = torch.rsqrt(var + eps)
    out = (centered * rstd).reshape(x.shape)
    if weight is not None:
        out = out * weight.reshape(_channel_shape(x))
    if bias is not None:
        out = out + bias.reshape(_channel_shape(x))
    return out.to(x.dtype), mean.reshape(x.shape[0], group), rstd.reshape(x.shape[0], group)


def batch_norm_batch_stats(x, weight, bias, eps):
    """Normalize over the batch: (out in x's dtype, mean, rstd, biased var), the statistics [C] in the
    computation dtype (fp32 for half inputs; the mean, then the mean of squared deviations: a Welford pair)."""
    shape = _channel_shape(x)
    axes = [0] + list(range(2, x.dim()))
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    mean = torch.mean(xf, axes, keepdim=True)
    xc = xf - mean
    var = torch.mean(xc * xc, axes, keepdim=True)  # biased: what normalizes the batch
    rstd = torch.rsqrt(var + eps)
    out = xc * rstd
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out.to(x.dtype), mean.reshape(-1), rstd.reshape(-1), var.reshape(-1)


def _batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    """BatchNorm without running statistics (track_running_stats=False, and InstanceNorm, which torch runs as
    one over x viewed as [1, N * C, *spatial]): batch statistics in train and eval mode alike; nothing to
    update."""
    out, save_mean, save_rstd, _ = batch_norm_batch_stats(x, weight, bias, eps)
    return out, save_mean, save_rstd


def _rms_norm(x, normalized_shape, weight=None, eps=None):
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    out = xf * torch.rsqrt(torch.mean(xf * xf, dims, keepdim=True) + eps)
    if weight is not None:
        out = out * weight
    return out.to(x.dtype)


def _gelu(x, approximate="none"):
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    if approximate == "tanh":
        # 0.5 * (1 + tanh(u)) == sigmoid(2u): one exponential and one division per element instead of a
        # tanh, and no cancellation in 1 + tanh(u) where u is very negative (the left tail keeps its
        # relative accuracy). H100, bench_kernels GELU(tanh)(x + b) 16384 x 4096 bf16: see docs/benchmarks.md.
        inner = (2.0 * math.sqrt(2.0 / math.pi)) * (xf + 0.044715 * xf * xf * xf)
        out = xf * torch.sigmoid(inner)
    else:
        out = 0.5 * xf * (1.0 + torch.erf(xf * (1.0 / math.sqrt(2.0))))
    return out.to(x.dtype)


def _var_parts(x, dim, correction, keepdim):
    """(variance, mean) of torch.var / torch.var_mean with `correction` (default 1): in fp32 for half inputs,
    the mean first, then the sum of squared deviations (a Welford pair for the kernels), over
    max(N - correction, 0) as torch (0: inf, or nan for a zero sum)."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    dims = list(range(x.dim())) if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0) else (
        [dim] if isinstance(dim, int) else list(dim))
    dims = [d % max(x.dim(), 1) for d in dims]
    n = 1
    for d in dims:
        n = n * x.shape[d]
    corr = 1 if correction is None else correction
    mean = torch.mean(xf, dims, keepdim=True)
    centered = xf - mean
    denom = n - corr
    if isinstance(denom, (int, float)):
        denom = max(denom, 0)
    var = torch.sum(centered * centered, dims, keepdim=keepdim) / denom
    if not keepdim:
        mean = mean.squeeze(dims) if dims else mean
    return var.to(x.dtype), mean.to(x.dtype)


def _var_correction(x, dim=None, *, correction=None, keepdim=False):
    return _var_parts(x, dim, correction, keepdim)[0]


def _var_mean_correction(x, dim=None, *, correction=None, keepdim=False):
    return _var_parts(x, dim, correction, keepdim)


def _elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    """ELU (SELU and CELU are ELUs with other constants): x * scale above 0, else (exp(x * input_scale) - 1) *
    alpha * scale, in fp32 for half inputs; expm1 as ATen's kernel computes it."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    neg = torch.expm1(xf * input_scale) * (alpha * scale)
    return torch.where(xf > 0, xf * scale, neg).to(x.dtype)


def _leaky_relu(x, negative_slope=0.01):
    return torch.where(x > 0, x, x * negative_slope)


def _clamp_tensor(x, min=None, max=None):
    """clamp with tensor bounds: NaN in x stays NaN (maximum/minimum propagate it), as ATen's clamp; a NaN bound
    gives NaN, as there."""
    out = x
    if min is not None:
        out = torch.maximum(out, min.to(out.dtype))  # .to is no op at the same dtype
    if max is not None:
        out = torch.minimum(out, max.to(out.dtype))
    return out


def _one_hot(t, num_classes=-1):
    """F.one_hot without torch's data checks (`_assert_async` on min >= 0 and max < C, which need the values on
    the host): an id outside [0, C) gives an all-zero row instead of eager's error, as in training archives (the
    joint trace never had the checks). num_classes must be given (-1 asks for max + 1: a data-dependent shape,
    which export refuses first)."""
    if num_classes < 0:
        return NotImplemented
    return (t.unsqueeze(-1) == torch.arange(num_classes, device=t.device)).to(torch.int64)


def _adaptive_max_pool2d(x, output_size):
    """An adaptive max pool whose input is a whole number of windows: max_pool2d with stride = kernel (the same
    values and flat indices). Other sizes keep the op, which lowering refuses by name."""
    from ..joint.pooling import divisible_windows, windowed_max

    k = divisible_windows(x, output_size)
    if k is None:
        return NotImplemented
    return windowed_max(x, k)


def _baddbmm(self, batch1, batch2, beta=1, alpha=1):
    """beta * self + alpha * (batch1 @ batch2) with the product in the operands' dtype (cuBLAS, fp32 accumulation)
    and the scaling and add in fp32, rounded once. Torch's decomposition casts every operand to fp32 first
    (`pw_cast_for_opmath`): BLOOM's ALiBi attention scores ran as an fp32 bmm of upcast copies."""
    if not batch1.is_floating_point():
        return NotImplemented
    prod = torch.bmm(batch1, batch2)
    half = prod.dtype in (torch.float16, torch.bfloat16)
    out = prod.float() if half else prod
    if alpha != 1:
        out = out * alpha
    if beta != 0:
        out = out + (self.float() if half else self) * beta
    return out.to(prod.dtype)


def _silu(x):
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (xf * torch.sigmoid(xf)).to(x.dtype)


def _softmax(x, dim, half_to_float=False):
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    shifted = xf - torch.amax(xf, dim, keepdim=True)
    e = torch.exp(shifted)
    out = e / torch.sum(e, dim, keepdim=True)
    return out if half_to_float else out.to(x.dtype)


def _softmax_int(x, dim, dtype=None):
    out = _softmax(x, dim, half_to_float=True)
    return out.to(dtype if dtype is not None else x.dtype)


def _log_softmax(x, dim, half_to_float=False):
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    shifted = xf - torch.amax(xf, dim, keepdim=True)
    out = shifted - torch.log(torch.sum(torch.exp(shifted), dim, keepdim=True))
    return out if half_to_float else out.to(x.dtype)


def _log_softmax_int(x, dim, dtype=None):
    out = _log_softmax(x, dim, half_to_float=True)
    return out.to(dtype if dtype is not None else x.dtype)


def _batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    shape = [1, -1] + [1] * (x.dim() - 2)
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    out = (xf - running_mean.reshape(shape)) * torch.rsqrt(running_var.reshape(shape) + eps)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    empty = x.new_zeros((0,))
    return out.to(x.dtype), empty, empty


def _full_like(x, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    # Shapes are static: a full of the known shape, which lowering folds into a constant. (Left as
    # full_like it would name the input x, and constant folding cannot evaluate it.)
    return torch.full(tuple(x.shape), fill_value, dtype=dtype or x.dtype, device=device or x.device)


def _constant_pad_nd(x, pad, value=0.0):
    # F.pad(x, pads, value=v): slices (negative pads) and a cat with constant-filled blocks, all of which
    # lower (transformers' causal-LM loss pads the labels with the ignore index).
    out = x
    for i in range(len(pad) // 2):
        dim = x.dim() - 1 - i
        lo, hi = int(pad[2 * i]), int(pad[2 * i + 1])
        if lo < 0 or hi < 0:
            out = aten.slice.Tensor(out, dim, max(-lo, 0), out.shape[dim] + min(hi, 0))
        parts = [out]
        for n, at in ((lo, 0), (hi, 1)):
            if n > 0:
                shape = list(out.shape)
                shape[dim] = n
                parts.insert(len(parts) * at, torch.full(shape, value, dtype=x.dtype, device=x.device))
        if len(parts) > 1:
            out = torch.cat(parts, dim)
    return out.clone() if out is x else out


def _linalg_vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """torch.linalg.vector_norm (F.normalize, clip_grad_norm_-style code): reduced in fp32 for half inputs (as
    torch accumulates), returned in the input's (or the requested) dtype."""
    out_dtype = dtype or x.dtype
    acc = x.to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x.to(out_dtype)
    dims = list(range(x.dim())) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    if not dims:
        dims = list(range(x.dim()))
    a = acc.abs()
    if ord == 2:
        r = (acc * acc).sum(dims, keepdim=keepdim).sqrt()
    elif ord == 1:
        r = a.sum(dims, keepdim=keepdim)
    elif ord == math.inf:
        r = a.amax(dims, keepdim=keepdim)
    elif ord == -math.inf:
        r = a.amin(dims, keepdim=keepdim)
    elif ord == 0:
        r = (acc != 0).to(acc.dtype).sum(dims, keepdim=keepdim)
    else:
        r = a.pow(ord).sum(dims, keepdim=keepdim).pow(1.0 / ord)
    return r.to(out_dtype)


def _cdist_forward(x1, x2, p, compute_mode=None):
    """torch.cdist's direct form (what eager runs below 25 rows; above, torch.cdist itself picks the matmul form
    before this op): the p-norm of every row difference, one fused reduction, no [P, R, M] tensor stored."""
    return _linalg_vector_norm(x1.unsqueeze(-2) - x2.unsqueeze(-3), p, -1)


def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """aten._trilinear (nn.Bilinear's x1^T W x2): the three operands unsqueezed at their expand dims, multiplied
    and summed over sumdim, one fused reduction (no tensor cores: nn.Bilinear layers are small)."""
    def grow(t, dims):
        for d in sorted(dims):
            t = t.unsqueeze(d)
        return t

    prod = grow(i1, expand1) * grow(i2, expand2) * grow(i3, expand3)
    return prod.sum(list(sumdim)) if sumdim else prod


OURS = {
    aten.layer_norm.default: _layer_norm,
    aten.native_layer_norm.default: _native_layer_norm,
    aten.rms_norm.default: _rms_norm,
    aten.gelu.default: _gelu,
    aten.silu.default: _silu,
    aten.elu.default: _elu,
    aten.one_hot.default: _one_hot,
    aten.baddbmm.default: _baddbmm,
    aten.adaptive_max_pool2d.default: _adaptive_max_pool2d,
    aten.leaky_relu.default: _leaky_relu,
    aten.clamp.Tensor: _clamp_tensor,
    aten.softmax.int: _softmax_int,
    aten._softmax.default: _softmax,
    aten.log_softmax.int: _log_softmax_int,
    aten._log_softmax.default: _log_softmax,
    aten._native_batch_norm_legit_no_training.default: _batch_norm_no_training,
    aten._native_batch_norm_legit.no_stats: _batch_norm_no_stats,
    aten.native_group_norm.default: _native_group_norm,
    aten.full_like.default: _full_like,
    aten.constant_pad_nd.default: _constant_pad_nd,
    aten.linalg_vector_norm.default: _linalg_vector_norm,
    aten._cdist_forward.default: _cdist_forward,
    aten._trilinear.default: _trilinear,
    aten.var.correction: _var_correction,
    aten.var_mean.correction: _var_mean_correction,
}


# F.grid_sample: torch's own decomposition (its taps as index loads, every mode and padding); its gradient in training
# comes from routing F.grid_sample to the same function above autograd (joint/sampling.py)
OURS[aten.grid_sampler_2d.default] = torch._decomp.decomposition_table[aten.grid_sampler_2d.default]
# F.max_pool3d (MViT's pooled attention, video models): export/maxpool3d.py (torch 2.11 has no decomposition of it)
OURS[aten.max_pool3d_with_indices.default] = max_pool3d_with_indices

OURS.update(UPSAMPLE)  # export/upsample.py: nearest by an integer factor as views, the other modes torch's


def decomposition_table() -> dict:
    """The table handed to ExportedProgram.run_decompositions."""
    table = torch.export.default_decompositions()
    for op in KEEP_WHOLE:
        if op in table:
            del table[op]
    for op, fn in OURS.items():
        table[op] = fn
    return table
