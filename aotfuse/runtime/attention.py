"""Fused attention for training: two custom ops, `aotfuse::attention` and `aotfuse::attention_backward`.

Training keeps attention whole (instead of its math form, which materializes and saves the
B x H x T x T probabilities): the joint trace (joint/decomp_train.py `sdpa_fused_mode`) calls
`aotfuse::attention`, whose autograd formula (registered here) puts `aotfuse::attention_backward`
in the backward. The partition saves q, k, v, out and the fp32 logsumexp `lse` [B, H, T].

    attention(query [B,H,T,E], key [B,Hk,S,E], value [B,Hk,S,E], attn_mask [.., T, S] | None,
              is_causal, scale, enable_gqa[, window]) -> (out [B,H,T,E], lse float32 [B,H,T])
    attention_backward(grad_out, query, key, value, attn_mask, out, lse, is_causal, scale, enable_gqa[, window])
              -> (grad_query, grad_key, grad_value)
    attention_backward_bias(<the same>) -> (grad_query, grad_key, grad_value, grad_mask)
              (a float mask that requires grad: a learned bias; the mask's gradient summed to its shape)

Both are externs (runtime/externs.py); the implementation picks a kernel per device at call time,
so one archive runs on either:
- CPU: `_scaled_dot_product_flash_attention_for_cpu` (+ `_backward`): any float dtype, a mask
  (boolean masks become additive -inf/0 biases), lse [B,H,T].
- CUDA, first choice: cuDNN attention, `_scaled_dot_product_cudnn_attention` (+ `_backward`), where torch
  itself prefers it (sm_90 / sm_100 families, cuDNN newer than 9.15.0; refused under
  `torch.backends.cuda.enable_cudnn_sdp(False)` and under strict deterministic algorithms) for fp16/bf16,
  a head dim of at most 128 (a multiple of 8), B and H up to 65535 and a key length above 1. It takes GQA
  as it is (k and v not repeated; dk, dv come back with Hk heads) and a mask as an additive bias [B, 1|H, T, S]
  (boolean masks as -inf/0; the key dim padded to a multiple of 8, as for the efficient kernel). It writes
  out in the query's memory order and dq, dk, dv in q's, k's and v's (`empty_like`): for the [B, T, H, E]
  storage programs pass (views of the packed qkv projection) that is the contract's layout, with no copy;
  a query stored [B, H, T, E] costs one copy of out and of dq (`_as_bthd`). Its logsumexp is
  [B, H, T, 1] fp32, contiguous: the op returns it as [B, H, T] (a view) and the backward passes it back as
  [B, H, T, 1]; it is the same logsumexp as flash's (natural log, scaled scores), so the contract holds.
  A fully masked row gives a zero output and finite gradients (as sdpa's math form). Anchor GPT step on an
  H100 (scripts/attention_ab.py): attention 302 -> 187 us forward, 797 -> 606 us backward per step.
- CUDA, else: `_scaled_dot_product_flash_attention` (+ `_backward`) for fp16/bf16 without a mask, a head dim
  of at most 256 (a multiple of 8), and T == S when causal (flash aligns the causal mask to the bottom right,
  sdpa to the top left); else `_scaled_dot_product_efficient_attention` (+ `_backward`), which takes fp32 and
  the mask as attn_bias. Its logsumexp is padded along T to a multiple of 32: the op returns the [B,H,T]
  slice (the contract's shape) and the backward re-pads it (the padded rows are never read for the T real
  queries). Dropout is not supported (the caller refuses dropout_p > 0), so the kernels' Philox state is a
  placeholder.
- A sliding window (`window` W > 0, set by export/masks.py for a constant causal mask that keeps keys
  i - W < j <= i; causal, T == S): on CUDA, fp16/bf16 with a head dim of at most 256, flash's local attention
  (`_flash_attention_forward` / `_backward` with window_size_left W - 1), which visits only the blocks inside
  the window and takes GQA as it is (`window_refusal` says when not). Anywhere else the window is rebuilt as a
  boolean mask and the call runs as a masked one. Gemma-3-1B's five sliding layers (T 2048, W 512, head dim
  256) had run on the efficient kernel with a dense mask: 3.8 ms per backward on an H200.
- The CUDA choice is made once per (query shape, key shape, dtype, device, masked, causal, window) and cached: one
  dict lookup per call (about 0.2 us more host time than the old inline check, measured on the H100 host).
  The forward and its backward look up the same key, so they run on one kernel. `chosen_kernels()` says what
  each shape ran on; `forget_choices()` drops the cache (to read torch's switches again).
- GQA (Hk < H, H % Hk == 0, enable_gqa) on flash, efficient and the CPU: k and v are repeated to H heads
  for the kernel (head h reads kv head h // (H / Hk), as sdpa does), and dk, dv are summed over each group.

The meta kernels (shapes only) are plain Python here: the runtime's load-time validation
(validate_extern.py) and the joint trace's fake tensors both use them, and neither imports
torch._dynamo. This module imports only torch; the runtime imports it (the allow-list needs the ops).
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

_LIB = torch.library.Library("aotfuse", "DEF")  # noqa: TOR901 (kept alive for the process)
_LIB.define("attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, bool is_causal, float scale, "
            "bool enable_gqa, int window=0) -> (Tensor out, Tensor lse)")
_LIB.define("attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor? attn_mask, "
            "Tensor out, Tensor lse, bool is_causal, float scale, bool enable_gqa, int window=0) "
            "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)")

_LIB.define("attention_backward_bias(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor attn_mask, "
            "Tensor out, Tensor lse, bool is_causal, float scale, bool enable_gqa) "
            "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_mask)")

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------- shapes (meta)

def shapes(q_shape, k_shape, v_shape, mask_shape, enable_gqa: bool) -> str | None:
    """Why these shapes are not an attention the ops take, or None when they are."""
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        return "query, key and value must be 4-d [B, H, T, E]"
    (b, h, t, e), (bk, hk, s, ek), (bv, hv, sv, ev) = q_shape, k_shape, v_shape
    if b != bk or b != bv or (hk, s) != (hv, sv) or e != ek or ev != e:
        return f"query {list(q_shape)}, key {list(k_shape)}, value {list(v_shape)} do not match"
    if h != hk and not (enable_gqa and hk and h % hk == 0):
        return f"query has {h} heads, key and value {hk}" + ("" if enable_gqa else " (enable_gqa is off)")
    if mask_shape is not None and (len(mask_shape) > 4 or any(
            x not in (1, y) for x, y in zip(reversed(mask_shape), reversed((b, h, t, s))))):
        return f"mask {list(mask_shape)} does not broadcast to {[b, h, t, s]}"
    return None


def _check(q, k, v, mask, enable_gqa):
    why = shapes(tuple(q.shape), tuple(k.shape), tuple(v.shape), None if mask is None else tuple(mask.shape),
                 enable_gqa)
    if why:
        raise RuntimeError(f"aotfuse::attention: {why}")


def _bthd(shape, dtype, device):
    """An empty [B, H, T, E] tensor laid out [B, T, H, E] (what the flash kernels write)."""
    b, h, t, e = shape
    return torch.empty((b, t, h, e), dtype=dtype, device=device).transpose(1, 2)


def _attention_meta(query, key, value, attn_mask, is_causal, scale, enable_gqa, window=0):
    _check(query, key, value, attn_mask, enable_gqa)
    b, h, t, _ = query.shape
    return (_bthd(query.shape, query.dtype, query.device),
            torch.empty((b, h, t), dtype=torch.float32, device=query.device))


def _attention_backward_meta(grad_out, query, key, value, attn_mask, out, lse, is_causal, scale, enable_gqa, window=0):
    _check(query, key, value, attn_mask, enable_gqa)
    return tuple(_bthd(x.shape, x.dtype, x.device) for x in (query, key, value))


def _attention_backward_bias_meta(grad_out, query, key, value, attn_mask, out, lse, is_causal, scale, enable_gqa):
    _check(query, key, value, attn_mask, enable_gqa)
    grads = tuple(_bthd(x.shape, x.dtype, x.device) for x in (query, key, value))
    return (*grads, torch.empty(attn_mask.shape, dtype=attn_mask.dtype, device=attn_mask.device))


# ---------------------------------------------------------------- kernels

def _as_bthd(t):
    """t laid out [B, T, H, E] as the meta kernels say (a no-op for the CUDA kernels' results)."""
    want = _bthd(t.shape, t.dtype, "meta").stride()
    return t if t.stride() == want else _bthd(t.shape, t.dtype, t.device).copy_(t)


def _widen(t, rep: int):
    """[B, Hk, S, E] -> [B, Hk*rep, S, E], head h reading kv head h // rep."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _narrow(g, rep: int):
    """The gradient of _widen: sum over each group of rep heads."""
    if rep == 1:
        return g
    b, h, s, e = g.shape
    return g.reshape(b, h // rep, rep, s, e).sum(2)


def _bias(mask, dtype):
    """A boolean mask (True: attend) as an additive bias; a float mask as it is (in the query's dtype)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


# ---------------------------------------------------------------- the CUDA kernel of a call

CUDNN, FLASH, EFFICIENT, FLASH_WINDOW = "cudnn", "flash", "efficient", "flash_window"
_CUDNN_MIN_VERSION = 91500  # torch prefers cuDNN attention above 9.15.0 (the fix for T % 128 != 0)
_CUDNN_MAX_HEAD_DIM = 128  # forward and backward on every cuDNN 9 (256 needs a newer frontend)
_CUDNN_MAX_BH = 65535

# (query shape, key shape, dtype, device index, masked, causal, window) -> kernel: one dict lookup per call, the checks
# once per key (forward and backward look up the same key). torch's switches (enable_cudnn_sdp, deterministic
# algorithms) are read when a key is first seen; forget_choices() makes the next call read them again.
_CHOICES: dict = {}
_DEVICES: dict = {}  # device index -> why cuDNN attention does not apply on it, or None
_REFUSED_WINDOWS: set = set()  # windowed-call keys flash's local kernel does not take (_local_window)


def chosen_kernels() -> dict:
    """The kernel each CUDA attention shape seen in this process runs on (a copy, for logs and tests):
    {(query shape, key shape, dtype, device index, masked, causal, window): "cudnn" | "flash" | "efficient" |
    "flash_window"}."""
    return dict(_CHOICES)


def forget_choices() -> None:
    """Drop the cached choices (after torch.backends.cuda.enable_cudnn_sdp, say). A captured CUDA graph keeps
    the kernels it captured."""
    _CHOICES.clear()
    _DEVICES.clear()
    _REFUSED_WINDOWS.clear()


def _cudnn_device(index) -> str | None:
    """Why this CUDA device cannot take cuDNN attention (None when it can): torch's own preference."""
    if index not in _DEVICES:
        why = None
        version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        major, minor = torch.cuda.get_device_capability(index)
        if version is None:
            why = "no cuDNN"
        elif version <= _CUDNN_MIN_VERSION:
            why = f"cuDNN {version} (attention wants > {_CUDNN_MIN_VERSION})"
        elif major not in (9, 10):
            why = f"sm_{major}{minor} (cuDNN attention: sm_90 and sm_100 families)"
        _DEVICES[index] = why
    return _DEVICES[index]


def cudnn_refusal(q_shape, k_shape, dtype, device_index=None) -> str | None:
    """Why cuDNN attention does not take these shapes (None when it does); device_index=None: shapes only."""
    b, h, _, e = q_shape
    s = k_shape[2]
    if dtype not in _FLASH_DTYPES:
        return f"dtype {dtype}"
    if e % 8 or e > _CUDNN_MAX_HEAD_DIM:
        return f"head dim {e} (cuDNN: a multiple of 8, at most {_CUDNN_MAX_HEAD_DIM})"
    if b > _CUDNN_MAX_BH or h > _CUDNN_MAX_BH:
        return f"batch {b} or heads {h} above {_CUDNN_MAX_BH}"
    if s == 1:
        return "key length 1"
    return None if device_index is None else _cudnn_device(device_index)


def _choose(q, k, masked: bool, is_causal: bool) -> str:
    if masked and k.shape[2] % 8 and torch.backends.cuda.mem_efficient_sdp_enabled():
        # a bias over a key length off a multiple of 8 (Swin's 49-token windows): the efficient kernel, as torch's
        # sdpa picks; cuDNN took 1543 us for Swin-T's 12 forwards against the efficient kernel's 919 (H100, bf16)
        return EFFICIENT
    det = torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    if torch.backends.cuda.cudnn_sdp_enabled() and not det and \
            cudnn_refusal(q.shape, k.shape, q.dtype, q.get_device()) is None:
        return CUDNN
    e = q.shape[-1]
    # flash aligns a causal mask to the bottom right: sdpa's (top left) only when T == S
    if q.dtype in _FLASH_DTYPES and not masked and e <= 256 and e % 8 == 0 and \
            not (is_causal and q.shape[2] != k.shape[2]):
        return FLASH
    return EFFICIENT


def window_refusal(q_shape, k_shape, dtype, device_index=None) -> str | None:
    """Why flash's local attention does not take a sliding-window call of these shapes (None when it does):
    fp16/bf16, a head dim of at most 256 (a multiple of 8), T == S, an sm_80 or newer card, flash enabled."""
    if dtype not in _FLASH_DTYPES:
        return f"dtype {dtype}"
    e = q_shape[-1]
    if e % 8 or e > 256:
        return f"head dim {e} (flash: a multiple of 8, at most 256)"
    if q_shape[2] != k_shape[2]:
        return f"query length {q_shape[2]} != key length {k_shape[2]}"
    if device_index is None:
        return None
    if torch.cuda.get_device_capability(device_index)[0] < 8:
        return "a card older than sm_80"
    if not torch.backends.cuda.flash_sdp_enabled():
        return "flash attention disabled (torch.backends.cuda.enable_flash_sdp(False))"
    return None


def _cuda_kernel(q, k, masked: bool, is_causal: bool) -> str:
    key = (q.shape, k.shape, q.dtype, q.get_device(), masked, is_causal, 0)
    kind = _CHOICES.get(key)
    if kind is None:
        kind = _CHOICES[key] = _choose(q, k, masked, is_causal)
    return kind


def _local_window(q, k, window: int) -> bool:
    """Whether flash's local kernel runs this windowed call, decided once per key. A window it refuses runs on its
    mask (_windowed): the kernel that runs is recorded under the masked call's key, so chosen_kernels() lists only
    kernels that run; the refusal itself is remembered in _REFUSED_WINDOWS."""
    key = (q.shape, k.shape, q.dtype, q.get_device(), False, True, window)
    if key in _CHOICES:
        return True
    if key in _REFUSED_WINDOWS:
        return False
    if window_refusal(q.shape, k.shape, q.dtype, q.get_device()) is None:
        _CHOICES[key] = FLASH_WINDOW
        return True
    _REFUSED_WINDOWS.add(key)
    return False


def _window_mask(t: int, s: int, window: int, device):
    """The keep mask of a sliding-window causal attention (top-left aligned, T == S): key j for query i where
    0 <= i - j < window."""
    i = torch.arange(t, device=device).unsqueeze(1)
    j = torch.arange(s, device=device).unsqueeze(0)
    d = i - j
    return (d >= 0) & (d < window)


def _windowed(attn_mask, query, key, is_causal: bool, window: int):
    """A window a kernel takes only as a mask: (the mask with the window folded in, is_causal False). The window
    implies causality (export/masks.py makes a window only for a causal call)."""
    keep = _window_mask(query.shape[2], key.shape[2], window, query.device)
    if attn_mask is None:
        return keep, False
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep, False
    return attn_mask.masked_fill(~keep, float("-inf")), False


def _flash_window_forward(query, key, value, scale, window: int):
    """flash's local attention ([B, T, H, E] views; GQA as it is): keys i - window < j <= i."""
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    t, s = q.shape[1], k.shape[1]
    r = aten._flash_attention_forward(q, k, v, None, None, t, s, 0.0, True, False, scale=scale,
                                      window_size_left=window - 1, window_size_right=0)
    return r[0].transpose(1, 2), r[1]


def _flash_window_backward(grad_out, query, key, value, out, lse, scale, window: int):
    dev = query.device
    g, q, k, v, o = (x.transpose(1, 2) for x in (grad_out, query, key, value, out))
    g, q, k, v, o = (x if x.stride(-1) == 1 else x.contiguous() for x in (g, q, k, v, o))
    t, s = q.shape[1], k.shape[1]
    seed = torch.zeros(2, dtype=torch.uint64, device=dev)
    offset = torch.zeros((), dtype=torch.uint64, device=dev)
    dq, dk, dv = aten._flash_attention_backward(g, q, k, v, o, lse.contiguous(), None, None, t, s, 0.0, True, seed,
                                                offset, scale=scale, window_size_left=window - 1,
                                                window_size_right=0)
    return tuple(_as_bthd(x.transpose(1, 2)) for x in (dq, dk, dv))


def _placeholder(dev):
    # Philox seed / offset of a kernel run without dropout: never read, so not even initialized
    return torch.empty((), dtype=torch.int64, device=dev)


def _dense_bias(bias, s: int):
    """A 4-d bias as the efficient and cuDNN kernels read it: its key dim contiguous, its other strides and its
    offset multiples of 8 elements (dims of size 1 may broadcast). A bias that is not is copied: over a key length
    off a multiple of 8 into rows padded to one and sliced back (as sdpa does), else densely. Copied before any
    expansion, so broadcast dims stay broadcast. T5's position bias arrives heads-last ([B, H, T, S] with strides
    (T S H, 1, S H, H)): handed on as it was, cuDNN failed to execute and the efficient kernel refused it."""
    if bias.shape[-1] != s:
        bias = bias.expand(*bias.shape[:-1], s)
    if bias.stride(-1) == 1 and all(st % 8 == 0 or n == 1 for st, n in zip(bias.stride()[:-1], bias.shape[:-1])) \
            and bias.storage_offset() % 8 == 0:
        return bias
    # a fresh row-major buffer (F.pad would keep a heads-last input's memory format, its key dim still strided)
    out = bias.new_zeros((*bias.shape[:-1], s + (-s) % 8))[..., :s]
    return out.copy_(bias)


def _expand_bias(bias, q, k):
    # the efficient kernel wants a 4-d bias broadcastable to [B, H, T, S] (expanded views are fine), laid out as
    # _dense_bias says
    b, h, t, _ = q.shape
    s = k.shape[2]
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return _dense_bias(bias, s).expand(b, h, t, s)


def _cudnn_bias(bias, q, k):
    # cuDNN takes a 4-d [B, 1 | H, T, S] bias (torch expands B and keeps its head dim), laid out as _dense_bias says
    b, _, t, _ = q.shape
    s = k.shape[2]
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return _dense_bias(bias, s).expand(b, bias.shape[1], t, s)


def _attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, window=0):
    if window:
        if query.device.type == "cuda" and attn_mask is None and is_causal and _local_window(query, key, window):
            out, lse = _flash_window_forward(query, key, value, scale, window)
            return _as_bthd(out), lse
        attn_mask, is_causal = _windowed(attn_mask, query, key, is_causal, window)
    bias = _bias(attn_mask, query.dtype)
    rep = query.shape[1] // key.shape[1]
    if query.device.type == "cuda":
        kind = _cuda_kernel(query, key, bias is not None, is_causal)
        if kind == CUDNN:  # GQA as it is (no repeated k, v); out laid out as the query is; lse [B, H, T, 1]
            if bias is not None:
                bias = _cudnn_bias(bias, query, key)
            r = aten._scaled_dot_product_cudnn_attention(query, key, value, bias, True, 0.0, is_causal, False,
                                                         scale=scale)
            return _as_bthd(r[0]), r[1].reshape(query.shape[:3]).contiguous()
        k, v = _widen(key, rep), _widen(value, rep)
        if kind == FLASH:
            r = aten._scaled_dot_product_flash_attention(query, k, v, 0.0, is_causal, False, scale=scale)
            return _as_bthd(r[0]), r[1]
        if bias is not None:
            bias = _expand_bias(bias, query, k)
        out, lse = aten._scaled_dot_product_efficient_attention(query, k, v, bias, True, 0.0, is_causal,
                                                                scale=scale)[:2]
        return _as_bthd(out), lse[:, :, :query.shape[2]].contiguous()
    k, v = _widen(key, rep), _widen(value, rep)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, k, v, 0.0, is_causal, attn_mask=bias,
                                                                scale=scale)
    # the CPU kernel's lse is laid out [B, T, H], and float64 for float64 inputs: the contract's is float32
    return _as_bthd(out), lse.to(torch.float32).contiguous()


