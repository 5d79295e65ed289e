"""Probe: T5 (t5-small, bf16) training's attention calls on CUDA: each call's operand layouts, then the step.

    python3 scripts/t5_attn_probe.py [--no-cudnn]
"""
from __future__ import annotations

import sys

import torch

import aotfuse
import aotfuse.runtime.attention as att
from aotfuse.testing.zoo import t5_realistic

if "--no-cudnn" in sys.argv:
    torch.backends.cuda.enable_cudnn_sdp(False)
def _d(t):
    return None if t is None else (tuple(t.shape), t.stride(), t.storage_offset(), str(t.dtype), t.data_ptr() % 16)


class _Aten:
    """torch.ops.aten with its cuDNN attention calls printed (operand shapes, strides, offsets, 16-byte phase)."""

    def __getattr__(self, name):
        return getattr(torch.ops.aten, name)

    def _scaled_dot_product_cudnn_attention(self, q, k, v, bias, *a, **kw):
        print("cudnn q", _d(q), "k", _d(k), "v", _d(v), "bias", _d(bias), a[2] if len(a) > 2 else "", flush=True)
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, *a, **kw)


att.aten = _Aten()
ex = t5_realistic(train=True)
res = aotfuse.build(ex.model, ex.args, example_kwargs=ex.kwargs, train=True, targets=("sm_90",))
mod = aotfuse.load(res.data, device="cuda").as_module()
inputs = [t.cuda() if isinstance(t, torch.Tensor) else t for t in ex.args]
kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in ex.kwargs.items()}
out = mod(*inputs, **kw)
loss = out if isinstance(out, torch.Tensor) else out[0]
loss.backward()
torch.cuda.synchronize()
print("step ok", float(loss))
