"""aotfuse.runtime.cuda_driver: argument packing, errors and (with a GPU) real cubin launches.

Without a GPU the launch path runs against a fake libcuda built from C here (needs a C compiler); it
records what cuLaunchKernel received. The gpu tests compile triton kernels in this process for the
device's arch, then load and launch the cubins only through cuda_driver.
"""
from __future__ import annotations

import ctypes
import math
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from aotfuse.errors import AotfuseError
from aotfuse.runtime import cuda_driver as cd
from aotfuse.runtime import kernel_spec as ks

# --- pure packing --------------------------------------------------------------------------------


def _slot(pack, i) -> bytes:
    return pack.slot_bytes(i)


def test_pack_layout_and_values():
    types = ("ptr", "i32", "i64", "fp32", "ptr")
    pack = cd._ArgPack(types)
    assert pack.packer.size == 8 * (len(types) + 2)
    assert len(pack.params) == len(types) + 2
    base = ctypes.addressof(pack.buffer)
    assert [p for p in pack.params] == [base + 8 * i for i in range(len(types) + 2)]
    pack.fill([0x7F00_0000_1234, -5, -(2**40), 1.5, 2**64 - 1])
    assert pack.values() == (0x7F00_0000_1234, -5, -(2**40), 1.5, 2**64 - 1, 0, 0)
    assert _slot(pack, 0) == struct.pack("<Q", 0x7F00_0000_1234)
    assert _slot(pack, 1)[:4] == struct.pack("<i", -5)
    assert _slot(pack, 2) == struct.pack("<q", -(2**40))
    assert _slot(pack, 3)[:4] == struct.pack("<f", 1.5)
    assert _slot(pack, 5) == _slot(pack, 6) == b"\0" * 8  # null scratch pointers
    # what the driver reads through kernelParams[i]
    assert ctypes.c_uint64.from_address(pack.params[0]).value == 0x7F00_0000_1234
    assert ctypes.c_int32.from_address(pack.params[1]).value == -5
    assert ctypes.c_int64.from_address(pack.params[2]).value == -(2**40)
    assert ctypes.c_float.from_address(pack.params[3]).value == 1.5
    pack.fill([1, 2, 3, 0.1, 4], 0xAB00, 0xCD00)
    assert pack.values()[-2:] == (0xAB00, 0xCD00)
    assert ctypes.c_float.from_address(pack.params[3]).value == struct.unpack("<f", struct.pack("<f", 0.1))[0]
    pack.fill([1, 2, 3, 0.1, 4])
    assert pack.values()[-2:] == (0, 0)


def test_pack_more_types():
    pack = cd._ArgPack(("fp16", "fp64", "u32", "i8", "i1"))
    pack.fill([0.5, math.pi, 2**32 - 1, -3, True])
    assert pack.values()[:5] == (0.5, math.pi, 2**32 - 1, -3, 1)
    assert ctypes.c_uint16.from_address(pack.params[0]).value == 0x3800  # fp16 0.5


@pytest.mark.parametrize(
    "types,args,match",
    [
        (("i32",), [2**31], r"argument 0 \(i32\)"),
        (("ptr",), [-1], r"argument 0 \(ptr\)"),
        (("ptr", "i32"), [1, 2.5], r"argument 1 \(i32\)"),
        (("fp32",), [1e300], r"argument 0 \(fp32\)"),
        (("ptr", "i32"), [1], r"takes 2 arguments"),
        (("ptr",), [1, 2], r"takes 1 arguments"),
    ],
)
def test_pack_errors(types, args, match):
    with pytest.raises(AotfuseError, match=match):
        cd._ArgPack(types).fill(args)


def test_pack_tensor_hint():
    with pytest.raises(AotfuseError, match="data_ptr"):
        cd._ArgPack(("ptr",)).fill([torch.zeros(1)])


def test_unknown_arg_type():
    with pytest.raises(AotfuseError, match="unsupported kernel argument type 'bf16'"):
        cd._ArgPack(("ptr", "bf16"))


def test_scratch_bytes():
    meta = {"global_scratch_size": 0, "profile_scratch_size": 0, "num_ctas": 1}
    assert ks.scratch_bytes(meta, (7, 1, 1)) == (0, 0)
    meta = {"global_scratch_size": 128, "global_scratch_align": 16, "profile_scratch_size": 64, "num_ctas": 2}
    assert ks.scratch_bytes(meta, (3, 2, 1)) == (128 * 12, 64 * 12)
    with pytest.raises(AotfuseError, match="alignment"):
        ks.scratch_bytes({"global_scratch_size": 8, "global_scratch_align": 1024}, (1, 1, 1))


