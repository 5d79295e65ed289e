"""Matmul externs through cuBLASLt, prepared once per executor state: one ctypes call per matmul.

A program's `aten.mm.out` / `aten.addmm.out` / `aten._addmm_activation.out` / `aten.bmm.out` /
`aotfuse.mm_residual.out` externs have
static shapes, strides and
dtypes, so everything torch's dispatcher works out on every call (argument parsing, dispatch, layout
checks, the cuBLAS handle, the workspace, the algorithm) can be worked out once. Linking derives a
`MatmulSpec` per extern (pure: `derive`, tested on the CPU); binding a state (`Executor.state()`)
turns each spec into an `LtMatmul`: the matmul descriptor, the matrix layouts, the algorithm picked
by `cublasLtMatmulAlgoGetHeuristic`, and a workspace the state owns (so a CUDA-graph capture needs no
process-wide workspace map: graphs.py's cuBLAS protocol is about torch's own calls). A call is then
one `cublasLtMatmul` on the caller's raw stream with the operands' device addresses.

Row-major tensors meet column-major cuBLAS by the transpose trick: D[M,N] = A[M,K] @ B[K,N] is
computed as D^T = B^T @ A^T, where each transpose of a row-major (or column-major) view is a
column-major (or transposed) matrix with the same leading dimension. A 1-d addmm bias is then a
vector along the rows of D^T: the CUBLASLT_EPILOGUE_BIAS epilogue adds it in the same kernel.
`_addmm_activation(..., use_gelu=True)` (a tanh GELU fused at export, export/mm_gelu.py) is the same
matmul with CUBLASLT_EPILOGUE_GELU_BIAS: bias, then cuBLASLt's GELU (the tanh approximation) on each
element as it is written; elementwise, so the transpose changes nothing about it.
`aotfuse.mm_residual.out` (lower/residual.py) is the same matmul with C = the residual and beta = 1, its
bias (if any) in the BIAS epilogue: D^T = B^T A^T + C^T, C in D's orientation with its own leading dimension.

Numerics follow torch's defaults, read from torch when a state is bound and checked on every call
(a change re-binds): fp32 computes in CUBLAS_COMPUTE_32F, or CUBLAS_COMPUTE_32F_FAST_TF32 when
`torch.backends.cuda.matmul.allow_tf32`; fp16/bf16 in CUBLAS_COMPUTE_32F with fp32 alpha/beta;
split-K reductions in the output type only where torch allows reduced-precision reductions; no
atomics-based (in-place) reduction under `torch.use_deterministic_algorithms(True)`.

What is not supported keeps torch's binding, and says why (`State.matmul_report()`): other dtypes,
operands that are not a strided matrix (a broadcast batch, overlapping rows), an addmm whose bias is
not a row vector or whose alpha/beta is not 1, an _addmm_activation's ReLU, fp16 accumulation
(`allow_fp16_accumulation`), no algorithm from the heuristic, no libcublasLt in the process, or `AOTFUSE_CUBLASLT=0`. An operand
whose address changes per call (an input, a buffer allocated per call) is checked against the
alignment the algorithm was picked for; a misaligned one runs that call through torch (counted).

Nothing here imports triton, dynamo or inductor; torch only for the policy flags and the workspace.
"""
from __future__ import annotations

import ctypes
import dataclasses
import glob
import os
import threading
import weakref
from typing import Sequence

import torch

from ..errors import AotfuseError

# --- cuBLAS / cuBLASLt constants (cublas_api.h, cublasLt.h, library_types.h) ---------------------
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 77
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
EPILOGUE_DEFAULT, EPILOGUE_BIAS, EPILOGUE_GELU_BIAS = 1, 4, 36  # GELU_BIAS = GELU (32) | BIAS (4)
LAYOUT_BATCH_COUNT, LAYOUT_STRIDED_BATCH_OFFSET = 5, 6
PREF_MAX_WORKSPACE_BYTES, PREF_REDUCTION_SCHEME_MASK = 1, 3
PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # A, B, C, D bytes
REDUCTION_NONE, REDUCTION_INPLACE, REDUCTION_COMPUTE_TYPE, REDUCTION_OUTPUT_TYPE, REDUCTION_ALL = 0, 1, 2, 4, 7
MAX_ALIGNMENT = 256  # cuBLASLt's default (and largest) alignment preference
DYNAMIC_BASE_ALIGNMENT = 256  # assumed for per-call buffers (torch's allocator gives 512), checked per call

