"""What every contract's `from_dict` shares: field-set checks and the one error they raise.

The rule for fields (see artifacts/FORMAT.md, "Adding a field"): a dataclass lists its fields in
the order they are written; a field added after a payload version was released has a default and
is written only when it differs from it (`optional` below), so archives that do not use it keep
their bytes and older archives read back with the default. A reader refuses keys it does not know:
the payload version says which ones a writer may use.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable

from ..errors import ArchiveError
from .sizes import check_size

UPGRADE = "upgrade aotfuse to read it, or rebuild the archive with this aotfuse"
DAMAGED = "the archive is damaged or was not written by this aotfuse; rebuild it"


def fields(d: Any, what: str, required: Iterable[str], optional: Iterable[str] = ()) -> dict:
    """`d` as a map with every required key and no key outside required + optional."""
    if type(d) is not dict:
        raise ArchiveError(f"{what}: expected a map, got {type(d).__name__}", remedy=DAMAGED)
    required = tuple(required)
    for k in required:
        if k not in d:
            raise ArchiveError(f"{what}: missing field {k!r}", remedy=DAMAGED)
    known = set(required) | set(optional)
    extra = sorted(str(k) for k in d if k not in known)
    if extra:
        raise ArchiveError(f"{what}: unknown field {extra[0]!r} (written by a newer aotfuse?)", remedy=UPGRADE)
    return d


@contextlib.contextmanager
def decoding(what: str):
    """Any lookup or type slip while reading `what` becomes an ArchiveError naming it."""
    try:
        yield
    except ArchiveError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise ArchiveError(f"{what} is malformed: {type(exc).__name__}: {exc}", remedy=DAMAGED) from None


def put_optional(out: dict, key: str, value: Any, default: Any = None) -> dict:
    """Write an optional field only when it is set (see the module docstring)."""
    if value != default:
        out[key] = value
    return out


def ints(xs) -> tuple[int, ...]:
    return tuple(int(x) if type(x) is int else _not(x, "an integer") for x in xs)


def strs(xs) -> tuple[str, ...]:
    return tuple(x if type(x) is str else _not(x, "a string") for x in xs)


def _not(x, what: str):
    raise TypeError(f"{x!r} is not {what}")


def size_tuple(xs, where: str = "shape") -> tuple:
    """A tuple of sizes: ints, or size expressions (program version 5, contract/sizes.py)."""
    if type(xs) not in (list, tuple):
        _not(xs, "a list of sizes")
    return tuple(check_size(x, where) for x in xs)
