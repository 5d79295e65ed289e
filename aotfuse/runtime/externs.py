"""The one table of externs: aten ops that stay whole and that a program calls through the runtime.

The runtime owns it because it is the security boundary: `ALLOWED` is the only way a program
reaches a torch function. Everything else derives from `EXTERNS`: export's and the joint trace's
keep-whole sets (`keep_whole`), the lowering registry's extern entries (each lowers `graph_op` to a
call of one of `targets`, and `LoweringCtx.extern` refuses any other target), and the partition's
never-recompute set (`aotfuse/opclass.py`). tests/test_truth.py builds every op case and checks
that what lowering emits is exactly `ALLOWED`.
"""
from __future__ import annotations

import dataclasses

import torch

from ..errors import ArchiveError
from . import attention as _attention  # defines aotfuse::attention and aotfuse::attention_backward
from . import embedding_grad as _embedding_grad  # defines aotfuse::embedding_backward, mm_embedding_backward
from . import grouped_mm as _grouped_mm  # defines aotfuse::grouped_mm
from . import mm_residual as _mm_residual  # defines aotfuse::mm_residual

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class ExternOp:
    graph_op: object  # the overload the exported / joint graph keeps whole and lowering sees
    calls: tuple  # the overloads today's lowering may emit for it (first: the usual one)
    inference: bool = True  # kept whole by export's table
    train: bool = True  # kept whole by the joint trace's table (training decomposes attention)
    # Overloads that archives built by earlier versions call for it and today's lowering no longer
    # emits (it lowers the op to a kernel): still allowed, so those archives keep loading.
    legacy: tuple = ()

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(_name(c) for c in self.calls + self.legacy)


def _name(overload) -> str:
    # "aten.mm.out": the spelling programs store (str(torch.ops.aten.mm.out) is "aten.mm.out").
    return str(overload)


EXTERNS: tuple[ExternOp, ...] = (
    ExternOp(aten.scaled_dot_product_attention.default, (aten.scaled_dot_product_attention.default,), train=False),
    # kept whole (the index range of its input, never recomputed) but lowered as a gather kernel
    # (lower/gather.py); archives before that call aten.embedding.out
    ExternOp(aten.embedding.default, (), legacy=(aten.embedding.out,)),
    # the functional op (its result bound as the buffer when it has the planned layout); archives before
    # that call convolution.out (a copy of the result into the buffer)
    ExternOp(aten.convolution.default, (aten.convolution.default,), legacy=(aten.convolution.out,)),
    ExternOp(aten.mm.default, (aten.mm.out,)),
    # addmm with a bias that is not a broadcast row lowers to mm + a pointwise add
    ExternOp(aten.addmm.default, (aten.addmm.out, aten.mm.out)),
    # addmm then a tanh GELU in one call (export/mm_gelu.py fuses them; inference only: the backward of a
    # GELU reads its input, which this call never writes): cuBLASLt's GELU_BIAS epilogue on CUDA
    ExternOp(aten._addmm_activation.default, (aten._addmm_activation.out,), train=False),
    ExternOp(aten.bmm.default, (aten.bmm.out,)),
    # a scatter by index tensors: x[idx] = v written functionally, and (accumulate) the gradient of x[idx] (CLIP's
    # pooling at the end-of-text token, Whisper's decoder); torch's kernel, its result bound as the buffer
    ExternOp(aten.index_put.default, (aten.index_put.default,)),
    # a scatter-add along a dim (segment sums); its gradient is a gather, which lowers. Its kernel family also runs
    # an aten.scatter (src or value) that lower/gather.py does not write as compares (more indices per row: sort's
    # gradient), which is otherwise lowered, not kept whole
    ExternOp(aten.scatter_add.default, (aten.scatter_add.default, aten.scatter.src, aten.scatter.value)),
    # (values, int64 indices): torch's kernels (top-k routing and sampling, argsort); their gradient is a scatter
    ExternOp(aten.topk.default, (aten.topk.default,)),
    ExternOp(aten.sort.default, (aten.sort.default,)),
    # a mixture of experts run grouped (transformers' default experts; lower/experts.py): tokens counted per expert
    # by torch's kernel, and the grouped matmul by offsets (runtime/grouped_mm.py; a bmm when it has none)
    ExternOp(aten.histc.default, (aten.histc.default,)),
    ExternOp(aten._grouped_mm.default, (_grouped_mm.grouped_mm, aten.bmm.out)),
    # ... and transformers' float32 fallback op, rewritten to it (export/experts.py): no traced graph holds it before
    ExternOp(_grouped_mm.grouped_mm, (_grouped_mm.grouped_mm,), inference=False, train=False),
    # a matmul with its bias and a residual added as it writes (lower/residual.py makes it from mm/addmm + add;
    # no exported or joint graph holds it): cuBLASLt's D = A @ B + C with the BIAS epilogue on CUDA
    ExternOp(_mm_residual.mm_residual, (_mm_residual.mm_residual_out_op,), inference=False, train=False),
    # an embedding's weight gradient by atomic adds (runtime/embedding_grad.py); aten's sorted kernel for
    # scale_grad_by_freq
    ExternOp(aten.embedding_dense_backward.default,
             (_embedding_grad.embedding_backward, aten.embedding_dense_backward.out), inference=False),
    # a tied table's gradient, a matmul's product with an embedding's rows added into it (joint/tied_embedding.py
    # makes it from the joint graph's add; no traced graph holds it)
    ExternOp(_embedding_grad.mm_embedding_backward, (_embedding_grad.mm_embedding_backward,), inference=False,
             train=False),
    # the gradient of a convolution: cuDNN's dgrad / wgrad; a multi-result extern whose results are the
    # outputs its output_mask asks for (in order; the others are None and bind nothing)
    ExternOp(aten.convolution_backward.default, (aten.convolution_backward.default,), inference=False),
    # training's fused attention (runtime/attention.py): multi-output externs, (out, lse) and (dq, dk, dv)
    ExternOp(_attention.attention, (_attention.attention,), inference=False),
    ExternOp(_attention.attention_backward, (_attention.attention_backward,), inference=False),
    # ... and its backward with a learned bias's gradient (a float mask that requires grad: Swin's position bias)
    ExternOp(_attention.attention_backward_bias, (_attention.attention_backward_bias,), inference=False),
)