DATA_TYPES = {torch.float32: CUDA_R_32F, torch.float16: CUDA_R_16F, torch.bfloat16: CUDA_R_16BF}
TARGETS = ("aten.mm.out", "aten.addmm.out", "aten._addmm_activation.out", "aten.bmm.out", "aotfuse.mm_residual.out")
_ADDMM = ("aten.addmm.out", "aten._addmm_activation.out")
_INT32_MAX = 2**31 - 1

_STATUS = {0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
           7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
           13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR", 15: "CUBLAS_STATUS_NOT_SUPPORTED",
           16: "CUBLAS_STATUS_LICENSE_ERROR"}


class CublasLtError(AotfuseError):
    """A cuBLASLt call failed: names the call and the status."""

    def __init__(self, call: str, status: int, name: str):
        self.call, self.status, self.status_name = call, status, name
        super().__init__(f"{call} failed: {name} ({status})")


# --- pure derivation (no GPU) --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Layout:
    """A matrix as cuBLASLt stores it: column-major `rows` x `cols`, leading dimension `ld` (elements),
    `batch` of them `batch_stride` elements apart."""
    rows: int
    cols: int
    ld: int
    batch: int = 1
    batch_stride: int = 0


@dataclasses.dataclass(frozen=True)
class Operand:
    """Where a matrix starts: executor slot `slot`, plus `byte_offset` bytes."""
    slot: int
    byte_offset: int


@dataclasses.dataclass(frozen=True)
class MatmulSpec:
    """One extern as a cuBLASLt matmul: D' (m x n) = op(A') (m x k) @ op(B') (k x n) [+ C'] [+ bias along m]
    [then GELU].
    `swapped`: D' is the program's D transposed (A' = B^T, B' = A^T), the usual row-major case.
    `gelu`: the epilogue is GELU_BIAS (cuBLASLt's tanh GELU after the bias), not BIAS.
    `c` / `c_ref`: aotfuse::mm_residual's residual, added with beta 1 (its own layout; None: C is D, beta 0)."""
    target: str
    dtype: torch.dtype
    m: int
    n: int
    k: int
    batch: int
    transa: int
    transb: int
    a: Layout
    b: Layout
    d: Layout
    a_ref: Operand
    b_ref: Operand
    d_ref: Operand
    bias_ref: Operand | None
    swapped: bool
    gelu: bool = False
    c: Layout | None = None
    c_ref: Operand | None = None

    def describe(self) -> str:
        ops = "NT"
        return (f"{self.target} {str(self.dtype).removeprefix('torch.')} m={self.m} n={self.n} k={self.k}"
                + (f" batch={self.batch}" if self.batch > 1 else "")
                + f" op={ops[self.transa]}{ops[self.transb]}" + (" +bias" if self.bias_ref is not None else "")
                + (" +residual" if self.c is not None else "") + (" +gelu" if self.gelu else "")
                + (" (D^T = B^T A^T)" if self.swapped else ""))


class Unsupported(Exception):
    """Why an extern keeps torch's binding (a message for the report)."""


def column_major(rows: int, cols: int, s_row: int, s_col: int) -> tuple[int, tuple[int, int, int]] | None:
    """A logical rows x cols matrix whose element (r, c) lies at r*s_row + c*s_col, as cuBLASLt takes it:
    (CUBLAS_OP_N, (rows, cols, ld)) when it is column-major, (CUBLAS_OP_T, (cols, rows, ld)) when it is
    row-major (its transpose is column-major); None when it is neither or its columns/rows overlap.
    A dimension of extent 1 has no meaningful stride: ld is then the smallest valid one."""
    if rows < 1 or cols < 1:
        return None
    if s_row == 1 or rows == 1:
        ld = s_col if cols > 1 else rows
        if ld >= rows:
            return CUBLAS_OP_N, (rows, cols, ld)
    if s_col == 1 or cols == 1:
        ld = s_row if rows > 1 else cols
        if ld >= cols:
            return CUBLAS_OP_T, (cols, rows, ld)
    return None


