"""Fused attention for training: two custom ops, `aotfuse::attention` and `aotfuse::attention_backward`.

Training keeps attention whole (instead of its math form, which materializes and saves the
B x H x T x T probabilities): the joint trace (joint/decomp_train.py `sdpa_fused_mode`) calls
`aotfuse::attention`, whose autograd formula (registered here) puts `aotfuse::attention_backward`
in the backward. The partition saves q, k, v, out and the fp32 logsumexp `lse` [B, H, T].

    attention(query [B,H,T,E], key [B,Hk,S,E], value [B,Hk,S,E], attn_mask [.., T, S] | None,
              is_causal, scale, enable_gqa) -> (out [B,H,T,E], lse float32 [B,H,T])
    attention_backward(grad_out, query, key, value, attn_mask, out, lse, is_causal, scale, enable_gqa)
              -> (grad_query, grad_key, grad_value)

Both are externs (runtime/externs.py); the implementation picks a kernel per device at call time,
so one archive runs on either:
- CPU: `_scaled_dot_product_flash_attention_for_cpu` (+ `_backward`): any float dtype, a mask
  (boolean masks become additive -inf/0 biases), lse [B,H,T].
- CUDA: `_scaled_dot_product_flash_attention` (+ `_backward`) for fp16/bf16 without a mask and a
  head dim of at most 256 (a multiple of 8); else `_scaled_dot_product_efficient_attention`
  (+ `_backward`), which takes fp32 and the mask as attn_bias. Its logsumexp is padded along T to a
  multiple of 32: the op returns the [B,H,T] slice (the contract's shape) and the backward re-pads it
  (the padded rows are never read for the T real queries). Dropout is not supported (the caller
  refuses dropout_p > 0), so the kernels' Philox state is a placeholder.
- GQA (Hk < H, H % Hk == 0, enable_gqa): k and v are repeated to H heads for the kernel
  (head h reads kv head h // (H / Hk), as sdpa does), and dk, dv are summed over each group.

The meta kernels (shapes only) are plain Python here: the runtime's load-time validation
(validate_extern.py) and the joint trace's fake tensors both use them, and neither imports
torch._dynamo. This module imports only torch; the runtime imports it (the allow-list needs the ops).
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

_LIB = torch.library.Library("aotfuse", "DEF")  # noqa: TOR901 (kept alive for the process)
_LIB.define("attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, bool is_causal, float scale, "
            "bool enable_gqa) -> (Tensor out, Tensor lse)")
_LIB.define("attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor? attn_mask, "
            "Tensor out, Tensor lse, bool is_causal, float scale, bool enable_gqa) "
            "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)")

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


def _attention_meta(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    _check(query, key, value, attn_mask, enable_gqa)
    b, h, t, _ = query.shape
    return (_bthd(query.shape, query.dtype, query.device),
            torch.empty((b, h, t), dtype=torch.float32, device=query.device))


def _attention_backward_meta(grad_out, query, key, value, attn_mask, out, lse, is_causal, scale, enable_gqa):
    _check(query, key, value, attn_mask, enable_gqa)
    return tuple(_bthd(x.shape, x.dtype, x.device) for x in (query, key, value))


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


def _use_flash(q, mask) -> bool:
    e = q.shape[-1]
    return q.dtype in _FLASH_DTYPES and mask is None and e <= 256 and e % 8 == 0


def _expand_bias(bias, q, k):
    # the efficient kernel wants a 4-d bias broadcastable to [B, H, T, S] (expanded views are fine)
    # and its strides multiples of 8 elements: pad the key dim to a multiple of 8 and slice (as sdpa does)
    b, h, t, _ = q.shape
    s = k.shape[2]
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    if s % 8:
        bias = torch.nn.functional.pad(bias.expand(*bias.shape[:-1], s), (0, 8 - s % 8))[..., :s]
    return bias.expand(b, h, t, s)


def _attention(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    rep = query.shape[1] // key.shape[1]
    k, v = _widen(key, rep), _widen(value, rep)
    bias = _bias(attn_mask, query.dtype)
    if query.device.type == "cuda":
        if _use_flash(query, bias):
            r = aten._scaled_dot_product_flash_attention(query, k, v, 0.0, is_causal, False, scale=scale)
            return _as_bthd(r[0]), r[1]
        if bias is not None:
            bias = _expand_bias(bias, query, k)
        out, lse = aten._scaled_dot_product_efficient_attention(query, k, v, bias, True, 0.0, is_causal,
                                                                scale=scale)[:2]
        return _as_bthd(out), lse[:, :, :query.shape[2]].contiguous()
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, k, v, 0.0, is_causal, attn_mask=bias,
                                                                scale=scale)
    # the CPU kernel's lse is laid out [B, T, H], and float64 for float64 inputs: the contract's is float32
    return _as_bthd(out), lse.to(torch.float32).contiguous()


def _attention_backward(grad_out, query, key, value, attn_mask, out, lse, is_causal, scale, enable_gqa):
    rep = query.shape[1] // key.shape[1]
    k, v = _widen(key, rep), _widen(value, rep)
    bias = _bias(attn_mask, query.dtype)
    grad_out = grad_out.to(query.dtype)
    if query.device.type == "cuda":
        dev = query.device
        if _use_flash(query, bias):
            t, s = query.shape[2], k.shape[2]
            # no dropout: the Philox state is never read (placeholders of the forward's shapes)
            seed = torch.zeros(2, dtype=torch.uint64, device=dev)
            offset = torch.zeros((), dtype=torch.uint64, device=dev)
            # cum_seq_q/k: undefined tensors (None) for dense batches, as the forward returns them
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                grad_out, query, k, v, out, lse, None, None, t, s, 0.0, is_causal, seed, offset, scale=scale)
        else:
            if bias is not None:
                bias = _expand_bias(bias, query, k)
            t = query.shape[2]
            pad = -(-t // 32) * 32
            if pad != t:
                lse = torch.nn.functional.pad(lse, (0, pad - t))
            seed = torch.zeros((), dtype=torch.int64, device=dev)
            offset = torch.zeros((), dtype=torch.int64, device=dev)
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                grad_out, query, k, v, bias, out, lse.contiguous(), seed, offset, 0.0, [True, True, True, False],
                is_causal, scale=scale)
    else:
        if query.dtype == torch.float64:
            lse = lse.to(torch.float64)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale)
    return _as_bthd(dq), _as_bthd(_narrow(dk, rep)), _as_bthd(_narrow(dv, rep))


# Registered per backend (not CompositeExplicitAutograd, which fake tensors would trace through, giving
# the aten kernels' layouts instead of the contract's): fake tensors use the Meta kernels below.
for _key in ("CPU", "CUDA"):
    _LIB.impl("attention", _attention, _key)
    _LIB.impl("attention_backward", _attention_backward, _key)
_LIB.impl("attention", _attention_meta, "Meta")
_LIB.impl("attention_backward", _attention_backward_meta, "Meta")

attention = torch.ops.aotfuse.attention.default
attention_backward = torch.ops.aotfuse.attention_backward.default


# ---------------------------------------------------------------- autograd (for the joint trace)

def _setup_context(ctx, inputs, output):
    q, k, v, mask, is_causal, scale, gqa = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, out, lse)
    ctx.args = (is_causal, scale, gqa)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, mask, out, lse = ctx.saved_tensors
    is_causal, scale, gqa = ctx.args
    dq, dk, dv = attention_backward(grad_out, q, k, v, mask, out, lse, is_causal, scale, gqa)
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd("aotfuse::attention", _backward, setup_context=_setup_context)
