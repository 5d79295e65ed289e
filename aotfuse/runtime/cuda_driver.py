"""A small ctypes wrapper of the CUDA driver API: load cubins, launch them on torch's stream.

The runtime loads cubins that triton 3.6 compiled on a CPU-only machine and launches them with
``cuLaunchKernel`` on ``torch.cuda.current_stream().cuda_stream``. Nothing here imports triton,
torch._dynamo or torch._inductor; torch is imported lazily, only to make its primary context current.

Triton 3.6 kernel ABI (read from triton/backends/nvidia/driver.py and compiler.py, confirmed on H100):

* Parameters, in order: every argument of the ``@triton.jit`` function whose signature type is not
  ``"constexpr"`` (in the order of the ASTSource signature, which is the function's argument order),
  then TWO trailing ``u64`` pointers: the global scratch buffer and the profile scratch buffer.
  Pointers (``*fp32`` ...) are ``CUdeviceptr``; ``fp32`` scalars are 4-byte floats; ``i32``/``i64``
  are the plain integers.
* Block = ``(32 * num_warps, 1, 1)`` (the PTX carries ``.reqntid``, so it must match exactly); dynamic
  shared memory = ``metadata.shared``; grid = ``(gx * num_ctas, gy, gz)``. With ``num_ctas == 1`` and
  neither ``launch_cooperative_grid`` nor ``launch_pdl``, triton's ``cuLaunchKernelEx`` gets no launch
  attributes (no cluster dims), which is exactly ``cuLaunchKernel``. Other settings are refused by
  :meth:`KernelSpec.from_compiled`.
* Scratch: ``metadata.global_scratch_size`` / ``profile_scratch_size`` (bytes per program) with
  ``*_align``. When a size is 0 triton passes a null pointer; else it allocates
  ``gx * gy * gz * num_ctas * size`` bytes aligned to ``*_align`` per launch (see :func:`scratch_bytes`).
* Loading: when ``metadata.shared > 48 KiB`` triton sets ``CU_FUNC_CACHE_PREFER_SHARED`` and
  ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = optin - static`` (we do the same).
* Metadata fields (``compiled.metadata``): ``name``, ``num_warps``, ``num_ctas``, ``shared``,
  ``global_scratch_size``, ``global_scratch_align``, ``profile_scratch_size``,
  ``profile_scratch_align``, ``launch_cooperative_grid``, ``launch_pdl``, ``tensordesc_meta``,
  ``target.arch``; the binary is ``compiled.asm["cubin"]``. A ``GPUTarget("cuda", 90, 32)`` build is
  an ``sm_90a`` cubin: it loads on sm_90 only (not forward compatible).
"""
from __future__ import annotations

import ctypes
import struct
import sys
import threading
from typing import Any, Sequence

from aotfuse.errors import AotfuseError

__all__ = [
    "CudaDriverError",
    "Driver",
    "driver",
    "device_arch",
    "CudaModule",
    "CudaFunction",
    "BoundLaunch",
    "PreparedLaunch",
    "ARG_TYPES",
]

# Patched by tests to simulate a machine without a driver.
_LIBCUDA_NAME = "libcuda.so.1"

# --- driver constants (cuda.h) ---
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_CONTEXT = 201
CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_CACHE_PREFER_SHARED = 1  # cuda.h: CUfunc_cache (0 none, 1 shared, 2 L1, 3 equal)
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
DEFAULT_SHARED_LIMIT = 48 * 1024

# Fallback names, used only when cuGetErrorName itself fails.
_KNOWN_ERRORS = {
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    200: "CUDA_ERROR_INVALID_IMAGE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    209: "CUDA_ERROR_NO_BINARY_FOR_GPU",
    400: "CUDA_ERROR_INVALID_HANDLE",
    500: "CUDA_ERROR_NOT_FOUND",
    701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
    719: "CUDA_ERROR_LAUNCH_FAILED",
}

