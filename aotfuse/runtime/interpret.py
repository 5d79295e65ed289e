"""CPU path: kernels run by Triton's interpreter from the archive's stored Triton source.

The only runtime module that imports triton. Slow; for debugging and CI. Before executing a stored
source it checks that the text has the shape aotfuse generates (imports of triton only, jit
functions only), so an archive cannot smuggle other code through this path.

Thread-safe by serialization: the interpreter works through process-wide Triton state, so kernel
launches (and loads) hold kernel_source.TRITON_STATE_LOCK; calls from several threads take turns
kernel by kernel. Each call's buffers are its own (the executor allocates them per call).
"""
from __future__ import annotations

import ast
from typing import Callable

from ..contract.kernels import PDL_PARAM
from ..errors import ArchiveError
from .kernel_source import TRITON_STATE_LOCK, load_source

_ALLOWED_IMPORTS = {"triton", "triton.language", "triton.language.extra", "triton.language.extra.cuda"}


class _InterpreterLibdevice:
    """What `libdevice.<fn>` means in a kernel run by Triton's interpreter, which cannot call CUDA's
    libdevice: the functions emit/printer.py's LIBDEVICE names, written with triton.language alone
    (evaluated on the interpreter's tensors; accurate to a few fp32 ulps, like libdevice)."""

    @staticmethod
    def expm1(x):
        # Kahan: for |x| < 0.5, (u - 1) * x / log(u) with u = exp(x) is accurate: the error in u cancels.
        import triton.language as tl

        u = tl.exp(x)
        small = tl.where(u == 1.0, x, (u - 1.0) * (x / tl.log(u)))
        return tl.where(tl.abs(x) < 0.5, small, u - 1.0)

    @staticmethod
    def tanh(x):
        # tanh|x| = -e / (e + 2) with e = expm1(-2|x|) in [-1, 0]: no overflow, no cancellation
        import triton.language as tl

        e = _InterpreterLibdevice.expm1(-2.0 * tl.abs(x))
        t = -e / (e + 2.0)
        return tl.where(x < 0, -t, t)

    @staticmethod
    def log1p(x):
        # log(u) * x / (u - 1) with u = 1 + x: the rounding error of u cancels (Goldberg)
        import triton.language as tl

        u = 1.0 + x
        return tl.where(u == 1.0, x, tl.where(u - 1.0 == u, tl.log(u), tl.log(u) * (x / (u - 1.0))))

    @staticmethod
    def pow(x, y):
        # exp2(y * log2|x|) with C pow's rules: x < 0 needs an integer y, and odd y keeps the sign
        import triton.language as tl

        r = tl.exp2(y * tl.log2(tl.abs(x)))
        r = tl.where((x < 0) & (tl.floor(y) != y), float("nan"),
                     tl.where((x < 0) & (tl.floor(y * 0.5) * 2.0 != y), -r, r))
        return tl.where((y == 0) | (x == 1), 1.0, r)


INTERPRETER_LIBDEVICE = _InterpreterLibdevice()


def check_source(name: str, source: str, params: list[str] | None = None) -> None:
    """`params`: the kernel's argument names as the kernels part records them, pointers then size
    arguments (the launch passes exactly those, so the source must take exactly those)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ArchiveError(f"kernel {name}: stored source does not parse ({exc.msg})") from None
    for stmt in tree.body:
        if isinstance(stmt, ast.Import) and all(a.name in _ALLOWED_IMPORTS for a in stmt.names):
            continue
        if isinstance(stmt, ast.ImportFrom) and stmt.module in _ALLOWED_IMPORTS:
            continue
        if isinstance(stmt, ast.FunctionDef) and len(stmt.decorator_list) == 1 and \
                ast.unparse(stmt.decorator_list[0]) == "triton.jit" and _plain_signature(stmt):
            continue
        raise ArchiveError(f"kernel {name}: stored source has an unexpected statement at line {stmt.lineno}",
                           remedy="the archive was not written by aotfuse; rebuild it")
    defs = [s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == name]
    if not defs:
        raise ArchiveError(f"kernel {name}: stored source does not define it")
    taken = [a.arg for a in defs[-1].args.args]
    if taken and taken[-1] == PDL_PARAM:  # the PDL switch, last (emit/pdl.py): not a launch argument
        taken.pop()
    if params is not None and taken != list(params):
        raise ArchiveError(f"kernel {name}: stored source takes ({', '.join(taken)}), "
                           f"the archive's launches pass ({', '.join(params)})")


def _plain_signature(fn: ast.FunctionDef) -> bool:
    # Defaults and annotations are evaluated when the `def` executes (at load, before any check of
    # the body could matter): generated kernels have none but the PDL switch's (emit/pdl.py), a last
    # argument `AOTF_PDL: tl.constexpr = False` exactly; any other is refused.
    a = fn.args
    args = list(a.args)
    if args and args[-1].arg == PDL_PARAM:
        last = args.pop()
        if not (last.annotation is not None and ast.unparse(last.annotation) == "tl.constexpr" and len(a.defaults) == 1
                and isinstance(a.defaults[0], ast.Constant) and a.defaults[0].value is False):
            return False
        defaults = ()
    else:
        defaults = a.defaults
    return not (defaults or a.kw_defaults or a.posonlyargs or a.kwonlyargs or a.vararg or a.kwarg
                or fn.returns or any(x.annotation for x in args))


_SIZE_CLS = None


def _constexpr(v: int):
    """A size as a constexpr whose arithmetic with a tensor gives the tensor: tl.constexpr's own operators wrap
    `s1 * s1 - xindex` in a constexpr, on which a kernel's `(...).to(tl.int64)` fails (the compiler, which
    sees a runtime int there, makes it a tensor)."""
    global _SIZE_CLS
    import triton.language as tl

    if _SIZE_CLS is None:
        def lift(name):
            base = getattr(tl.constexpr, name)

            def op(self, *other):
                r = base(self, *other)
                inner = r.value if isinstance(r, tl.constexpr) else r
                return inner if isinstance(inner, tl.tensor) else _SIZE_CLS(inner) if isinstance(r, tl.constexpr) else r
            return op
        names = [n for n in dir(tl.constexpr) if n.startswith("__") and n[2:-2] in _ARITH]
        _SIZE_CLS = type("_Size", (tl.constexpr,), {n: lift(n) for n in names})
    return _SIZE_CLS(v)


_ARITH = {p + n for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift",
                          "rshift") for p in ("", "r")} | {"neg", "pos", "invert", "lt", "le", "gt", "ge", "eq", "ne"}


_INDEX_PATCHED = False


def patch_interpreter_index() -> None:
    """Triton's interpreter holds a scalar (tl.program_id) as a 1-element array, and its `__index__`
    calls int() on it, which numpy 2 refuses: `tl.range(tl.program_id(0), ...)` (a persistent matmul
    template's tile loop) would not run. Patched: a 1-element array indexes as its element."""
    global _INDEX_PATCHED
    if _INDEX_PATCHED:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0])
                       if self.handle.data.size == 1 else int(self.handle.data))

    interpreter._patch_lang_tensor = patch_lang_tensor
    _INDEX_PATCHED = True


