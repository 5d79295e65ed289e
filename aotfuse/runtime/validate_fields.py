"""Load-time validation, part 1: limits, and typed readers of untrusted archive fields.

Every reader returns the value when it has the type and range asked for, else raises the
ArchiveError that names where in the archive it was read (see validate.py).
"""
from __future__ import annotations

import keyword
import re

from ..errors import ArchiveError
from ..dtypes import TORCH as DTYPES

MAX_BYTES = 1 << 40  # what one program may allocate (arena + own allocations): 1 TiB, beyond any device
MAX_NUMEL = MAX_BYTES  # elements of one buffer (a bool of MAX_BYTES elements is MAX_BYTES bytes)
MAX_DIMS = 32
MAX_INSTRUCTIONS = 1 << 20
MAX_NAME = 256
INDEX_LIMIT = 2**31 - 1  # kernels index with 32-bit integers (emit/kernel_src.py refuses more)
INT32_MIN = -(2**31)  # a launch's size arguments are int32 scalars
MAX_SIZE_ARGS = 64  # int32 size parameters of one kernel (dynamic dims)
GRID_X_MAX = 2**31 - 1  # CUDA's limits on gridDim
GRID_YZ_MAX = 65535
ARENA_ALIGN = 256  # schedule/memplan.py rounds every slot to this
KERNEL_PTR_ALIGN = 16  # cubins are compiled assuming 16-byte divisible pointers (emit/compile.py)
NUM_WARPS = (1, 2, 4, 8, 16, 32)
KINDS = ("pointwise", "persistent_reduction", "looped_reduction", "template_mm", "template_attn")
MAX_BLOCK = 1 << 16
MAX_EXTERN_ARG_DEPTH = 3  # e.g. a list of ints inside the argument list; the runtime recurses on it
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ARCH = re.compile(r"sm_[0-9]{2,3}\Z")
_REMEDY = "the archive is damaged or was not written by this aotfuse; rebuild it"


def _fail(where: str, msg: str):
    raise ArchiveError(f"{where}: {msg}", remedy=_REMEDY)


# ---------------------------------------------------------------- typed field readers

def _dict(v, where: str, keys: tuple[str, ...] = ()) -> dict:
    if type(v) is not dict:
        _fail(where, f"expected a map, got {type(v).__name__}")
    for k in keys:
        if k not in v:
            _fail(where, f"missing field {k!r}")
    return v


def _list(v, where: str, lo: int = 0, hi: int = MAX_INSTRUCTIONS) -> list:
    if type(v) is not list:
        _fail(where, f"expected a list, got {type(v).__name__}")
    if not lo <= len(v) <= hi:
        _fail(where, f"expected {lo}..{hi} entries, got {len(v)}")
    return v


def _int(v, where: str, lo: int, hi: int) -> int:
    if type(v) is not int:  # bool is an int subclass: refused on purpose
        _fail(where, f"expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        _fail(where, f"{v} is outside {lo}..{hi}")
    return v


def _bool(v, where: str) -> bool:
    if type(v) is not bool:
        _fail(where, f"expected true/false, got {type(v).__name__}")
    return v


def _str(v, where: str) -> str:
    if type(v) is not str or not 0 < len(v) <= MAX_NAME:
        _fail(where, f"expected a non-empty name, got {_short(v)}")
    return v


def _ident(v, where: str) -> str:
    # kernel and argument names become Python identifiers on the CPU path (getattr, def parameters)
    if type(v) is not str or not _IDENT.match(v) or len(v) > MAX_NAME or keyword.iskeyword(v):
        _fail(where, f"expected an identifier, got {_short(v)}")
    return v


def _dtype(v, where: str) -> str:
    if type(v) is not str or v not in DTYPES:
        _fail(where, f"unknown dtype {_short(v)} (known: {', '.join(DTYPES)})")
    return v


def _torch_dtype_name(v, where: str) -> str:
    """Manifest specs write dtypes as str(torch.dtype): 'torch.float32'."""
    if type(v) is not str or not v.startswith("torch.") or v[6:] not in DTYPES:
        _fail(where, f"unknown dtype {_short(v)}")
    return v[6:]


def _shape(v, where: str) -> tuple[int, ...]:
    _list(v, where, 0, MAX_DIMS)
    n = 1
    for i, d in enumerate(v):
        n *= _int(d, f"{where}[{i}]", 0, MAX_NUMEL)
    if n > MAX_NUMEL:
        _fail(where, f"{n} elements is more than {MAX_NUMEL}")
    return tuple(v)


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a