def _span(lay: tuple[int, int, int]) -> int:
    rows, cols, ld = lay
    return ld * (cols - 1) + rows


def _bias_ok(shape, stride, n: int) -> bool:
    """Is this addmm bias one value per output column, packed (what CUBLASLT_EPILOGUE_BIAS adds)?"""
    if len(shape) == 1:
        return shape[0] == n and (n == 1 or stride[0] == 1)
    if len(shape) == 2:
        return shape[1] == n and (n == 1 or stride[1] == 1) and (shape[0] == 1 or stride[0] == 0)
    return False


def derive(target: str, args: Sequence, kwargs: dict, out, dtypes: dict, itemsize: int | None = None) -> MatmulSpec:
    """The cuBLASLt form of one matmul extern, or Unsupported(why).

    args / out: the extern's arguments as the executor links them (objects with slot, shape, stride,
    offset; anything else is a scalar); dtypes: slot -> torch dtype."""
    if target not in TARGETS:
        raise Unsupported(f"{target} is not a matmul")
    bias = residual = None
    gelu = False
    if target == "aotfuse.mm_residual.out":
        if len(args) != 4 or kwargs:
            raise Unsupported("mm_residual with other than (self, mat2, residual, bias)")
        a, b, residual, bias = args
    elif target in _ADDMM:
        if len(args) != 3:
            raise Unsupported("addmm with other than (bias, mat1, mat2)")
        bias, a, b = args
        known = {"beta", "alpha"} | ({"use_gelu"} if target == "aten._addmm_activation.out" else set())
        if any(kwargs.get(k, 1) != 1 for k in ("beta", "alpha")) or set(kwargs) - known:
            raise Unsupported("addmm with alpha or beta other than 1")
        if target == "aten._addmm_activation.out":
            if kwargs.get("use_gelu") is not True:
                raise Unsupported("_addmm_activation with ReLU (use_gelu=False): no epilogue for it here")
            gelu = True
    else:
        if len(args) != 2 or kwargs:
            raise Unsupported(f"{target} with arguments other than (self, mat2)")
        a, b = args
    tensors = [t for t in (a, b, out, bias, residual) if t is not None]
    if not all(hasattr(t, "slot") and hasattr(t, "stride") for t in tensors):
        raise Unsupported("an operand is not a tensor view")
    dts = {dtypes.get(t.slot) for t in tensors}
    if len(dts) != 1:
        raise Unsupported(f"mixed dtypes {sorted(str(d) for d in dts)}")
    dtype = dts.pop()
    if dtype not in DATA_TYPES:
        raise Unsupported(f"dtype {dtype} (cuBLASLt path: float32, float16, bfloat16)")
    size = itemsize or dtype.itemsize
    batched = target == "aten.bmm.out"
    nd = 3 if batched else 2
    if any(len(t.shape) != nd for t in (a, b, out) + ((residual,) if residual is not None else ())):
        raise Unsupported("operand ranks do not match the op")
    if any(s < 0 for t in tensors for s in t.stride) or any(t.offset < 0 for t in tensors):
        raise Unsupported("negative stride or offset")
    M, K = a.shape[-2:]
    K2, N = b.shape[-2:]
    B = a.shape[0] if batched else 1
    if K2 != K or tuple(out.shape[-2:]) != (M, N) or (batched and (b.shape[0] != B or out.shape[0] != B)):
        raise Unsupported(f"shapes {a.shape} @ {b.shape} -> {out.shape} do not agree")
    if min(M, N, K, B) < 1:
        raise Unsupported("an empty dimension")
    if max(M, N, K, B) > _INT32_MAX:
        raise Unsupported("a dimension beyond int32")
    if residual is not None and tuple(residual.shape) != (M, N):
        raise Unsupported(f"residual {tuple(residual.shape)} is not the product's {(M, N)}")
    if bias is not None and not _bias_ok(bias.shape, bias.stride, N):
        raise Unsupported(f"addmm bias {tuple(bias.shape)} stride {tuple(bias.stride)} is not a packed row vector")

    def mat(t):  # (rows, cols, s_row, s_col) of the last two dims
        return (t.shape[-2], t.shape[-1], t.stride[-2], t.stride[-1])

    def transposed(r, c, sr, sc):
        return (c, r, sc, sr)

    # The swapped form first: it is the one for a row-major D, and the only one with a bias epilogue.
    cm = mat(residual) if residual is not None else None
    forms = [(True, transposed(*mat(out)), transposed(*mat(b)), transposed(*mat(a)), b, a, N, M,
              transposed(*cm) if cm else None)]
    if bias is None:
        forms.append((False, mat(out), mat(a), mat(b), a, b, M, N, cm))
    for swapped, dm, am, bm, ta, tb, m, n, cmat in forms:
        d_lay = column_major(*dm)
        a_lay = column_major(*am)
        b_lay = column_major(*bm)
        c_lay = column_major(*cmat) if cmat else None
        if d_lay is None or d_lay[0] != CUBLAS_OP_N or a_lay is None or b_lay is None:
            continue
        if cmat and (c_lay is None or c_lay[0] != CUBLAS_OP_N):  # C takes no transpose: D's orientation
            continue
        batch_strides = (ta.stride[0], tb.stride[0], out.stride[0]) if batched and B > 1 else (0, 0, 0)
        if batched and B > 1:
            if min(batch_strides[:2]) < 1:
                raise Unsupported("a batch-broadcast operand (batch stride 0)")
            if batch_strides[2] < _span(d_lay[1]):
                raise Unsupported("output matrices of the batch overlap")
        (transa, (ar, ac, alda)), (transb, (br, bc, bldb)), (_, (dr, dc, dld)) = a_lay, b_lay, d_lay
        return MatmulSpec(
            target=target, dtype=dtype, m=m, n=n, k=K, batch=B, transa=transa, transb=transb,
            a=Layout(ar, ac, alda, B, batch_strides[0]), b=Layout(br, bc, bldb, B, batch_strides[1]),
            d=Layout(dr, dc, dld, B, batch_strides[2]),
            a_ref=Operand(ta.slot, ta.offset * size), b_ref=Operand(tb.slot, tb.offset * size),
            d_ref=Operand(out.slot, out.offset * size),
            bias_ref=None if bias is None else Operand(bias.slot, bias.offset * size), swapped=swapped, gelu=gelu,
            c=None if c_lay is None else Layout(*c_lay[1]),
            c_ref=None if residual is None else Operand(residual.slot, residual.offset * size))
    raise Unsupported("operands are not strided matrices cuBLASLt takes (a row or a column stride of 1, "
                      "non-overlapping)" + ("; with a bias the output must be row-major" if bias is not None else "")
                      + ("; the residual must be stored as the output is (row- or column-major alike)"
                         if residual is not None else ""))