def make_launchers(kernels: dict, sources: dict[str, str]) -> dict[str, Callable]:
    import triton

    from .interpret_cast import patch_interpreter_bf16_cast
    from .interpret_dot import patch_interpreter_dot

    patch_interpreter_dot()  # tl.dot of bfloat16 tiles (matmul templates): see interpret_dot.py
    patch_interpreter_bf16_cast()  # float32 -> bfloat16 rounds to nearest even, as on the GPU
    patch_interpreter_index()  # tl.range starting at tl.program_id (persistent templates)
    launchers = {}
    # interpret=True makes `@triton.jit` in the stored source build interpreter functions; the knob
    # is process-wide, so no other thread may define or compile a kernel meanwhile.
    with TRITON_STATE_LOCK, triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        for name in kernels:
            src = sources.get(name)
            if src is None:
                raise ArchiveError(f"kernel {name} has no stored source for the CPU path")
            check_source(name, src, [a.name for a in kernels[name].args] + list(kernels[name].size_args))
            mod = load_source(name, src)
            mod.libdevice = INTERPRETER_LIBDEVICE  # the stored source imports CUDA's; not runnable here
            fn = getattr(mod, name)
            launch = _launcher(fn, triton.knobs.runtime)
            if getattr(kernels[name], "persistent", 0):
                launch = _few_programs(launch)
            launchers[name] = launch
    return launchers


# A persistent kernel (a matmul template) strides over its tiles by tl.num_programs(0); on the GPU it runs
# one program per SM. The CPU path launches at most this many, so the tile loop runs several times per
# program there too (as it does on every GPU), not once per tile.
CPU_PERSISTENT_PROGRAMS = 3


def _few_programs(launch: Callable) -> Callable:
    def run(grid, stream, tensors):
        launch((min(grid[0], CPU_PERSISTENT_PROGRAMS), grid[1], grid[2]), stream, tensors)
    return run


def _launcher(fn, runtime_knobs) -> Callable:
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    interpreted: dict = {}

    def call_python(self, *args, **kwargs):
        f = interpreted.get(id(self))
        if f is None:
            f = interpreted[id(self)] = interpreter.InterpretedFunction(self.fn)
        # InterpretedFunction.__call__ patches triton.language for the interpreter and never restores
        # it, which breaks every later cubin compile in this process: patch and restore ourselves.
        scope = interpreter._patch_lang(f.fn)
        try:
            return f.rewrite()(*args, **kwargs)
        finally:
            scope.restore()

    def launch(grid, stream, tensors):  # stream: unused on the CPU; tensors: buffers, then int32 sizes
        if not grid[0] * grid[1] * grid[2]:
            return  # an empty grid (a dynamic dim at 0) runs nothing, as on the GPU
        # One launch at a time in the process: everything below patches globals (triton.language,
        # JITFunction.__call__, the interpret knob) and the interpreter runs the grid through one
        # global builder. Unserialized, a second thread's launch restores the originals under a
        # running kernel ("Cannot call @triton.jit'd outside of the scope of a kernel") or leaves
        # the patches in place for good. Only launches take turns: a call's externs run unlocked.
        with TRITON_STATE_LOCK:
            # triton.language's helpers (tl.sum, tl.max, ...) were decorated as compiled JIT functions
            # when triton was imported without TRITON_INTERPRET; inside an interpreted kernel they
            # must run as plain Python, which is what the interpreter does for them when the env var
            # is set.
            saved = JITFunction.__call__
            JITFunction.__call__ = call_python
            try:
                with runtime_knobs.scope():
                    runtime_knobs.interpret = True
                    # sizes as constexpr values: the interpreter would make an int a 1-element tensor,
                    # which `range(0, s0, RBLOCK)` cannot take (numpy 2 refuses its __index__)
                    fn[tuple(grid)](*[_constexpr(a) if type(a) is int else a for a in tensors])
            finally:
                JITFunction.__call__ = saved
    return launch