def _attention_backward(grad_out, query, key, value, attn_mask, out, lse, is_causal, scale, enable_gqa, window=0):
    if window:
        if query.device.type == "cuda" and attn_mask is None and is_causal and _local_window(query, key, window):
            return _flash_window_backward(grad_out.to(query.dtype), query, key, value, out, lse, scale, window)
        attn_mask, is_causal = _windowed(attn_mask, query, key, is_causal, window)
    rep = query.shape[1] // key.shape[1]
    bias = _bias(attn_mask, query.dtype)
    grad_out = grad_out.to(query.dtype)
    if query.device.type == "cuda":
        dev = query.device
        kind = _cuda_kernel(query, key, bias is not None, is_causal)
        t, s = query.shape[2], key.shape[2]
        if kind == CUDNN:
            if bias is not None:
                bias = _cudnn_bias(bias, query, key)
            # dq, dk, dv: laid out as q, k, v are (empty_like); lse back as [B, H, T, 1] (a view), as the forward
            # returned it; cum_seq_q/k undefined: a dense batch
            dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
                grad_out, query, key, value, out, lse.unsqueeze(-1), _placeholder(dev), _placeholder(dev), bias,
                None, None, t, s, 0.0, is_causal, scale=scale)
            return _as_bthd(dq), _as_bthd(dk), _as_bthd(dv)
        k, v = _widen(key, rep), _widen(value, rep)
        if kind == FLASH:
            # no dropout: the Philox state is never read (placeholders of the forward's shapes)
            seed = torch.zeros(2, dtype=torch.uint64, device=dev)
            offset = torch.zeros((), dtype=torch.uint64, device=dev)
            # cum_seq_q/k: undefined tensors (None) for dense batches, as the forward returns them
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                grad_out, query, k, v, out, lse, None, None, t, s, 0.0, is_causal, seed, offset, scale=scale)
        else:
            dq, dk, dv, _ = _efficient_backward(grad_out, query, k, v, bias, out, lse, is_causal, scale, False)
    else:
        k, v = _widen(key, rep), _widen(value, rep)
        if query.dtype == torch.float64:
            lse = lse.to(torch.float64)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale)
    return _as_bthd(dq), _as_bthd(_narrow(dk, rep)), _as_bthd(_narrow(dv, rep))