def alignment(address: int) -> int:
    """The largest power of two <= MAX_ALIGNMENT dividing `address` (an address or a byte offset)."""
    if address == 0:
        return MAX_ALIGNMENT
    return min(MAX_ALIGNMENT, address & -address)


@dataclasses.dataclass(frozen=True)
class Policy:
    """torch's matmul settings that change what cuBLAS computes, read together on every call."""
    tf32: bool
    fp16_reduced: bool
    bf16_reduced: bool
    fp16_accumulation: bool
    deterministic: bool

    def compute_type(self, dtype: torch.dtype) -> int:
        return CUBLAS_COMPUTE_32F_FAST_TF32 if dtype == torch.float32 and self.tf32 else CUBLAS_COMPUTE_32F

    def reduction_mask(self, dtype: torch.dtype) -> int:
        """Split-K reduction schemes allowed: in the output type only where torch allows a reduced-
        precision reduction for this dtype; no in-place (atomics) reduction when determinism is asked."""
        mask = REDUCTION_ALL
        if (dtype == torch.float16 and not self.fp16_reduced) or (dtype == torch.bfloat16 and not self.bf16_reduced):
            mask &= ~(REDUCTION_OUTPUT_TYPE | REDUCTION_INPLACE)
        if self.deterministic:
            mask &= ~REDUCTION_INPLACE
        return mask


def _flag(v) -> bool:
    # torch returns (allow, allow_splitk) for the reduced-precision flags in recent versions
    return all(v) if isinstance(v, tuple) else bool(v)


_C = torch._C


_fp16_accumulation = getattr(_C, "_get_cublas_allow_fp16_accumulation", lambda: False)