_c_int_p = ctypes.POINTER(ctypes.c_int)
_c_void_pp = ctypes.POINTER(ctypes.c_void_p)
_c_char_pp = ctypes.POINTER(ctypes.c_char_p)
_uint = ctypes.c_uint

# name -> argtypes; every function returns CUresult (int).
_PROTOTYPES: dict[str, tuple] = {
    "cuGetErrorName": (ctypes.c_int, _c_char_pp),
    "cuGetErrorString": (ctypes.c_int, _c_char_pp),
    "cuInit": (_uint,),
    "cuDriverGetVersion": (_c_int_p,),
    "cuDeviceGet": (_c_int_p, ctypes.c_int),
    "cuDeviceGetAttribute": (_c_int_p, ctypes.c_int, ctypes.c_int),
    "cuCtxGetCurrent": (_c_void_pp,),
    "cuCtxSetCurrent": (ctypes.c_void_p,),
    "cuCtxGetDevice": (_c_int_p,),
    "cuCtxPushCurrent_v2": (ctypes.c_void_p,),
    "cuCtxPopCurrent_v2": (_c_void_pp,),
    "cuDevicePrimaryCtxRetain": (_c_void_pp, ctypes.c_int),
    "cuModuleLoadData": (_c_void_pp, ctypes.c_char_p),
    "cuModuleUnload": (ctypes.c_void_p,),
    "cuModuleGetFunction": (_c_void_pp, ctypes.c_void_p, ctypes.c_char_p),
    "cuFuncGetAttribute": (_c_int_p, ctypes.c_int, ctypes.c_void_p),
    "cuFuncSetAttribute": (ctypes.c_void_p, ctypes.c_int, ctypes.c_int),
    "cuFuncSetCacheConfig": (ctypes.c_void_p, ctypes.c_int),
    # f, grid xyz, block xyz, sharedMemBytes, hStream, kernelParams, extra
    "cuLaunchKernel": (ctypes.c_void_p, _uint, _uint, _uint, _uint, _uint, _uint, _uint,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p),
}


class CudaDriverError(AotfuseError):
    """A CUDA driver call failed: names the call and the CUresult (number, name and description)."""

    def __init__(self, call: str, code: int, name: str, description: str, *, remedy: str | None = None):
        self.call = call
        self.code = code
        self.name = name
        self.description = description
        super().__init__(f"{call} failed: {name} ({code}): {description}", remedy=remedy)


