"""Size expressions: how a program or kernel table written for dynamic dims spells a size.

A size ("SizeExpr") is an `int`, or a `str` holding a Python-syntax integer expression over dim
symbols `s0`, `s1`, ... (declared in the manifest's `dims`) with integer literals, `+ - * // %`,
unary minus, parentheses and the calls `max(a, b, ...)`, `min(a, b, ...)` and `cdiv(a, b)`
(ceil division). `//` and `%` floor, as Python's do (sympy's FloorDiv and Mod agree on the
non-negative sizes a build writes). Nothing else parses: no attributes, subscripts, floats,
comparisons, other names or calls, so an archive's expression is data, never code.

An expression is parsed once (`ast`, against the whitelist), then compiled to a code object that
`eval` runs with the dims as its only names: cached per string, so evaluating a program's few
hundred sizes for a new shape costs a dict lookup and a small eval each.

Stdlib only, like the rest of aotfuse.contract: the runtime reads this without torch or sympy.
"""
from __future__ import annotations

import ast
import functools
import re
from typing import Callable, Mapping, Union

from ..errors import ArchiveError

SizeExpr = Union[int, str]

SYMBOL = re.compile(r"s[0-9]+\Z")
MAX_EXPR_CHARS = 1024  # a build's sizes are short; this bounds parse time and eval depth
MAX_DEPTH = 200  # nested operations: far beyond a build's sizes, well within Python's recursion limit
MAX_LITERAL = 1 << 62  # literals beyond any size a program may name (validate_fields.MAX_BYTES is 2**40)
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)
_CALLS = {"max": (1, 64), "min": (1, 64), "cdiv": (2, 2)}  # name -> (fewest, most) arguments
_REMEDY = ("the archive is damaged or was not written by this aotfuse; rebuild it (a size is an int or an "
           "expression over s0, s1, ... with + - * // %, max, min, cdiv)")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# eval's globals: no builtins at all, only the three functions an expression may call
_GLOBALS = {"__builtins__": {}, "max": max, "min": min, "cdiv": _cdiv}


def check_size(v, where: str = "size") -> SizeExpr:
    """`v` if it is an int (not a bool) or a well-formed size expression, else the ArchiveError that
    says where and why."""
    if type(v) is int:
        return v
    if type(v) is str:
        _parse(v, where)
        return v
    raise ArchiveError(f"{where}: expected an integer or a size expression, got {type(v).__name__} {_short(v)}",
                       remedy=_REMEDY)


def is_expr(v) -> bool:
    """Whether `v` is an expression (a str), as opposed to a static int."""
    return type(v) is str


def compile_size(v: SizeExpr) -> Callable[[Mapping[str, int]], int]:
    """A function of the dims' values (env: symbol -> int) giving the size; cached per expression."""
    if type(v) is int:
        return lambda env, _v=v: _v
    return _compiled(check_size(v))


def evaluate(v: SizeExpr, env: Mapping[str, int]) -> int:
    """The size's value for the dims in `env` (an int stays itself)."""
    if type(v) is int:
        return v
    return _compiled(check_size(v))(env)


def free_dims(v: SizeExpr) -> frozenset[str]:
    """The dim symbols an expression names (none for an int)."""
    if type(v) is int:
        return frozenset()
    return _parse(v, "size")[1]


# ---------------------------------------------------------------- parsing

@functools.lru_cache(maxsize=1 << 16)
def _parse_cached(text: str) -> tuple[ast.Expression | None, frozenset[str], str]:
    """(tree, names, "") when well-formed, else (None, frozenset(), why): cached per string, with
    refusals cached too (a malformed archive names the same expression many times)."""
    if not text or len(text) > MAX_EXPR_CHARS:
        return None, frozenset(), f"is {len(text)} characters (1..{MAX_EXPR_CHARS})"
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        return None, frozenset(), f"does not parse ({exc.msg})"
    except (RecursionError, MemoryError):
        return None, frozenset(), "is nested too deeply"
    names: set[str] = set()
    why = _check_node(tree.body, names, 0)
    return (None, frozenset(), why) if why else (tree, frozenset(names), "")


def _parse(text: str, where: str) -> tuple[ast.Expression, frozenset[str]]:
    tree, names, why = _parse_cached(text)
    if tree is None:
        raise ArchiveError(f"{where}: size expression {_short(text)} {why}", remedy=_REMEDY)
    return tree, names


def _check_node(n: ast.AST, names: set[str], depth: int) -> str:
    """'' when `n` is an allowed expression node (recursively), else why not."""
    if depth > MAX_DEPTH:
        return f"is nested too deeply (more than {MAX_DEPTH} levels)"
    depth += 1
    if isinstance(n, ast.Constant):
        if type(n.value) is not int:
            return f"has a {type(n.value).__name__} literal {n.value!r:.20}; only integers are allowed"
        if not 0 <= n.value <= MAX_LITERAL:
            return f"has literal {n.value} outside 0..2**62"
        return ""
    if isinstance(n, ast.Name):
        if not SYMBOL.match(n.id):
            return f"names {n.id!r}; only dim symbols s0, s1, ... are allowed"
        names.add(n.id)
        return ""
    if isinstance(n, ast.BinOp):
        if not isinstance(n.op, _BINOPS):
            return f"uses operator {type(n.op).__name__}; only + - * // % are allowed"
        return _check_node(n.left, names, depth) or _check_node(n.right, names, depth)
    if isinstance(n, ast.UnaryOp):
        if not isinstance(n.op, ast.USub):
            return f"uses unary {type(n.op).__name__}; only unary minus is allowed"
        return _check_node(n.operand, names, depth)
    if isinstance(n, ast.Call):
        fname = n.func.id if isinstance(n.func, ast.Name) else None
        if fname not in _CALLS or n.keywords:
            return f"calls {ast.unparse(n.func)!r:.40}; only max(...), min(...) and cdiv(a, b) are allowed"
        lo, hi = _CALLS[fname]
        if not lo <= len(n.args) <= hi or any(isinstance(a, ast.Starred) for a in n.args):
            return f"calls {fname} with {len(n.args)} arguments ({lo}..{hi})"
        for a in n.args:
            why = _check_node(a, names, depth)
            if why:
                return why
        return ""
    return f"contains a {type(n).__name__} node; only integers, dim symbols, + - * // %, max, min and cdiv are allowed"


@functools.lru_cache(maxsize=1 << 16)
def _compiled(text: str) -> Callable[[Mapping[str, int]], int]:
    tree, _names = _parse(text, "size")
    code = compile(tree, f"<size {text[:40]}>", "eval")

    def size(env: Mapping[str, int]) -> int:
        try:
            return eval(code, _GLOBALS, env)  # noqa: S307 - a whitelisted AST: dims, ints, + - * // %, 3 calls
        except NameError as exc:
            raise ArchiveError(f"size expression {text!r} names a dim that is not bound ({exc})",
                               remedy="every dim a program uses must be declared in the manifest's dims") from None
        except ZeroDivisionError:
            vals = ", ".join(f"{k}={env[k]}" for k in sorted(_names) if k in env)
            raise ArchiveError(f"size expression {text!r} divides by zero at {vals}",
                               remedy="the archive's sizes are wrong for these dims; rebuild it") from None
    return size


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