def policy_key() -> tuple:
    """torch's current matmul settings as the fields of a Policy (a plain tuple: compared on every call)."""
    return (bool(_C._get_cublas_allow_tf32()), _flag(_C._get_cublas_allow_fp16_reduced_precision_reduction()),
            _flag(_C._get_cublas_allow_bf16_reduced_precision_reduction()), bool(_fp16_accumulation()),
            bool(_C._get_deterministic_algorithms()))


# --- the library --------------------------------------------------------------------------------

_vp = ctypes.c_void_p
_PROTOTYPES = {
    "cublasLtCreate": (ctypes.POINTER(_vp),),
    "cublasLtMatmulDescCreate": (ctypes.POINTER(_vp), ctypes.c_int, ctypes.c_int),
    "cublasLtMatmulDescSetAttribute": (_vp, ctypes.c_int, _vp, ctypes.c_size_t),
    "cublasLtMatmulDescDestroy": (_vp,),
    "cublasLtMatrixLayoutCreate": (ctypes.POINTER(_vp), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                   ctypes.c_int64),
    "cublasLtMatrixLayoutSetAttribute": (_vp, ctypes.c_int, _vp, ctypes.c_size_t),
    "cublasLtMatrixLayoutDestroy": (_vp,),
    "cublasLtMatmulPreferenceCreate": (ctypes.POINTER(_vp),),
    "cublasLtMatmulPreferenceSetAttribute": (_vp, ctypes.c_int, _vp, ctypes.c_size_t),
    "cublasLtMatmulPreferenceDestroy": (_vp,),
    "cublasLtMatmulAlgoGetHeuristic": (_vp, _vp, _vp, _vp, _vp, _vp, _vp, ctypes.c_int, _vp,
                                       ctypes.POINTER(ctypes.c_int)),
}


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def find_library() -> str | None:
    """The libcublasLt torch loaded (its wheel's, or the system's), else one next to torch's install."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcublasLt.so" in line:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and os.path.exists(parts[5].strip()):
                        return parts[5].strip()
    except OSError:
        pass
    site = os.path.dirname(os.path.dirname(torch.__file__))
    for pattern in ("nvidia/cublas/lib/libcublasLt.so*", "nvidia/cu*/lib/libcublasLt.so*"):
        hits = sorted(glob.glob(os.path.join(site, pattern)))
        if hits:
            return hits[-1]
    return None


class Library:
    """libcublasLt with typed entry points, and a pool of handles per device."""

    def __init__(self, path: str):
        self.path = path
        lib = ctypes.CDLL(path)
        for name, argtypes in _PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = argtypes
            setattr(self, name, fn)
        # Hot path, unprototyped: every argument is passed as a ctypes object (c_void_p / c_size_t).
        self.matmul = lib["cublasLtMatmul"]
        self.matmul.restype = ctypes.c_int
        try:
            name = lib.cublasLtGetStatusName
            name.restype, name.argtypes = ctypes.c_char_p, (ctypes.c_int,)
            self._status_name = name
        except AttributeError:
            self._status_name = None
        try:
            ver = lib.cublasLtGetVersion
            ver.restype, ver.argtypes = ctypes.c_size_t, ()
            self.version = int(ver())
        except AttributeError:
            self.version = 0
        self._pools: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def status_name(self, status: int) -> str:
        if self._status_name is not None:
            s = self._status_name(status)
            if s:
                return s.decode(errors="replace")
        return _STATUS.get(status, f"cublasStatus {status}")

    def check(self, status: int, call: str) -> None:
        if status:
            raise CublasLtError(call, status, self.status_name(status))

    def take_handle(self, device_index: int) -> int:
        """A handle for this device, from the pool (handles are never destroyed: returned, reused)."""
        with self._lock:
            pool = self._pools.setdefault(device_index, [])
            if pool:
                return pool.pop()
        h = _vp()
        with torch.cuda.device(device_index):  # a handle belongs to the device current at creation
            self.check(self.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        return h.value

    def give_handle(self, device_index: int, handle: int) -> None:
        with self._lock:
            self._pools.setdefault(device_index, []).append(handle)


_LIB: Library | None = None
_LIB_WHY = ""
_LIB_LOCK = threading.Lock()


def library() -> Library:
    """The process's libcublasLt (loaded once); Unsupported(why) when there is none."""
    global _LIB, _LIB_WHY
    if _LIB is not None:
        return _LIB
    with _LIB_LOCK:
        if _LIB is None and not _LIB_WHY:
            path = find_library()
            if path is None:
                _LIB_WHY = "no libcublasLt in this process or next to torch"
            else:
                try:
                    _LIB = Library(path)
                except (OSError, AttributeError) as e:
                    _LIB_WHY = f"{path}: {e}"
        if _LIB is None:
            raise Unsupported(_LIB_WHY)
        return _LIB