class Driver:
    """The loaded libcuda with typed entry points (attributes named like the C functions)."""

    def __init__(self, lib: Any, path: str = _LIBCUDA_NAME):
        self.lib = lib
        self.path = path
        for name, argtypes in _PROTOTYPES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError as e:
                raise AotfuseError(f"CUDA driver {path} lacks {name}",
                                   remedy="install an NVIDIA driver for CUDA 12 or newer") from e
            fn.restype = ctypes.c_int
            fn.argtypes = argtypes
            setattr(self, name, fn)
        # Hot path: a second, unprototyped handle of cuLaunchKernel. ctypes' per-argument argtypes
        # conversion costs more than the call itself; launch() passes only Python ints < 2**31 (as C
        # int, which the ABI reads as the unsigned grid/block/shared values) and c_void_p objects.
        self.cuLaunchKernel_fast = lib["cuLaunchKernel"]
        self.cuLaunchKernel_fast.restype = ctypes.c_int

    def pdl_launcher(self):
        """cuLaunchKernelEx with programmatic stream serialization, in cuLaunchKernel's call form (made once)."""
        launcher = getattr(self, "_pdl_launcher", None)
        if launcher is None:
            from .launch_pdl import PdlLauncher

            launcher = self._pdl_launcher = PdlLauncher(self.lib)
        return launcher

    def error_name(self, code: int) -> str:
        s = ctypes.c_char_p()
        if self.cuGetErrorName(code, ctypes.byref(s)) == CUDA_SUCCESS and s.value:
            return s.value.decode(errors="replace")
        return _KNOWN_ERRORS.get(code, f"CUresult {code}")

    def error_string(self, code: int) -> str:
        s = ctypes.c_char_p()
        if self.cuGetErrorString(code, ctypes.byref(s)) == CUDA_SUCCESS and s.value:
            return s.value.decode(errors="replace")
        return "unknown error"

    def error(self, code: int, call: str, *, remedy: str | None = None) -> CudaDriverError:
        return CudaDriverError(call, code, self.error_name(code), self.error_string(code), remedy=remedy)

    def check(self, code: int, call: str, *, remedy: str | None = None) -> None:
        if code != CUDA_SUCCESS:
            raise self.error(code, call, remedy=remedy)

    def version(self) -> int:
        v = ctypes.c_int()
        self.check(self.cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
        return v.value


_DRIVER: Driver | None = None
_DRIVER_LOCK = threading.Lock()


def driver() -> Driver:
    """The process-wide driver, dlopen'ed on first use."""
    global _DRIVER
    d = _DRIVER
    if d is not None:
        return d
    with _DRIVER_LOCK:
        if _DRIVER is None:
            try:
                lib = ctypes.CDLL(_LIBCUDA_NAME)
            except OSError as e:
                raise AotfuseError(f"no CUDA driver ({_LIBCUDA_NAME}) found: {e}",
                                   remedy="run on a machine with an NVIDIA GPU and driver installed") from e
            _DRIVER = Driver(lib, _LIBCUDA_NAME)
        return _DRIVER


def device_arch(device_index: int) -> int:
    """Compute capability as one number: 90 for H100/H200, 80 for A100."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return major * 10 + minor


# --- context handling -------------------------------------------------------------------------


def _current_context(d: Driver) -> int:
    ctx = ctypes.c_void_p()
    d.check(d.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    return ctx.value or 0


def _make_primary_current(d: Driver, device_index: int) -> int:
    dev = ctypes.c_int()
    d.check(d.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    # torch uses the same primary context; the reference we take is never released (like torch/triton).
    d.check(d.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value), "cuDevicePrimaryCtxRetain")
    d.check(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx.value or 0


def _ensure_torch_context(device_index: int) -> int:
    """Make the primary context of ``device_index`` current on this thread (torch's context)."""
    d = driver()
    d.check(d.cuInit(0), "cuInit")
    ctx = _current_context(d)
    if ctx:
        dev = ctypes.c_int()
        d.check(d.cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
        ordinal = ctypes.c_int()
        d.check(d.cuDeviceGet(ctypes.byref(ordinal), device_index), "cuDeviceGet")
        if dev.value == ordinal.value:
            return ctx
    return _make_primary_current(d, device_index)


# --- argument packing -------------------------------------------------------------------------

# Every kernel parameter gets an 8-byte slot in one buffer; kernelParams[i] points at slot i. The
# driver copies as many bytes from each pointer as the kernel's parameter has, so the value sits in
# the slot's low bytes (little endian). One struct.pack_into fills all slots per launch.
ARG_TYPES: dict[str, str] = {
    "ptr": "Q",   # CUdeviceptr (u64)
    "i1": "B",
    "i8": "b",
    "i16": "h",
    "i32": "i",
    "i64": "q",
    "u1": "B",
    "u8": "B",
    "u16": "H",
    "u32": "I",
    "u64": "Q",
    "fp16": "e",
    "fp32": "f",  # rounded from the Python float like triton's (float) cast
    "fp64": "d",
}
_SLOT = 8
_SCRATCH_ARGS = 2  # global scratch, profile scratch


class _ArgPack:
    """Preallocated kernelParams for one signature: a slot buffer, a void*[] into it, a packer."""

    __slots__ = ("arg_types", "nargs", "packer", "buffer", "params")

    def __init__(self, arg_types: tuple[str, ...]):
        fmt = ["<"]
        for i, t in enumerate(arg_types):
            code = ARG_TYPES.get(t)
            if code is None:
                raise AotfuseError(f"unsupported kernel argument type {t!r} at position {i}",
                                   remedy=f"use one of {sorted(ARG_TYPES)}")
            fmt.append(code)
            pad = _SLOT - struct.calcsize("<" + code)
            if pad:
                fmt.append(f"{pad}x")
        fmt.append("QQ")  # the two trailing scratch pointers
        self.arg_types = arg_types
        self.nargs = len(arg_types)
        self.packer = struct.Struct("".join(fmt))
        n = self.nargs + _SCRATCH_ARGS
        assert self.packer.size == n * _SLOT
        self.buffer = ctypes.create_string_buffer(n * _SLOT)
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * n)(*[base + _SLOT * i for i in range(n)])

    def fill(self, args: Sequence[int | float], global_scratch: int = 0, profile_scratch: int = 0) -> None:
        try:
            self.packer.pack_into(self.buffer, 0, *args, global_scratch, profile_scratch)
        except (struct.error, OverflowError, TypeError) as e:
            raise self._explain(args, global_scratch, profile_scratch, e) from e

    def _explain(self, args, global_scratch, profile_scratch, cause) -> AotfuseError:
        args = list(args)
        if len(args) != self.nargs:
            return AotfuseError(f"kernel takes {self.nargs} arguments {list(self.arg_types)}, got {len(args)}")
        for i, (t, v) in enumerate(zip(self.arg_types, args)):
            try:
                struct.pack("<" + ARG_TYPES[t], v)
            except (struct.error, OverflowError, TypeError) as e:
                hint = " (pass tensor.data_ptr(), not the tensor)" if t == "ptr" and not isinstance(v, int) else ""
                return AotfuseError(f"kernel argument {i} ({t}) = {v!r:.80} cannot be packed: {e}{hint}")
        return AotfuseError(f"scratch pointers ({global_scratch!r}, {profile_scratch!r}) cannot be packed: {cause}")

    def values(self) -> tuple:
        """Read back what the next launch will pass (user args then the two scratch pointers)."""
        return self.packer.unpack_from(self.buffer, 0)

    def slot_bytes(self, i: int) -> bytes:
        return bytes(self.buffer[_SLOT * i:_SLOT * (i + 1)])


# --- module / function ------------------------------------------------------------------------


# Modules dropped by the garbage collector, unloaded later by _unload_after_drain (see __del__).
_GRAVEYARD: list[tuple[int, int, int, "Driver"]] = []
_GRAVEYARD_LOCK = threading.Lock()


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _unload_after_drain(extra: list | None = None) -> None:
    """Unload `extra` and the deferred modules once their devices finished all queued work.
    Nothing is unloaded while this thread captures a CUDA graph (the graveyard keeps them)."""
    import torch

    with _GRAVEYARD_LOCK:
        if _capturing():
            _GRAVEYARD.extend(extra or ())
            return
        deferred, _GRAVEYARD[:] = list(_GRAVEYARD), []
    explicit = list(extra or ())
    for dev in sorted({t[2] for t in deferred + explicit}) if torch.cuda.is_available() else ():
        torch.cuda.synchronize(dev)
    for item in deferred:
        try:
            _unload(*item)
        except CudaDriverError:  # its context is gone, and the module with it
            pass
    for item in explicit:
        _unload(*item)


def _unload(handle: int, context: int, device_index: int, d: "Driver") -> None:
    pushed = False
    if context and _current_context(d) != context:
        d.check(d.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        pushed = True
    try:
        d.check(d.cuModuleUnload(handle), "cuModuleUnload")
    finally:
        if pushed:
            old = ctypes.c_void_p()
            d.cuCtxPopCurrent_v2(ctypes.byref(old))


class CudaModule:
    """A cubin loaded with cuModuleLoadData into torch's primary context of one device."""

    def __init__(self, handle: int, context: int, device_index: int, drv: Driver):
        self._handle = handle
        self._context = context
        self.device_index = device_index
        self._driver = drv
        self._functions: list[CudaFunction] = []

    @classmethod
    def load(cls, image: bytes, device_index: int | None = None) -> "CudaModule":
        """Load a cubin into the primary context of ``device_index`` (default: torch's current device)."""
        import torch

        if not isinstance(image, (bytes, bytearray, memoryview)):
            raise AotfuseError(f"cubin image must be bytes, got {type(image).__name__}")
        image = bytes(image)
        if not image.startswith(b"\x7fELF"):
            raise AotfuseError("cubin image is not an ELF file (expected compiled.asm['cubin'])")
        torch.cuda.init()
        current = torch.cuda.current_device()
        if device_index is None or device_index == current:
            return cls._load_current(image, current)
        with torch.cuda.device(device_index):
            return cls._load_current(image, device_index)

    @classmethod
    def _load_current(cls, image: bytes, device_index: int) -> "CudaModule":
        if _GRAVEYARD:
            _unload_after_drain()
        d = driver()
        ctx = _ensure_torch_context(device_index)
        mod = ctypes.c_void_p()
        rc = d.cuModuleLoadData(ctypes.byref(mod), image)
        if rc != CUDA_SUCCESS:
            remedy = None
            if d.error_name(rc) in ("CUDA_ERROR_NO_BINARY_FOR_GPU", "CUDA_ERROR_INVALID_SOURCE",
                                    "CUDA_ERROR_INVALID_IMAGE", "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"):
                remedy = (f"the cubin was built for another architecture; this device is "
                          f"sm_{device_arch(device_index)} (sm_90a cubins load on sm_90 only)")
            raise d.error(rc, "cuModuleLoadData", remedy=remedy)
        return cls(mod.value, ctx, device_index, d)

    @property
    def handle(self) -> int:
        return self._handle or 0

    @property
    def closed(self) -> bool:
        return not self._handle

    def function(self, name: str, shared_bytes: int = 0, num_warps: int | None = None) -> "CudaFunction":
        """Look up a kernel; allow >48 KiB dynamic shared memory when ``shared_bytes`` asks for it.

        With ``num_warps`` given, also checks that ``32 * num_warps`` threads fit the kernel.
        """
        if self.closed:
            raise AotfuseError(f"cannot get function {name!r}: module is closed")
        d = self._driver
        fn = ctypes.c_void_p()
        rc = d.cuModuleGetFunction(ctypes.byref(fn), self._handle, name.encode())
        if rc != CUDA_SUCCESS:
            raise d.error(rc, f"cuModuleGetFunction({name!r})",
                          remedy="use compiled.metadata.name as the kernel name")
        handle = fn.value

        def func_attr(attr: int, what: str) -> int:
            v = ctypes.c_int()
            d.check(d.cuFuncGetAttribute(ctypes.byref(v), attr, handle), f"cuFuncGetAttribute({what})")
            return v.value

        max_threads = func_attr(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "MAX_THREADS_PER_BLOCK")
        if num_warps is not None and 32 * num_warps > max_threads:
            raise AotfuseError(f"kernel {name!r} runs at most {max_threads} threads per block, "
                               f"num_warps={num_warps} needs {32 * num_warps}")
        max_shared = DEFAULT_SHARED_LIMIT
        if shared_bytes > DEFAULT_SHARED_LIMIT:
            optin = ctypes.c_int()
            d.check(d.cuDeviceGetAttribute(ctypes.byref(optin), CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                                           self._cu_device()), "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)")
            static = func_attr(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, "SHARED_SIZE_BYTES")
            max_shared = optin.value - static
            if shared_bytes > max_shared:
                raise AotfuseError(f"kernel {name!r} needs {shared_bytes} bytes of shared memory, "
                                   f"device {self.device_index} allows {max_shared}")
            d.check(d.cuFuncSetCacheConfig(handle, CU_FUNC_CACHE_PREFER_SHARED), "cuFuncSetCacheConfig")
            d.check(d.cuFuncSetAttribute(handle, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, max_shared),
                    "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
        f = CudaFunction(handle, name, self, max_threads=max_threads, max_shared_bytes=max_shared)
        self._functions.append(f)
        return f

    def _cu_device(self) -> int:
        dev = ctypes.c_int()
        self._driver.check(self._driver.cuDeviceGet(ctypes.byref(dev), self.device_index), "cuDeviceGet")
        return dev.value

    def close(self) -> None:
        """Unload the module now (idempotent), after the device drained: a kernel of it may still be
        running. Captured CUDA graphs that use its functions must be dropped first."""
        handle = self._detach()
        if handle:
            _unload_after_drain([(handle, self._context, self.device_index, self._driver)])

    def _detach(self) -> int:
        handle, self._handle = self._handle, 0
        for f in self._functions:
            f._handle = None
        self._functions.clear()
        return handle

    def __enter__(self) -> "CudaModule":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # A finalizer may run anywhere: in another thread, or on a thread that is capturing a CUDA
        # graph, where a device sync or an unload would break the capture. Defer the unload to the
        # next load or close, which drains the device first.
        handle = getattr(self, "_handle", 0)
        if handle and not sys.is_finalizing():
            self._handle = 0
            with _GRAVEYARD_LOCK:
                _GRAVEYARD.append((handle, self._context, self.device_index, self._driver))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"0x{self._handle:x}"
        return f"CudaModule({state}, device={self.device_index})"


class CudaFunction:
    """One kernel of a loaded module. Keeps its module alive."""

    def __init__(self, handle: int, name: str, module: CudaModule | None, *, max_threads: int = 1024,
                 max_shared_bytes: int = DEFAULT_SHARED_LIMIT, drv: Driver | None = None):
        self._handle = handle
        self.name = name
        self.module = module
        self.max_threads = max_threads
        self.max_shared_bytes = max_shared_bytes
        self._driver = drv or (module._driver if module is not None else driver())
        self._launch_fn = self._driver.cuLaunchKernel_fast
        self._handle_arg = ctypes.c_void_p(handle)
        self._stream_arg = ctypes.c_void_p()  # filled per launch under the lock
        self._packs: dict[tuple[str, ...], _ArgPack] = {}
        self._lock = threading.Lock()  # ctypes drops the GIL in the call: guard the shared param buffer
        self.pdl = ""  # launched with programmatic dependent launch (enable_pdl): "all" | "kernels" | ""

    @property
    def handle(self) -> int:
        return self._handle or 0

    def _pack_for(self, arg_types: Sequence[str]) -> _ArgPack:
        key = tuple(arg_types)
        pack = self._packs.get(key)
        if pack is None:
            pack = self._packs[key] = _ArgPack(key)
        return pack

    def enable_pdl(self, after_kernels_only: bool = False) -> None:
        """Launch with programmatic dependent launch from now on (runtime/launch_pdl.py): only for a binary
        compiled with the PDL wait (contract/kernels.Binary.pdl), before any launch site is bound.
        after_kernels_only: a program's launch site whose previous GPU step is not one of the archive's
        kernels (an extern: cuBLAS, a copy) launches plainly (PreparedLaunch.after_extern)."""
        self._launch_fn = self._driver.pdl_launcher()
        self.pdl = "kernels" if after_kernels_only else "all"

    def bind(self, arg_types: Sequence[str], num_warps: int, shared_bytes: int) -> "BoundLaunch":
        """Pre-resolve everything but grid/stream/values: the fastest per-call path."""
        return BoundLaunch(self, self._pack_for(arg_types), num_warps, shared_bytes)

    def launch(self, grid: tuple[int, int, int], num_warps: int, shared_bytes: int, stream: int,
               args: Sequence[int | float], arg_types: Sequence[str], *,
               global_scratch: int = 0, profile_scratch: int = 0) -> None:
        """cuLaunchKernel(f, *grid, 32*num_warps, 1, 1, shared_bytes, stream, params, NULL).

        ``args`` are the kernel's non-constexpr arguments (device addresses as ints for "ptr"); the two
        trailing triton scratch pointers are appended (0 = null unless given).
        """
        try:
            pack = self._packs[arg_types]
        except (KeyError, TypeError):
            pack = self._pack_for(arg_types)
        self._launch(pack, grid, 32 * num_warps, shared_bytes, stream, args, global_scratch, profile_scratch)

    def _launch(self, pack: _ArgPack, grid, block_x: int, shared_bytes: int, stream: int, args,
                global_scratch: int, profile_scratch: int) -> None:
        gx, gy, gz = grid
        n = gx * gy * gz
        # One type check guards the unprototyped call (a float would be passed as a double).
        if (n + block_x + shared_bytes).__class__ is not int or n <= 0:
            if n == 0 and (block_x + shared_bytes).__class__ is int:
                return  # triton skips empty grids too
            raise AotfuseError(f"bad launch configuration for {self.name!r}: grid={tuple(grid)!r}, "
                               f"block_x={block_x!r}, shared={shared_bytes!r}",
                               remedy="grid, num_warps and shared_bytes must be non-negative Python ints")
        if self._handle is None:
            raise AotfuseError(f"cannot launch {self.name!r}: its module was closed")
        handle = self._handle_arg
        with self._lock:
            pack.fill(args, global_scratch, profile_scratch)
            stream_arg = self._stream_arg
            try:
                stream_arg.value = stream
                rc = self._launch_fn(handle, gx, gy, gz, block_x, 1, 1, shared_bytes, stream_arg, pack.params, None)
            except (ctypes.ArgumentError, TypeError, OverflowError) as e:
                raise AotfuseError(f"bad launch configuration for {self.name!r}: grid={grid!r}, "
                                   f"block_x={block_x!r}, shared={shared_bytes!r}, stream={stream!r}: {e}",
                                   remedy="pass Python ints (stream: torch.cuda.current_stream().cuda_stream)") from e
            if rc == CUDA_ERROR_INVALID_CONTEXT and self._adopt_context():
                rc = self._launch_fn(handle, gx, gy, gz, block_x, 1, 1, shared_bytes, stream_arg, pack.params, None)
        if rc != CUDA_SUCCESS:
            raise self._driver.error(
                rc, f"cuLaunchKernel({self.name!r}, grid={tuple(grid)}, block=({block_x}, 1, 1), "
                    f"shared={shared_bytes}, stream=0x{stream or 0:x})")

    def _adopt_context(self) -> bool:
        """No context current on this thread (a fresh thread): make the module's one current."""
        d = self._driver
        if self.module is None or _current_context(d):
            return False
        d.check(d.cuCtxSetCurrent(self.module._context), "cuCtxSetCurrent")
        return True

    def __repr__(self) -> str:
        return f"CudaFunction({self.name!r}, 0x{self.handle:x})"


class BoundLaunch:
    """``fn.bind(arg_types, num_warps, shared)(grid, stream, args)``: launch with everything fixed."""

    __slots__ = ("function", "pack", "block_x", "shared_bytes")

    def __init__(self, function: CudaFunction, pack: _ArgPack, num_warps: int, shared_bytes: int):
        if 32 * num_warps > function.max_threads:
            raise AotfuseError(f"kernel {function.name!r} runs at most {function.max_threads} threads "
                               f"per block, num_warps={num_warps} needs {32 * num_warps}")
        if shared_bytes > function.max_shared_bytes:
            raise AotfuseError(f"kernel {function.name!r} launched with {shared_bytes} bytes of shared "
                               f"memory but was set up for {function.max_shared_bytes}",
                               remedy="pass shared_bytes to CudaModule.function")
        self.function = function
        self.pack = pack
        self.block_x = 32 * num_warps
        self.shared_bytes = shared_bytes

    def __call__(self, grid: tuple[int, int, int], stream: int, args: Sequence[int | float], *,
                 global_scratch: int = 0, profile_scratch: int = 0) -> None:
        self.function._launch(self.pack, grid, self.block_x, self.shared_bytes, stream, args,
                              global_scratch, profile_scratch)

    def prepare(self, grid: tuple[int, int, int]) -> "PreparedLaunch":
        """A launch of this kernel with a fixed grid and a parameter buffer of its own (see PreparedLaunch)."""
        return PreparedLaunch(self, grid)


class PreparedLaunch:
    """One launch site of a linked program: grid, block and shared memory checked once, and a kernel
    parameter buffer of its own, so a caller that owns it (an executor state, whose calls are
    serialized by its lock) launches without the function's shared-buffer lock or per-call checks."""

    __slots__ = ("bound", "grid", "pack", "_stream", "_fn", "_handle", "_dims", "_empty", "global_scratch", "keep")

    def __init__(self, bound: BoundLaunch, grid: tuple[int, int, int]):
        gx, gy, gz = grid
        if not all(v.__class__ is int and v >= 0 for v in grid):
            raise AotfuseError(f"bad launch grid for {bound.function.name!r}: {tuple(grid)!r}",
                               remedy="grid dimensions must be non-negative Python ints")
        self.bound = bound
        self.grid = (gx, gy, gz)
        self.pack = _ArgPack(bound.pack.arg_types)  # its own buffer: never shared with another caller
        self._stream = ctypes.c_void_p()
        fn = bound.function
        self._fn = fn._launch_fn
        self._handle = fn._handle_arg
        self._dims = (gx, gy, gz, bound.block_x, 1, 1, bound.shared_bytes)
        self._empty = gx * gy * gz == 0
        # a kernel that needs global scratch (TMA descriptors made in the kernel): the address of this
        # launch site's own scratch, and the allocation that backs it (set by whoever allocates it)
        self.global_scratch = 0
        self.keep = None

    def launch(self, stream: int, args: Sequence[int]) -> None:
        """Launch with `args` (device addresses in argument order) on `stream`."""
        self.pack.fill(args, self.global_scratch)
        self.launch_filled(stream)

    def after_extern(self) -> None:
        """This site's previous GPU step is not one of the archive's kernels: a function that launches with
        PDL only after kernels (CudaFunction.enable_pdl) launches plainly here."""
        fn = self.bound.function
        if fn.pdl == "kernels":
            self._fn = fn._driver.cuLaunchKernel_fast

    def fill(self, args: Sequence[int]) -> None:
        """Set the arguments of every later `launch_filled` (a launch site whose addresses never change)."""
        self.pack.fill(args, self.global_scratch)

    def launch_filled(self, stream: int) -> None:
        """Launch on `stream` with the arguments last filled (by `fill` or `launch`)."""
        if self._empty:
            return
        if self.bound.function._handle is None:
            raise AotfuseError(f"cannot launch {self.bound.function.name!r}: its module was closed")
        pack = self.pack
        self._stream.value = stream
        gx, gy, gz, bx, by, bz, sh = self._dims
        rc = self._fn(self._handle, gx, gy, gz, bx, by, bz, sh, self._stream, pack.params, None)
        if rc == CUDA_ERROR_INVALID_CONTEXT and self.bound.function._adopt_context():
            rc = self._fn(self._handle, gx, gy, gz, bx, by, bz, sh, self._stream, pack.params, None)
        if rc != CUDA_SUCCESS:
            f = self.bound.function
            raise f._driver.error(rc, f"cuLaunchKernel({f.name!r}, grid={self.grid}, block=({bx}, 1, 1), "
                                      f"shared={sh}, stream=0x{stream or 0:x})")