def test_kernel_spec_from_fake_compiled():
    class Target:
        arch = 90

    class Meta:
        name = "k"
        num_warps = 8
        num_ctas = 1
        shared = 1024
        global_scratch_size = 0
        global_scratch_align = 1
        profile_scratch_size = 0
        profile_scratch_align = 1
        launch_cooperative_grid = False
        launch_pdl = False
        tensordesc_meta = []
        target = Target()

    class Fn:
        arg_names = ["x", "y", "n", "alpha", "BLOCK"]

    class Src:
        fn = Fn()
        signature = {"x": "*fp32", "y": "*bf16", "n": "i64", "alpha": "fp32", "BLOCK": "constexpr"}

    class Compiled:
        metadata = Meta()
        asm = {"cubin": b"\x7fELF..."}
        src = Src()

    spec = ks.KernelSpec.from_compiled(Compiled())
    assert spec.arg_types == ("ptr", "ptr", "i64", "fp32")
    assert spec.arg_names == ("x", "y", "n", "alpha")
    assert (spec.name, spec.num_warps, spec.shared, spec.arch) == ("k", 8, 1024, 90)
    assert ks.KernelSpec.from_json(spec.to_json(), spec.cubin) == spec
    Meta.num_ctas = 2
    with pytest.raises(AotfuseError, match="num_ctas"):
        ks.KernelSpec.from_compiled(Compiled())


# --- import hygiene / missing driver ------------------------------------------------------------