# --- a prepared matmul ---------------------------------------------------------------------------

def _destroy(lib: Library, desc: int, layouts: list[int]) -> None:
    # host-only frees: safe from a finalizer on any thread, during a capture too
    if desc:
        lib.cublasLtMatmulDescDestroy(desc)
    for lay in layouts:
        if lay:
            lib.cublasLtMatrixLayoutDestroy(lay)


class LtMatmul:
    """One matmul extern of one state: descriptor, layouts and algorithm made once; `run` is one call.

    static: slot -> device address for the slots whose tensor is bound for the state's lifetime
    (weights, the arena); the other operands are read from the executor's address list per call."""

    def __init__(self, lib: Library, handle: int, spec: MatmulSpec, policy: Policy, static: dict[int, int],
                 max_workspace: int):
        if spec.dtype == torch.float16 and policy.fp16_accumulation:
            raise Unsupported("torch.backends.cuda.matmul.allow_fp16_accumulation is on (fp16 compute)")
        self.lib, self.spec = lib, spec
        self.fallbacks = 0
        self._layouts: list[int] = []
        desc = _vp()
        lib.check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), policy.compute_type(spec.dtype), CUDA_R_32F),
                  "cublasLtMatmulDescCreate")
        self._desc = desc
        self._finalizer = weakref.finalize(self, _destroy, lib, desc.value, self._layouts)
        self._set_desc(DESC_TRANSA, ctypes.c_int32(spec.transa))
        self._set_desc(DESC_TRANSB, ctypes.c_int32(spec.transb))
        dtype = DATA_TYPES[spec.dtype]
        self._a, self._b, self._d = (self._layout(lay, dtype) for lay in (spec.a, spec.b, spec.d))
        # C: D itself (beta 0), or mm_residual's residual (beta 1, its own layout and address)
        self._c = self._d if spec.c is None else self._layout(spec.c, dtype)

        # Operand addresses: constants for static slots; per-call ones are checked against the
        # alignment the algorithm is picked for (that of the offset within a 256-byte aligned base).
        refs = (spec.a_ref, spec.b_ref, spec.d_ref) + ((spec.c_ref,) if spec.c_ref is not None else ())
        self._ptrs = [_vp() for _ in refs]
        self._dynamic: list[tuple] = []
        aligns = []
        for cv, ref in zip(self._ptrs, refs):
            base = static.get(ref.slot)
            if base is None:
                align = alignment(DYNAMIC_BASE_ALIGNMENT | ref.byte_offset)
                self._dynamic.append((cv, ref.slot, ref.byte_offset, align - 1))
            else:
                cv.value = base + ref.byte_offset
                align = alignment(cv.value)
            aligns.append(align)
        self._bias_dynamic = None
        self._bias_value = -1
        if spec.bias_ref is not None:
            self._set_desc(DESC_EPILOGUE, ctypes.c_uint32(EPILOGUE_GELU_BIAS if spec.gelu else EPILOGUE_BIAS))
            base = static.get(spec.bias_ref.slot)
            if base is None:  # set per call (when it changes); the heuristic sees its assumed alignment
                balign = alignment(DYNAMIC_BASE_ALIGNMENT | spec.bias_ref.byte_offset)
                self._bias_dynamic = (spec.bias_ref.slot, spec.bias_ref.byte_offset, balign - 1)
                self._set_bias(balign)
            else:
                self._set_bias(base + spec.bias_ref.byte_offset)

        pref = _vp()
        lib.check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            def set_pref(attr, value):
                lib.check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(value),
                                                                    ctypes.sizeof(value)),
                          f"cublasLtMatmulPreferenceSetAttribute({attr})")
            set_pref(PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(max_workspace))
            mask = policy.reduction_mask(spec.dtype)
            if mask != REDUCTION_ALL:
                set_pref(PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(mask))
            a_al, b_al, d_al = aligns[:3]
            c_al = aligns[3] if len(aligns) > 3 else d_al  # C is D unless a residual
            for attr, al in zip(PREF_MIN_ALIGNMENT, (a_al, b_al, c_al, d_al)):
                set_pref(attr, ctypes.c_uint32(al))
            self._result = _HeuristicResult()
            count = ctypes.c_int(0)
            status = lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, self._a, self._b, self._c, self._d, pref, 1,
                                                        ctypes.addressof(self._result), ctypes.byref(count))
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        if status == 15:  # CUBLAS_STATUS_NOT_SUPPORTED: no heuristic for this configuration
            raise Unsupported("cuBLASLt has no algorithm for this configuration")
        lib.check(status, "cublasLtMatmulAlgoGetHeuristic")
        if count.value < 1 or self._result.state != 0:
            raise Unsupported("cuBLASLt's heuristic returned no algorithm")
        self.workspace_needed = int(self._result.workspaceSize)
        self.alignments = tuple(aligns)
        self._handle = _vp(handle)
        self._alpha = ctypes.c_float(1.0)
        self._beta = ctypes.c_float(0.0 if spec.c is None else 1.0)
        self._stream = _vp()
        self._ws, self._ws_size = _vp(), ctypes.c_size_t(0)
        pa, pb, pd = self._ptrs[:3]
        pc = self._ptrs[3] if spec.c is not None else pd
        self._args = (self._handle, desc, _vp(ctypes.addressof(self._alpha)), pa, self._a, pb, self._b,
                      _vp(ctypes.addressof(self._beta)), pc, self._c, pd, self._d,
                      _vp(ctypes.addressof(self._result)), self._ws, self._ws_size, self._stream)

    def _set_desc(self, attr: int, value) -> None:
        self.lib.check(self.lib.cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(value),
                                                               ctypes.sizeof(value)),
                       f"cublasLtMatmulDescSetAttribute({attr})")

    def _set_bias(self, address: int) -> None:
        self._set_desc(DESC_BIAS_POINTER, _vp(address))
        self._bias_value = address

    def _layout(self, lay: Layout, dtype: int) -> _vp:
        h = _vp()
        self.lib.check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(h), dtype, lay.rows, lay.cols, lay.ld),
                       "cublasLtMatrixLayoutCreate")
        self._layouts.append(h.value)
        if lay.batch > 1:
            for attr, value in ((LAYOUT_BATCH_COUNT, ctypes.c_int32(lay.batch)),
                                (LAYOUT_STRIDED_BATCH_OFFSET, ctypes.c_int64(lay.batch_stride))):
                self.lib.check(self.lib.cublasLtMatrixLayoutSetAttribute(h, attr, ctypes.byref(value),
                                                                         ctypes.sizeof(value)),
                               f"cublasLtMatrixLayoutSetAttribute({attr})")
        return h

    def use_workspace(self, address: int, size: int) -> None:
        self._ws.value = address or None
        self._ws_size.value = size

    def run(self, stream: int, addr: list) -> bool:
        """One cublasLtMatmul on `stream`; False (nothing launched) when a per-call operand is not
        aligned as the algorithm needs: the caller runs torch's binding instead."""
        for cv, slot, off, mask in self._dynamic:
            p = addr[slot] + off
            if p & mask:
                self.fallbacks += 1
                return False
            cv.value = p
        if self._bias_dynamic is not None:
            slot, off, mask = self._bias_dynamic
            p = addr[slot] + off
            if p & mask:
                self.fallbacks += 1
                return False
            if p != self._bias_value:
                self._set_bias(p)
        self._stream.value = stream or None
        rc = self.lib.matmul(*self._args)
        if rc:
            raise CublasLtError(f"cublasLtMatmul({self.spec.describe()})", rc, self.lib.status_name(rc))
        return True

    def record(self) -> dict:
        return {"target": self.spec.target, "path": "cublaslt", "matmul": self.spec.describe(), "workspace": self.workspace_needed,
                "alignment": list(self.alignments), "algo": list(self._result.algo[:2]),
                "torch_calls_misaligned": self.fallbacks}
