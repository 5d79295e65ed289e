"""Kernel launches with programmatic dependent launch (PDL), through ``cuLaunchKernelEx``.

A binary compiled with the PDL wait (emit/pdl.py, contract/kernels.Binary.pdl) may be launched with
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``: its programs may start once the kernel
before it on the stream has released them (or exited), and wait in ``griddepcontrol.wait`` until
that kernel has completed. A CUDA graph captured from such launches keeps the programmatic edges.
Only binaries with the wait may be launched so: a kernel without it could read its predecessor's
output before it is written.

`PdlLauncher` has the call signature of ``cuLaunchKernel`` (what CudaFunction, BoundLaunch and
PreparedLaunch call), so a function switches to it without its launch sites changing. Its launch
configuration is per thread: concurrent launches of one function from several threads (each with
its own parameter buffer) never share one.
"""
from __future__ import annotations

import ctypes
import threading

from aotfuse.errors import AotfuseError

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # cuda.h: CUlaunchAttributeID


class LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte union of values."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


assert ctypes.sizeof(LaunchAttribute) == 72 and ctypes.sizeof(LaunchConfig) == 56


def _pdl_attribute() -> LaunchAttribute:
    a = LaunchAttribute()
    a.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    a.value = (1).to_bytes(4, "little")  # programmaticStreamSerializationAllowed = 1
    return a


class PdlLauncher:
    """``cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)`` done as
    ``cuLaunchKernelEx`` with programmatic stream serialization allowed."""

    __slots__ = ("_fn", "_attr", "_local")

    def __init__(self, lib):
        try:
            fn = lib["cuLaunchKernelEx"]
        except (AttributeError, KeyError) as e:
            raise AotfuseError("the CUDA driver lacks cuLaunchKernelEx, which programmatic dependent launch needs",
                               remedy="install an NVIDIA driver for CUDA 12 or newer, or set AOTFUSE_PDL_LAUNCH=off") from e
        fn.restype = ctypes.c_int
        fn.argtypes = (ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        self._fn = fn
        self._attr = _pdl_attribute()
        self._local = threading.local()

    def _config(self) -> LaunchConfig:
        cfg = getattr(self._local, "cfg", None)
        if cfg is None:
            cfg = self._local.cfg = LaunchConfig()
            cfg.attrs = ctypes.pointer(self._attr)
            cfg.numAttrs = 1
        return cfg

    def __call__(self, handle, gx, gy, gz, bx, by, bz, shared, stream, params, extra) -> int:
        cfg = self._config()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = gx, gy, gz
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = bx, by, bz
        cfg.sharedMemBytes = shared
        cfg.hStream = stream.value if isinstance(stream, ctypes.c_void_p) else stream
        h = handle.value if isinstance(handle, ctypes.c_void_p) else handle
        return self._fn(ctypes.byref(cfg), h, params, extra)
