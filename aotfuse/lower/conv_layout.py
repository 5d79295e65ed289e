"""Channels-last chosen for a half-precision CNN served in NCHW (inference; knob AOTFUSE_CONV_LAYOUT).

cuDNN runs fp16/bf16 convolutions on NHWC tensors: given NCHW operands it converts each one
(nchwToNhwcKernel / nhwcToNchwKernel) around every call. A diffusion UNet in bf16 spent 376 us of 1617
per inference call in those conversions on an H100 (35 + 18 of them), where torch.compile, which lays
convolutions out channels-last itself, spent none. When a model has 2-d (or 3-d) half-precision
convolutions and none of its values is channels-last already (a model the user converted keeps its own
layout: aotfuse/layouts.py), this pass picks, before lowering, the values to store channels-last:
- every 4-d (5-d) floating-point value whose shape is that of a convolution's input or output: the
  activations between convolutions (norms, activations, residual adds, concatenations), which are
  pointwise or extern results; other 4-d values (an attention's [B, H, T, T] scores) keep row-major
  unless they happen to share such a shape, which costs speed, never correctness (a View maps any order);
- not the program's outputs (the caller gets eager's row-major layout) nor its inputs (read as given);
- every weight a convolution reads directly: stored permuted in the archive (as for a channels-last model).
The first convolution then reads the NCHW input with an NHWC filter (cuDNN converts the input once) and
writes NHWC; the rest run NHWC end to end. Values only: the program computes the same numbers in either order.

Default `auto`. A GroupNorm's row statistics ([N, groups, C / groups * HW]) then walk their rows in storage
order (schedule/reorder.py: contiguous channel chunks first), not elements C apart as they did at first (the
diffusion UNet was slower channels-last until then: 1.64 against 1.47 ms). H100, 2026-11-27, zoo sizes, bf16:
MobileNetV2 at 64 x 224^2 3.26 -> 1.60 ms (torch.compile reduce-overhead 2.05), the UNet 1.48 -> 1.11 ms (1.40),
ResNets, ConvNeXt and SegFormer unchanged. `keep` leaves eager's layout.
"""
from __future__ import annotations

import torch
import torch.fx

from ..fxgraph import value
from ..knobs import knobs
from ..layouts import CHANNELS_LAST, channels_last_perm

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)



def _static(v) -> bool:
    return isinstance(v, torch.Tensor) and all(type(d) is int for d in v.shape)


def choose(gm: torch.fx.GraphModule, weights: dict, placeholders) -> tuple[dict, set, dict | None]:
    """(node -> storage permutation, weight refs to store permuted, a decision record or None)."""
    if knobs.conv_layout != "auto":
        return {}, set(), None
    convs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.convolution.default]
    convs = [n for n in convs if _static(value(n)) and value(n).dim() in CHANNELS_LAST and value(n).dtype in _HALF]
    if not convs:
        return {}, set(), None
    ph_ref = {name: (kind, ref) for name, kind, ref in placeholders}
    for n in gm.graph.nodes:  # the user chose a layout: keep theirs
        v = value(n)
        if isinstance(v, torch.Tensor) and channels_last_perm(v) is not None:
            return {}, set(), None
    if any(channels_last_perm(w) is not None for w in weights.values() if isinstance(w, torch.Tensor)):
        return {}, set(), None
    shapes = set()
    for c in convs:
        for x in (c.args[0], c):
            v = value(x)
            if _static(v) and v.dim() in CHANNELS_LAST:
                shapes.add(tuple(v.shape))
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outputs: set = set()
    torch.fx.node.map_arg(out_node.args, outputs.add)
    chosen = {}
    for n in gm.graph.nodes:
        v = value(n)
        if n.op != "call_function" or n in outputs or not _static(v) or v.dim() not in CHANNELS_LAST:
            continue
        if not v.is_floating_point() or tuple(v.shape) not in shapes or not v.is_contiguous():
            continue
        chosen[n] = CHANNELS_LAST[v.dim()]
    wrefs = set()
    for c in convs:
        w = c.args[1]
        if isinstance(w, torch.fx.Node) and w.op == "placeholder":
            kind, ref = ph_ref.get(w.name, (None, None))
            if kind == "weight" and value(w) is not None and value(w).dim() in CHANNELS_LAST:
                wrefs.add(ref)
    rec = {"conv_layout": f"{len(convs)} half-precision convolutions",
           "why": f"{len(chosen)} values and {len(wrefs)} filters stored channels-last (cuDNN's NHWC: no layout "
                  f"conversion around each call; AOTFUSE_CONV_LAYOUT=auto)"}
    return chosen, wrefs, rec