ALLOWED = {_name(c): c for e in EXTERNS for c in e.calls + e.legacy}
LEGACY = {_name(c) for e in EXTERNS for c in e.legacy}  # allowed for older archives, emitted by no lowering


def keep_whole(train: bool) -> tuple:
    """The graph ops a decomposition table must leave alone (export: train=False; joint trace: True)."""
    return tuple(e.graph_op for e in EXTERNS if (e.train if train else e.inference))


# The callable the executor calls for an allowed target, where torch's Python binding takes the same
# arguments as the overload (positional, then beta/alpha and out= by keyword) and dispatches to it:
# about 3 us less host time per call than the OpOverload object (and, for _addmm_activation, the same
# GELU on the CPU as on CUDA). Validation still reads the
# overload's schema (ALLOWED); tests/test_runtime_unit.py checks each binding against its overload.
# (On CUDA the matmuls usually skip torch altogether: runtime/cublaslt.py.)
def _addmm_activation(bias, mat1, mat2, *, beta=1, alpha=1, use_gelu=False, out):
    """`aten._addmm_activation.out` as its CUDA kernels compute it on every device: addmm, then the tanh
    GELU (use_gelu) or ReLU. torch's CPU kernel applies the erf GELU instead (`at::gelu_` with its default
    approximation), which is not what the program means: its GELU is the model's tanh one (export/mm_gelu.py),
    the one cuBLASLt's GELU epilogue computes. So the CPU computes addmm into `out`, then the GELU in place."""
    if out.is_cuda:
        return torch._addmm_activation(bias, mat1, mat2, beta=beta, alpha=alpha, use_gelu=use_gelu, out=out)
    torch.addmm(bias, mat1, mat2, beta=beta, alpha=alpha, out=out)
    return torch._C._nn.gelu_(out, approximate="tanh") if use_gelu else out.relu_()


BINDINGS = {
    "aten.mm.out": torch.mm,
    "aten.addmm.out": torch.addmm,
    "aten._addmm_activation.out": _addmm_activation,
    "aten.bmm.out": torch.bmm,
    "aotfuse.mm_residual.out": _mm_residual.mm_residual_out,
    # F.scaled_dot_product_attention's C binding: (q, k, v, attn_mask, dropout_p, is_causal, *, scale, enable_gqa)
    "aten.scaled_dot_product_attention.default": torch._C._nn.scaled_dot_product_attention,
}


def resolve(target: str):
    fn = ALLOWED.get(target)
    if fn is None:
        raise ArchiveError(f"program calls {target!r}, which is not on the runtime's extern allow-list",
                           remedy="rebuild the archive with this aotfuse version")
    return BINDINGS.get(target, fn)
