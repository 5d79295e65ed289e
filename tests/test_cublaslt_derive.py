"""The cuBLASLt form of matmul externs (runtime/cublaslt.py), checked without a GPU.

`emulate` computes what cublasLtMatmul would do with a derived MatmulSpec, from its documented
semantics (column-major layouts with leading dimensions, op N/T, strided batches, a bias along the
rows of D, the GELU_BIAS epilogue's tanh GELU) on flat CPU memory; the result must be torch's, written
through the program's out view.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from aotfuse.contract.program import TensorRef
from aotfuse.runtime import cublaslt
from aotfuse.runtime.cublaslt import CUBLAS_OP_N, CUBLAS_OP_T, Unsupported, column_major, derive
from aotfuse.runtime.executor import _View


def _stored(mem: torch.Tensor, lay: cublaslt.Layout, byte_offset: int, itemsize: int, b: int) -> torch.Tensor:
    """The column-major rows x cols matrix `b` of a layout, as a tensor view of flat memory."""
    off = byte_offset // itemsize + b * lay.batch_stride
    return mem.as_strided((lay.rows, lay.cols), (1, lay.ld), off)


def emulate(spec: cublaslt.MatmulSpec, mems: dict[int, torch.Tensor]) -> None:
    """D' = op(A') @ op(B') (+ bias along D's rows), per batch, in float64, written into D's memory."""
    size = mems[spec.d_ref.slot].element_size()
    for b in range(spec.batch):
        a = _stored(mems[spec.a_ref.slot], spec.a, spec.a_ref.byte_offset, size, b).double()
        bm = _stored(mems[spec.b_ref.slot], spec.b, spec.b_ref.byte_offset, size, b).double()
        a = a if spec.transa == CUBLAS_OP_N else a.t()
        bm = bm if spec.transb == CUBLAS_OP_N else bm.t()
        assert a.shape == (spec.m, spec.k) and bm.shape == (spec.k, spec.n)
        d = a @ bm
        if spec.c is not None:  # mm_residual: beta 1, C at its own address and leading dimension
            d = d + _stored(mems[spec.c_ref.slot], spec.c, spec.c_ref.byte_offset, size, b).double()
        if spec.bias_ref is not None:
            bias = mems[spec.bias_ref.slot][spec.bias_ref.byte_offset // size:][:spec.m].double()
            d = d + bias[:, None]
        if spec.gelu:
            d = torch.nn.functional.gelu(d, approximate="tanh")
        _stored(mems[spec.d_ref.slot], spec.d, spec.d_ref.byte_offset, size, b).copy_(d)


def _view(slot: int, shape, stride, offset=0) -> _View:
    return _View(slot, TensorRef(f"b{slot}", tuple(shape), tuple(stride), offset))


def _layout_of(shape, order: str, pad: int):
    """Strides of a matrix (or batch of them) that is row-major ("r") or column-major ("c") in its last
    two dims, with `pad` extra elements per leading dimension."""
    *batch, r, c = shape
    if order == "r":
        s = [c + pad, 1]
        span = r * (c + pad)
    else:
        s = [1, r + pad]
        span = c * (r + pad)
    return tuple([span + pad] * len(batch) + s)


def _run_case(target, M, K, N, B, orders, pads, offsets, bias=False):
    g = torch.Generator().manual_seed(M * 1000 + K * 10 + N)
    batched = target == "aten.bmm.out"
    shapes = [(B, M, K), (B, K, N), (B, M, N)] if batched else [(M, K), (K, N), (M, N)]
    views, mems, tensors = [], {}, []
    for slot, (shape, order, pad, off) in enumerate(zip(shapes, orders, pads, offsets)):
        stride = _layout_of(shape, order, pad)
        numel = off + sum((n - 1) * s for n, s in zip(shape, stride)) + 1
        mem = torch.randn(numel, generator=g, dtype=torch.float64)
        mems[slot] = mem
        views.append(_view(slot, shape, stride, off))
        tensors.append(mem.as_strided(shape, stride, off))
    args = [views[0], views[1]]
    if bias:
        mems[3] = torch.randn(N + 3, generator=g, dtype=torch.float64)
        args = [_view(3, (N,), (1,), 3)] + args
    # float32 as far as derive is concerned; the emulation runs on float64 memory (itemsize 8)
    gelu = target == "aten._addmm_activation.out"
    spec = derive(target, args, {"use_gelu": True} if gelu else {}, views[2], {s: torch.float32 for s in range(4)},
                  itemsize=8)
    ref = torch.bmm(tensors[0], tensors[1]) if batched else tensors[0] @ tensors[1]
    if bias:
        ref = ref + mems[3][3:]
    if gelu:
        ref = torch.nn.functional.gelu(ref, approximate="tanh")
    emulate(spec, mems)
    out = mems[2].as_strided(shapes[2], views[2].stride, offsets[2])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    return spec


def _residual_case(M, K, N, orders, bias: bool, pad: int = 2, off: int = 5):
    """aotfuse.mm_residual.out: (a, b, residual, bias) -> out, emulated from the derived spec; orders are
    those of a, b, residual and out."""
    g = torch.Generator().manual_seed(M * 100 + K * 10 + N)
    shapes = [(M, K), (K, N), (M, N), (M, N)]
    mems, views, tensors = {}, [], []
    for slot, (shape, order) in enumerate(zip(shapes, orders)):
        stride = _layout_of(shape, order, pad)
        numel = off + sum((n - 1) * s for n, s in zip(shape, stride)) + 1
        mems[slot] = torch.randn(numel, generator=g, dtype=torch.float64)
        views.append(_view(slot, shape, stride, off))
        tensors.append(mems[slot].as_strided(shape, stride, off))
    args = views[:3] + [None]
    ref = tensors[0] @ tensors[1] + tensors[2]
    if bias:
        mems[4] = torch.randn(N + 1, generator=g, dtype=torch.float64)
        args[3] = _view(4, (N,), (1,), 1)
        ref = ref + mems[4][1:]
    spec = derive("aotfuse.mm_residual.out", args, {}, views[3], {s: torch.float32 for s in range(5)}, itemsize=8)
    emulate(spec, mems)
    torch.testing.assert_close(mems[3].as_strided(shapes[3], views[3].stride, off), ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(mems[2].as_strided(shapes[2], views[2].stride, off), tensors[2])  # C only read
    return spec


@pytest.mark.parametrize("orders", list(itertools.product("rc", repeat=2)))
def test_mm_residual_adds_c_with_its_own_layout(orders):
    # D = A @ B + C (+ bias): C stored as D is (row-major here), with its own padding and offset
    for M, K, N in ((5, 7, 3), (1, 4, 6), (6, 3, 1)):
        for bias in (False, True):
            spec = _residual_case(M, K, N, orders + ("r", "r"), bias)
            assert spec.c is not None and spec.c_ref == cublaslt.Operand(2, 5 * 8)
            assert spec.describe().count("+residual") == 1 and (spec.bias_ref is not None) == bias


def test_mm_residual_column_major_without_bias_and_mismatched_orientations():
    spec = _residual_case(5, 7, 3, ("r", "c", "c", "c"), bias=False)
    assert not spec.swapped  # D column-major: cuBLAS's own orientation, C with it
    with pytest.raises(Unsupported, match="the residual must be stored as the output is"):
        _residual_case(5, 7, 3, ("r", "r", "c", "r"), bias=False)
    with pytest.raises(Unsupported, match="residual .* is not the product's"):
        derive("aotfuse.mm_residual.out", [_view(0, (4, 5), (5, 1)), _view(1, (5, 6), (6, 1)),
                                           _view(2, (4, 5), (5, 1)), None], {}, _view(3, (4, 6), (6, 1)),
               {s: torch.float32 for s in range(4)})


@pytest.mark.parametrize("orders", list(itertools.product("rc", repeat=3)))
def test_mm_every_orientation_matches_torch(orders):
    for M, K, N in ((5, 7, 3), (1, 4, 6), (6, 1, 5), (4, 6, 1), (1, 1, 1)):
        for pads, offsets in (((0, 0, 0), (0, 0, 0)), ((2, 3, 1), (5, 1, 7))):
            _run_case("aten.mm.out", M, K, N, 1, orders, pads, offsets)


@pytest.mark.parametrize("orders", list(itertools.product("rc", repeat=2)))
def test_addmm_bias_epilogue_matches_torch(orders):
    for M, K, N in ((5, 7, 3), (1, 4, 6), (6, 3, 1)):
        spec = _run_case("aten.addmm.out", M, K, N, 1, orders + ("r",), (0, 2, 1), (0, 3, 2), bias=True)
        assert spec.swapped and spec.bias_ref is not None and spec.m == N


@pytest.mark.parametrize("orders", list(itertools.product("rc", repeat=2)))
def test_addmm_gelu_epilogue_matches_torch(orders):
    # _addmm_activation(use_gelu=True): the same transpose trick as addmm, GELU_BIAS instead of BIAS
    for M, K, N in ((5, 7, 3), (1, 4, 6), (6, 3, 1)):
        spec = _run_case("aten._addmm_activation.out", M, K, N, 1, orders + ("r",), (0, 2, 1), (0, 3, 2), bias=True)
        assert spec.swapped and spec.bias_ref is not None and spec.gelu and spec.m == N
        assert spec.describe().endswith("+bias +gelu (D^T = B^T A^T)")


def test_the_anchor_mlp_fc_is_one_gelu_bias_matmul():
    # the anchor GPT's fc at 8 x 1024: [8192, 768] @ w.t() [768, 3072] + bias [3072], then tanh GELU
    x, wt, out, bias = _view(0, (8192, 768), (768, 1)), _view(1, (768, 3072), (1, 768)), \
        _view(2, (8192, 3072), (3072, 1)), _view(3, (3072,), (1,))
    spec = derive("aten._addmm_activation.out", [bias, x, wt], {"use_gelu": True}, out,
                  {s: torch.bfloat16 for s in range(4)})
    plain = derive("aten.addmm.out", [bias, x, wt], {}, out, {s: torch.bfloat16 for s in range(4)})
    assert spec.gelu and not plain.gelu
    assert spec == cublaslt.MatmulSpec(**{**plain.__dict__, "target": "aten._addmm_activation.out", "gelu": True})
    assert (spec.m, spec.n, spec.k, spec.transa, spec.transb) == (3072, 8192, 768, CUBLAS_OP_T, CUBLAS_OP_N)
    assert cublaslt.EPILOGUE_GELU_BIAS == 36  # CUBLASLT_EPILOGUE_GELU_BIAS (cublasLt.h)


@pytest.mark.parametrize("orders", [("r", "r", "r"), ("r", "c", "r"), ("c", "r", "c"), ("c", "c", "r")])
def test_bmm_strided_batches_match_torch(orders):
    for M, K, N, B in ((5, 7, 3, 4), (1, 3, 2, 3), (4, 2, 5, 1)):
        spec = _run_case("aten.bmm.out", M, K, N, B, orders, (1, 0, 2), (3, 0, 1))
        assert spec.batch == B


def test_the_demo_linear_is_the_transpose_trick():
    # nn.Linear: x [16, 32] @ w.t() [32, 96] (w row-major [96, 32]) + bias [96] -> out [16, 96]
    x, wt, out, bias = _view(0, (16, 32), (32, 1)), _view(1, (32, 96), (1, 32)), _view(2, (16, 96), (96, 1)), \
        _view(3, (96,), (1,))
    spec = derive("aten.addmm.out", [bias, x, wt], {}, out, {s: torch.float32 for s in range(4)})
    assert (spec.m, spec.n, spec.k, spec.swapped) == (96, 16, 32, True)
    assert (spec.transa, spec.transb) == (CUBLAS_OP_T, CUBLAS_OP_N)  # A' = w (row-major): op T
    assert spec.a == cublaslt.Layout(32, 96, 32) and spec.b == cublaslt.Layout(32, 16, 32)
    assert spec.d == cublaslt.Layout(96, 16, 96)
    assert spec.bias_ref == cublaslt.Operand(3, 0) and spec.a_ref == cublaslt.Operand(1, 0)


def test_column_major_of_degenerate_and_overlapping_matrices():
    assert column_major(3, 4, 4, 1) == (CUBLAS_OP_T, (4, 3, 4))
    assert column_major(3, 4, 1, 3) == (CUBLAS_OP_N, (3, 4, 3))
    assert column_major(1, 4, 99, 1) == (CUBLAS_OP_N, (1, 4, 1))  # a row: any row stride
    assert column_major(4, 1, 1, 99) == (CUBLAS_OP_N, (4, 1, 4))
    assert column_major(3, 4, 2, 1) is None  # rows overlap (ld 2 < 4 columns)
    assert column_major(3, 4, 0, 1) is None  # a broadcast row
    assert column_major(3, 4, 8, 2) is None  # neither dim is unit-stride
    assert column_major(0, 4, 4, 1) is None


@pytest.mark.parametrize("case,why", [
    ("mixed", "mixed dtypes"),
    ("int", "dtype torch.int64"),
    ("broadcast_batch", "batch stride 0"),
    ("bias_col_out", "output must be row-major"),
    ("bias_2d", "not a packed row vector"),
    ("alpha", "alpha or beta"),
    ("relu", "ReLU"),
    ("gelu_alpha", "alpha or beta"),
    ("gelu_bias_2d", "not a packed row vector"),
    ("not_strided", "not strided matrices"),
    ("empty", "empty dimension"),
])
def test_unsupported_forms_say_why(case, why):
    f32 = {s: torch.float32 for s in range(5)}
    a, b, out = _view(0, (4, 5), (5, 1)), _view(1, (5, 6), (6, 1)), _view(2, (4, 6), (6, 1))
    bias = _view(3, (6,), (1,))
    target, args, kwargs, dts = "aten.mm.out", [a, b], {}, f32
    if case == "mixed":
        dts = {**f32, 1: torch.bfloat16}
    elif case == "int":
        dts = {s: torch.int64 for s in range(4)}
    elif case == "broadcast_batch":
        target = "aten.bmm.out"
        args = [_view(0, (3, 4, 5), (0, 5, 1)), _view(1, (3, 5, 6), (30, 6, 1))]
        out = _view(2, (3, 4, 6), (24, 6, 1))
    elif case == "bias_col_out":
        target, args, out = "aten.addmm.out", [bias, a, b], _view(2, (4, 6), (1, 4))
    elif case == "bias_2d":
        target, args = "aten.addmm.out", [_view(3, (4, 6), (6, 1)), a, b]
    elif case == "alpha":
        target, args, kwargs = "aten.addmm.out", [bias, a, b], {"alpha": 2.0}
    elif case == "relu":
        target, args, kwargs = "aten._addmm_activation.out", [bias, a, b], {"use_gelu": False}
    elif case == "gelu_alpha":
        target, args, kwargs = "aten._addmm_activation.out", [bias, a, b], {"use_gelu": True, "beta": 0.5}
    elif case == "gelu_bias_2d":
        target, args, kwargs = "aten._addmm_activation.out", [_view(3, (4, 6), (6, 1)), a, b], {"use_gelu": True}
    elif case == "not_strided":
        args = [_view(0, (4, 5), (10, 2)), b]
    elif case == "empty":
        args, out = [_view(0, (0, 5), (5, 1)), b], _view(2, (0, 6), (6, 1))
    with pytest.raises(Unsupported, match=why):
        derive(target, args, kwargs, out, dts)


def test_a_broadcast_bias_row_is_accepted():
    a, b, out = _view(0, (4, 5), (5, 1)), _view(1, (5, 6), (1, 5)), _view(2, (4, 6), (6, 1))
    spec = derive("aten.addmm.out", [_view(3, (4, 6), (0, 1), 2), a, b], {"beta": 1, "alpha": 1}, out,
                  {s: torch.bfloat16 for s in range(4)})
    assert spec.bias_ref == cublaslt.Operand(3, 4) and spec.dtype == torch.bfloat16


def test_alignment_and_policy():
    assert cublaslt.alignment(0) == 256 and cublaslt.alignment(4096) == 256
    assert cublaslt.alignment(256 | 48) == 16 and cublaslt.alignment(6) == 2
    p = cublaslt.Policy(tf32=False, fp16_reduced=True, bf16_reduced=False, fp16_accumulation=False,
                        deterministic=True)
    assert p.compute_type(torch.float32) == cublaslt.CUBLAS_COMPUTE_32F
    assert cublaslt.Policy(True, True, True, False, False).compute_type(torch.float32) == \
        cublaslt.CUBLAS_COMPUTE_32F_FAST_TF32
    assert p.compute_type(torch.bfloat16) == cublaslt.CUBLAS_COMPUTE_32F  # fp32 accumulation for halves
    assert p.reduction_mask(torch.bfloat16) == cublaslt.REDUCTION_COMPUTE_TYPE  # no reduced-precision split-K
    assert p.reduction_mask(torch.float16) == cublaslt.REDUCTION_ALL & ~cublaslt.REDUCTION_INPLACE
    key = cublaslt.policy_key()
    assert cublaslt.Policy(*key).tf32 == torch.backends.cuda.matmul.allow_tf32


def test_cpu_executor_reports_torch_bindings_for_its_matmuls():
    import aotfuse

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(3, 8)
    art = aotfuse.load(aotfuse.build(model, (x,), targets=("sm_90",)).data, device="cpu")
    ex = art.executors["forward"]
    assert all(isinstance(v, cublaslt.MatmulSpec) for v in ex.matmuls.values())  # both have a cuBLASLt form ...
    assert [r["path"] for r in ex.matmul_report()] == ["torch", "torch"]  # ... which the CPU path does not take
    torch.testing.assert_close(art(x), model(x))
    rep = ex.matmul_report()
    assert [r["path"] for r in rep] == ["torch", "torch"] and all("CPU" in r["why"] for r in rep)