def test_import_does_not_pull_triton_or_dynamo():
    code = textwrap.dedent(
        """
        import sys
        import aotfuse.runtime.cuda_driver
        bad = sorted(m for m in sys.modules if m.split('.')[0] == 'triton'
                     or m.startswith('torch._dynamo') or m.startswith('torch._inductor'))
        print(bad)
        sys.exit(1 if bad else 0)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_missing_libcuda(monkeypatch):
    monkeypatch.setattr(cd, "_LIBCUDA_NAME", "/nonexistent/libcuda.so.1")
    monkeypatch.setattr(cd, "_DRIVER", None)
    with pytest.raises(AotfuseError, match=r"no CUDA driver \(/nonexistent/libcuda.so.1\) found: "):
        cd.driver()


# --- launch path against a fake libcuda ----------------------------------------------------------

FAKE_CUDA_C = r"""
#include <stdint.h>
#include <string.h>
typedef int CUresult;
static int nparams = 0;
static unsigned char last_params[64 * 8];
static uint64_t last[10];
static int fail_next = 0;
static void* cur_ctx = 0;
static int launches = 0;
void fake_set_nparams(int n) { nparams = n; }
void fake_fail_next(int rc) { fail_next = rc; }
void fake_set_ctx(void* c) { cur_ctx = c; }
int fake_launches(void) { return launches; }
const unsigned char* fake_params(void) { return last_params; }
const uint64_t* fake_last(void) { return last; }
CUresult cuGetErrorName(CUresult e, const char** s) {
  if (e == 719) { *s = "CUDA_ERROR_LAUNCH_FAILED"; return 0; }
  if (e == 201) { *s = "CUDA_ERROR_INVALID_CONTEXT"; return 0; }
  return 1;
}
CUresult cuGetErrorString(CUresult e, const char** s) {
  if (e == 719) { *s = "unspecified launch failure"; return 0; }
  if (e == 201) { *s = "invalid device context"; return 0; }
  return 1;
}
CUresult cuInit(unsigned f) { return 0; }
CUresult cuDriverGetVersion(int* v) { *v = 12080; return 0; }
CUresult cuDeviceGet(int* d, int o) { *d = o; return 0; }
CUresult cuDeviceGetAttribute(int* v, int a, int d) { *v = 232448; return 0; }
CUresult cuCtxGetCurrent(void** c) { *c = cur_ctx; return 0; }
CUresult cuCtxSetCurrent(void* c) { cur_ctx = c; return 0; }
CUresult cuCtxGetDevice(int* d) { *d = 0; return 0; }
CUresult cuCtxPushCurrent_v2(void* c) { return 0; }
CUresult cuCtxPopCurrent_v2(void** c) { return 0; }
CUresult cuDevicePrimaryCtxRetain(void** c, int d) { *c = (void*)0xC0; return 0; }
CUresult cuModuleLoadData(void** m, const void* img) { *m = (void*)0x1000; return 0; }
CUresult cuModuleUnload(void* m) { return 0; }
CUresult cuModuleGetFunction(void** f, void* m, const char* n) { *f = (void*)0x2000; return 0; }
CUresult cuFuncGetAttribute(int* v, int a, void* f) { *v = a == 0 ? 1024 : 0; return 0; }
CUresult cuFuncSetAttribute(void* f, int a, int v) { return 0; }
CUresult cuFuncSetCacheConfig(void* f, int c) { return 0; }
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, void* stream, void** params, void** extra) {
  if (fail_next) { int rc = fail_next; fail_next = 0; return rc; }
  launches++;
  last[0] = (uint64_t)f; last[1] = gx; last[2] = gy; last[3] = gz; last[4] = bx; last[5] = by;
  last[6] = bz; last[7] = shared; last[8] = (uint64_t)stream; last[9] = (uint64_t)extra;
  for (int i = 0; i < nparams; i++) memcpy(last_params + 8 * i, params[i], 8);
  return 0;
}
"""


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcuda")
    d = tmp_path_factory.mktemp("fakecuda")
    (d / "fake.c").write_text(FAKE_CUDA_C)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "libfakecuda.so"), str(d / "fake.c")], check=True)
    lib = ctypes.CDLL(str(d / "libfakecuda.so"))
    lib.fake_params.restype = ctypes.POINTER(ctypes.c_ubyte)
    lib.fake_last.restype = ctypes.POINTER(ctypes.c_uint64)
    lib.fake_set_ctx.argtypes = [ctypes.c_void_p]
    return cd.Driver(lib, str(d / "libfakecuda.so"))


def _fake_function(drv):
    mod = cd.CudaModule(0x1000, 0xC0, 0, drv)
    return mod, mod.function("k", 0, num_warps=4)


def test_launch_passes_grid_block_stream_and_params(fake_driver):
    lib = fake_driver.lib
    mod, fn = _fake_function(fake_driver)
    types = ("ptr", "ptr", "i32", "fp32", "i64")
    lib.fake_set_nparams(len(types) + 2)
    fn.launch((5, 2, 1), 4, 512, 0xDEAD0, [0x1111, 0x2222, 1000, 0.25, 2**33], types)
    last = lib.fake_last()
    assert [last[i] for i in range(10)] == [0x2000, 5, 2, 1, 128, 1, 1, 512, 0xDEAD0, 0]
    raw = bytes(lib.fake_params()[: 8 * (len(types) + 2)])
    assert struct.unpack_from("<QQi4xf4xqQQ", raw) == (0x1111, 0x2222, 1000, 0.25, 2**33, 0, 0)
    # bound launch + scratch pointers + list arg_types
    run = fn.bind(list(types), num_warps=8, shared_bytes=0)
    run((3, 1, 1), 0, [1, 2, 3, 4.0, 5], global_scratch=0x9000)
    assert [last[i] for i in (1, 4, 8)] == [3, 256, 0]
    raw = bytes(lib.fake_params()[: 8 * (len(types) + 2)])
    assert struct.unpack_from("<QQi4xf4xqQQ", raw) == (1, 2, 3, 4.0, 5, 0x9000, 0)
    fn.launch((1, 1, 1), 4, 0, 0, (9, 9, 9, 9.0, 9), list(types))  # unhashable arg_types still work
    # empty grid: no launch, like triton
    n = lib.fake_launches()
    fn.launch((0, 1, 1), 4, 0, 0, [1, 2, 3, 4.0, 5], types)
    assert lib.fake_launches() == n
    mod.close()
    with pytest.raises(AotfuseError, match="module was closed"):
        fn.launch((1, 1, 1), 4, 0, 0, [1, 2, 3, 4.0, 5], types)


def test_prepared_launch_has_its_own_params_and_checks(fake_driver):
    lib = fake_driver.lib
    mod, fn = _fake_function(fake_driver)
    types = ("ptr", "ptr")
    lib.fake_set_nparams(len(types) + 2)
    bound = fn.bind(types, num_warps=4, shared_bytes=256)
    a, b = bound.prepare((7, 1, 1)), bound.prepare((2, 3, 1))
    assert a.pack.buffer is not b.pack.buffer and a.pack.buffer is not bound.pack.buffer
    a.launch(0xBEEF0, [0x10, 0x20])
    last = lib.fake_last()
    assert [last[i] for i in range(9)] == [0x2000, 7, 1, 1, 128, 1, 1, 256, 0xBEEF0]
    assert struct.unpack_from("<QQQQ", bytes(lib.fake_params()[:32])) == (0x10, 0x20, 0, 0)
    b.launch(0, [0x30, 0x40])
    assert [last[i] for i in (1, 2)] == [2, 3]
    a.fill([0x50, 0x60])  # a launch site whose addresses never change: filled once, launched many times
    for stream in (0xCAFE0, 0xCAFF0):
        a.launch_filled(stream)
        assert [last[i] for i in (1, 8)] == [7, stream]
        assert struct.unpack_from("<QQQQ", bytes(lib.fake_params()[:32])) == (0x50, 0x60, 0, 0)
    n = lib.fake_launches()
    bound.prepare((0, 1, 1)).launch(0, [1, 2])  # empty grid: nothing launched
    assert lib.fake_launches() == n
    with pytest.raises(AotfuseError, match="bad launch grid"):
        bound.prepare((1.0, 1, 1))
    lib.fake_fail_next(719)
    with pytest.raises(cd.CudaDriverError, match="CUDA_ERROR_LAUNCH_FAILED"):
        a.launch(0, [1, 2])
    mod.close()
    with pytest.raises(AotfuseError, match="module was closed"):
        a.launch(0, [1, 2])
    with pytest.raises(AotfuseError, match="module was closed"):
        a.launch_filled(0)


def test_launch_error_names_call_and_cuerror(fake_driver):
    _, fn = _fake_function(fake_driver)
    fake_driver.lib.fake_set_nparams(3)
    fake_driver.lib.fake_fail_next(719)
    with pytest.raises(cd.CudaDriverError) as ei:
        fn.launch((1, 1, 1), 4, 0, 0, [1], ("ptr",))
    msg = str(ei.value)
    assert "cuLaunchKernel('k'" in msg and "CUDA_ERROR_LAUNCH_FAILED (719)" in msg
    assert "unspecified launch failure" in msg
    assert ei.value.code == 719 and ei.value.name == "CUDA_ERROR_LAUNCH_FAILED"
    # unknown code: falls back to our table / the number
    err = fake_driver.error(999, "cuFoo")
    assert "cuFoo failed: CUresult 999 (999)" in str(err)


def test_launch_without_context_adopts_module_context(fake_driver):
    lib = fake_driver.lib
    lib.fake_set_ctx(None)
    _, fn = _fake_function(fake_driver)
    lib.fake_set_nparams(3)
    lib.fake_fail_next(201)
    n = lib.fake_launches()
    fn.launch((1, 1, 1), 4, 0, 0, [1], ("ptr",))
    assert lib.fake_launches() == n + 1
    assert cd._current_context(fake_driver) == 0xC0


def test_large_shared_and_thread_checks(fake_driver):
    mod = cd.CudaModule(0x1000, 0xC0, 0, fake_driver)
    fn = mod.function("k", 100 * 1024)
    assert fn.max_shared_bytes == 232448
    with pytest.raises(AotfuseError, match="shared memory"):
        mod.function("k", 300 * 1024)
    with pytest.raises(AotfuseError, match="threads per block"):
        mod.function("k", 0, num_warps=64)
    small = mod.function("k", 0)
    with pytest.raises(AotfuseError, match="shared memory"):
        small.bind(("ptr",), 4, 64 * 1024)


def test_launch_overhead_is_small(fake_driver):
    """Host cost of one launch through the fake driver (guards against per-call allocations)."""
    import time

    _, fn = _fake_function(fake_driver)
    types = ("ptr", "ptr", "ptr", "i32")
    fake_driver.lib.fake_set_nparams(6)
    args = [1, 2, 3, 4]
    run = fn.bind(types, 4, 0)
    for _ in range(100):
        run((1, 1, 1), 0, args)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(2000):
            fn.launch((1, 1, 1), 4, 0, 0, args, types)
        best = min(best, (time.perf_counter() - t0) / 2000)
    assert best < 50e-6, f"{best * 1e6:.1f} us per launch"


def test_launch_rejects_non_int_config(fake_driver):
    _, fn = _fake_function(fake_driver)
    with pytest.raises(AotfuseError, match="bad launch configuration"):
        fn.launch((2.0, 1, 1), 4, 0, 0, [1], ("ptr",))
    with pytest.raises(AotfuseError, match="bad launch configuration"):
        fn.launch((1, 1, 1), 4, 0.0, 0, [1], ("ptr",))
    with pytest.raises(AotfuseError, match="bad launch configuration"):
        fn.launch((1, 1, 1), 4, 0, "stream", [1], ("ptr",))


# --- real GPU: cubins compiled by triton, launched only through cuda_driver ----------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _compile(kind: str, arch: int):
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if kind == "add":

        @triton.jit
        def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)

        src = ASTSource(add_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32",
                                     "BLOCK": "constexpr"}, {"BLOCK": 1024})
    else:

        @triton.jit
        def rowsum_kernel(x_ptr, out_ptr, ncols, scale, row_stride: tl.int64, BLOCK: tl.constexpr):
            row = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            m = cols < ncols
            v = tl.load(x_ptr + row * row_stride + cols, mask=m, other=0.0)
            tl.store(out_ptr + row, tl.sum(v, axis=0) * scale)

        src = ASTSource(rowsum_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "ncols": "i32", "scale": "fp32",
                                        "row_stride": "i64", "BLOCK": "constexpr"}, {"BLOCK": 1024})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    return ks.KernelSpec.from_compiled(compiled)


def test_spec_from_real_triton_compile_on_cpu():
    """triton 3.6 builds sm_90 cubins without a GPU; KernelSpec reads the launch ABI off the result."""
    pytest.importorskip("triton")
    spec = _compile("rowsum", 90)
    assert spec.cubin.startswith(b"\x7fELF") and spec.name == "rowsum_kernel" and spec.arch == 90
    assert spec.arg_types == ("ptr", "ptr", "i32", "fp32", "i64")
    assert spec.num_warps == 4 and spec.num_ctas == 1
    assert ks.scratch_bytes(spec, (37, 1, 1)) == (0, 0)


@pytest.mark.gpu
@gpu
def test_gpu_vector_add_and_graph():
    dev = torch.cuda.current_device()
    spec = _compile("add", cd.device_arch(dev))
    assert spec.arg_types == ("ptr", "ptr", "ptr", "i32")
    assert ks.scratch_bytes(spec, (1, 1, 1)) == (0, 0)
    mod, fn = spec.load()
    n = 1000003
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = torch.empty_like(x)
    grid = ((n + 1023) // 1024, 1, 1)
    stream = torch.cuda.current_stream().cuda_stream
    fn.launch(grid, spec.num_warps, spec.shared, stream, [x.data_ptr(), y.data_ptr(), out.data_ptr(), n],
              spec.arg_types)
    torch.testing.assert_close(out, x + y)

    g = torch.cuda.CUDAGraph()
    out.zero_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run = fn.bind(spec.arg_types, spec.num_warps, spec.shared)
        with torch.cuda.graph(g, stream=s):
            run(grid, torch.cuda.current_stream().cuda_stream, [x.data_ptr(), y.data_ptr(), out.data_ptr(), n])
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(2):
        x.copy_(torch.randn(n, device="cuda"))
        y.copy_(torch.randn(n, device="cuda"))
        g.replay()
        torch.testing.assert_close(out, x + y)
    del g
    mod.close()


@pytest.mark.gpu
@gpu
def test_gpu_rowsum_masked():
    dev = torch.cuda.current_device()
    spec = _compile("rowsum", cd.device_arch(dev))
    assert spec.arg_types == ("ptr", "ptr", "i32", "fp32", "i64")
    mod, fn = spec.load()
    rows, cols = 37, 1000
    x = torch.randn(rows, 1024 + 17, device="cuda")[:, :cols]  # strided rows, masked tail
    out = torch.empty(rows, device="cuda")
    fn.launch((rows, 1, 1), spec.num_warps, spec.shared, torch.cuda.current_stream().cuda_stream,
              [x.data_ptr(), out.data_ptr(), cols, 0.5, x.stride(0)], spec.arg_types)
    torch.testing.assert_close(out, x.sum(1) * 0.5, rtol=1e-4, atol=1e-4)
    mod.close()


@pytest.mark.gpu
@gpu
def test_gpu_wrong_arch_or_bad_name_errors():
    dev = torch.cuda.current_device()
    spec = _compile("add", cd.device_arch(dev))
    mod = cd.CudaModule.load(spec.cubin)
    with pytest.raises(cd.CudaDriverError, match="cuModuleGetFunction.*CUDA_ERROR_NOT_FOUND"):
        mod.function("no_such_kernel", 0)
    mod.close()
