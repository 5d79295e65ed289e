"""The one op taxonomy: which class each aten op belongs to, for every stage that asks.

- the partition (partition/mincut.py) prices recomputation by class and never recomputes
  BANNED_CLASSES;
- the lowering registry (lower/registry.py) files each lowering under a class; `register`
  refuses a name outside CLASSES, and an "extern" entry must be on the runtime's extern table;
- the joint trace (joint/trace.py) follows INDEX_PRESERVING ops to find what an integer input indexes.

Classes are plain strings (they go into reports as they are). Membership uses the sets here first,
then torch's own tags (`pointwise`, `reduction`, `nondeterministic_seeded`), so an op torch tags is
classified without being listed. The registry may file an op under a coarser class than op_class
gives it (div is "pointwise" to lowering, "transcendental" to the partition's cost model; pooling
lowers as a windowed pointwise op but costs what a reduction does): tests/test_truth.py lists the
pairs allowed.
"""
from __future__ import annotations

import operator

import torch

from .runtime.externs import EXTERNS

aten = torch.ops.aten
prims = torch.ops.prims

VIEW, CONSTANT, POINTWISE, TRANSCENDENTAL, REDUCTION = "view", "constant", "pointwise", "transcendental", "reduction"
COPY, EXTERN, RANDOM, ITEM, UNKNOWN, STRUCTURAL = "copy", "extern", "random", "item", "unknown", "structural"
CLASSES = (VIEW, CONSTANT, POINTWISE, TRANSCENDENTAL, REDUCTION, COPY, EXTERN, RANDOM, ITEM, UNKNOWN, STRUCTURAL)

VIEW_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default, aten.transpose.int,
    aten.t.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.slice.Tensor, aten.select.int, aten.alias.default, aten.detach.default,
    aten.clone.default, aten.contiguous.default, aten.lift_fresh_copy.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.unbind.int, aten.as_strided.default, aten._reshape_alias.default,
    aten.view_as.default, aten.expand_as.default, aten.squeeze_copy.dim, aten.view_copy.default,
    aten.permute_copy.default, aten.unsqueeze_copy.default, aten.expand_copy.default, aten.t_copy.default,
    aten.transpose_copy.int, aten.slice_copy.Tensor, aten.select_copy.int, aten.alias_copy.default,
    aten.repeat.default,  # a copy to torch, index math to lowering (each tiled dim read mod its size): free to recompute
    aten.unfold.default,  # windows as index math
}
CONSTANT_OPS = {
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default, aten.full_like.default,
    aten.zeros.default, aten.zeros_like.default, aten.ones.default, aten.ones_like.default,
    aten.scalar_tensor.default, aten.empty.memory_format, aten.empty_like.default, aten.new_zeros.default,
    aten.new_ones.default, aten.new_full.default, aten.new_empty.default, aten.new_empty_strided.default,
    aten.empty_permuted.default,
}
# Externs: the runtime's table (graph ops it keeps whole), plus the library kernels torch may put in a
# graph under other names. Those never lower (they would be an unsupported op), but the partition
# runs first and must not plan to run one twice.
LIBRARY_OPS = {
    aten.baddbmm.default, aten._convolution.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_cudnn_attention.default, aten._flash_attention_forward.default,
    aten._efficient_attention_forward.default,
}
EXTERN_OPS = {e.graph_op for e in EXTERNS} | LIBRARY_OPS
RANDOM_OPS = {
    aten.rand.default, aten.rand_like.default, aten.randn.default, aten.randn_like.default, aten.randint.default,
    aten.randint_like.default, aten.bernoulli.default, aten.bernoulli.p, aten.native_dropout.default,
    aten.normal.Tensor_float, aten.uniform.default, aten.randperm.default, aten.rand.generator,
    aten.exponential.default,
}
REDUCTION_OPS = {
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default, aten.amin.default,
    aten.max.dim, aten.min.dim, aten.max.default, aten.min.default, aten.any.dim, aten.any.dims, aten.any.default,
    aten.all.dim, aten.all.default, aten.prod.dim_int, aten.prod.default, aten.argmax.default, aten.argmin.default,
    aten.var.correction, aten.var_mean.correction, aten.logsumexp.default, aten.max_pool2d_with_indices.default,
    aten.max_pool2d.default, aten.avg_pool2d.default, aten.cumsum.default, aten.cumprod.default,
    aten.norm.ScalarOpt_dim, aten.max_pool2d_with_indices_backward.default, aten.avg_pool2d_backward.default,
    aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default, aten.logcumsumexp.default,
}
TRANSCENDENTAL = {
    aten.exp.default, aten.exp2.default, aten.expm1.default, aten.log.default, aten.log1p.default,
    aten.log2.default, aten.erf.default, aten.erfc.default, aten.tanh.default, aten.sigmoid.default,
    aten.rsqrt.default, aten.sqrt.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar,
    aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.reciprocal.default, aten.sin.default,
    aten.cos.default, aten.atan2.default, aten.gelu.default, aten.silu.default,
}
POINTWISE_EXTRA = {
    aten._to_copy.default, prims.convert_element_type.default, aten.to.dtype, aten.where.self,
    aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar, aten.clamp.default, aten.clamp_min.default,
    aten.clamp_max.default, aten.hardtanh.default, aten.relu.default,
}
COPY_OPS = {aten.cat.default, aten.stack.default, aten.constant_pad_nd.default, aten.flip.default,
            aten.index_select.default, aten.index.Tensor, aten.gather.default,
            aten.slice_scatter.default, aten.copy.default, aten.scatter.value, aten.scatter.src}
TUPLE_VIEW_OPS = {aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int}


def op_class(node: torch.fx.Node) -> str:
    """The class of one FX node: one of CLASSES except "structural" (a graph node has no such op)."""
    t = node.target
    if t is operator.getitem:
        parent = node.args[0]
        return "view" if getattr(parent, "target", None) in TUPLE_VIEW_OPS else "item"
    if t in VIEW_OPS:
        return "view"
    if t in CONSTANT_OPS:
        return "constant"
    if t in EXTERN_OPS:
        return "extern"
    tags = getattr(t, "tags", ())
    if t in RANDOM_OPS or torch.Tag.nondeterministic_seeded in tags:
        return "random"
    if t in REDUCTION_OPS or torch.Tag.reduction in tags:
        return "reduction"
    if t in TRANSCENDENTAL:
        return "transcendental"
    if t in POINTWISE_EXTRA or torch.Tag.pointwise in tags:
        return "pointwise"
    if t in COPY_OPS:
        return "copy"
    return "unknown"



BANNED_CLASSES = ("extern", "random", "unknown")  # never recomputed: library calls, fresh randomness, unknowns

# Views and casts that keep every element at its index: an integer input read through them still
# indexes what it indexed (the joint trace's input ranges). Narrower than VIEW_OPS on purpose: no
# split/unbind (tuples), no as_strided, and casts, which are pointwise.
INDEX_PRESERVING = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.clone.default, aten.detach.default,
    aten.alias.default, aten.permute.default, aten.t.default, aten.transpose.int, aten.slice.Tensor,
    aten.select.int, aten._to_copy.default, prims.convert_element_type.default,
}