def _efficient_backward(grad_out, query, k, v, bias, out, lse, is_causal, scale, bias_grad: bool):
    """The efficient kernel's backward: (dq, dk, dv, d bias or None). Its logsumexp is padded along T to a multiple
    of 32 (as its forward returns it; the padded rows are never read); no dropout, so the Philox state is a
    placeholder."""
    dev, t = query.device, query.shape[2]
    if bias is not None:
        bias = _expand_bias(bias, query, k)
    pad = -(-t // 32) * 32
    if pad != t:
        lse = torch.nn.functional.pad(lse, (0, pad - t))
    seed = torch.zeros((), dtype=torch.int64, device=dev)
    offset = torch.zeros((), dtype=torch.int64, device=dev)
    return aten._scaled_dot_product_efficient_attention_backward(
        grad_out, query, k, v, bias, out, lse.contiguous(), seed, offset, 0.0, [True, True, True, bias_grad],
        is_causal, scale=scale)


def _sum_to(g, shape, dtype):
    """A [B, H, T, S] gradient summed (in fp32) over the dims a mask of `shape` broadcasts along."""
    g = g.float()
    lead = g.dim() - len(shape)
    dims = list(range(lead)) + [lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1]
    if dims:
        g = g.sum(dims, keepdim=True)
    return g.reshape(shape).to(dtype)


def _attention_backward_bias(grad_out, query, key, value, attn_mask, out, lse, is_causal, scale, enable_gqa):
    """The backward of an attention whose float mask requires grad (Swin's relative position bias, T5's and
    DeBERTa-style learned biases): (dq, dk, dv, d mask), the mask's gradient summed to its own shape.
    CUDA: the efficient kernel, the only one of torch's that computes the bias gradient (dS, [B, H, T, S]).
    CPU: dq, dk, dv from the CPU kernel; dS = P * (dP - rowsum(dO * O)) in fp32 from recomputed probabilities."""
    rep = query.shape[1] // key.shape[1]
    bias = _bias(attn_mask, query.dtype)
    grad_out = grad_out.to(query.dtype)
    t, s = query.shape[2], key.shape[2]
    k, v = _widen(key, rep), _widen(value, rep)
    if query.device.type == "cuda":
        dq, dk, dv, db = _efficient_backward(grad_out, query, k, v, bias, out, lse, is_causal, scale, True)
        dmask = _sum_to(db[..., :s], tuple(attn_mask.shape), attn_mask.dtype)
        return _as_bthd(dq), _as_bthd(_narrow(dk, rep)), _as_bthd(_narrow(dv, rep)), dmask
    dq, dk, dv = _attention_backward(grad_out, query, key, value, attn_mask, out, lse, is_causal, scale, enable_gqa)
    scores = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scale + bias.float()
    if is_causal:
        scores = scores.masked_fill(torch.ones(t, s, dtype=torch.bool, device=query.device).tril().logical_not(),
                                    float("-inf"))
    p = torch.softmax(scores, -1)
    go = grad_out.float()
    dp = torch.matmul(go, v.float().transpose(-1, -2))
    ds = p * (dp - (go * out.float()).sum(-1, keepdim=True))
    return dq, dk, dv, _sum_to(ds, tuple(attn_mask.shape), attn_mask.dtype)


# Registered per backend (not CompositeExplicitAutograd, which fake tensors would trace through, giving
# the aten kernels' layouts instead of the contract's): fake tensors use the Meta kernels below.
for _key in ("CPU", "CUDA"):
    _LIB.impl("attention", _attention, _key)
    _LIB.impl("attention_backward", _attention_backward, _key)
    _LIB.impl("attention_backward_bias", _attention_backward_bias, _key)
_LIB.impl("attention", _attention_meta, "Meta")
_LIB.impl("attention_backward", _attention_backward_meta, "Meta")
_LIB.impl("attention_backward_bias", _attention_backward_bias_meta, "Meta")

attention = torch.ops.aotfuse.attention.default
attention_backward = torch.ops.aotfuse.attention_backward.default
attention_backward_bias = torch.ops.aotfuse.attention_backward_bias.default


# ---------------------------------------------------------------- autograd (for the joint trace)

def _setup_context(ctx, inputs, output):
    q, k, v, mask, is_causal, scale, gqa, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, out, lse)
    ctx.args = (is_causal, scale, gqa, rest[0] if rest else 0)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, mask, out, lse = ctx.saved_tensors
    is_causal, scale, gqa, window = ctx.args
    if mask is not None and ctx.needs_input_grad[3]:  # a learned bias: its gradient too (the efficient kernel)
        if window:
            from ..errors import AotfuseError

            raise AotfuseError("aotfuse::attention: a sliding window with a mask that requires grad",
                               remedy="fold the window into the mask (export/masks.py sets a window only where it "
                                      "drops the mask)")
        dq, dk, dv, dmask = attention_backward_bias(grad_out, q, k, v, mask, out, lse, is_causal, scale, gqa)
        return dq, dk, dv, dmask, None, None, None, None
    # the window only when set: a traced call without one keeps its ten arguments (archives unchanged)
    dq, dk, dv = attention_backward(grad_out, q, k, v, mask, out, lse, is_causal, scale, gqa,
                                    *((window,) if window else ()))
    return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd("aotfuse::attention", _backward, setup_context=_setup_context)
