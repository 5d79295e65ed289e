"""Model specs and random inputs: how the CLI names a model and feeds an artifact.

A model spec is `package.module:factory` or `package.module:factory(key=value, ...)`. The factory
returns `(model, example_inputs)`. Keyword values are Python literals read with
`ast.literal_eval`, one value at a time; nothing in a spec is ever evaluated as code. The one
extension: a value may name a torch dtype (`dtype=torch.bfloat16`, or `dtype="bf16"` for a
keyword called `dtype`), resolved by lookup, not by evaluation.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import re
from typing import Any, Callable, Sequence

import torch

from aotfuse.contract import InputSpec
from aotfuse.dtypes import FLOATS, TORCH, TRITON, input_kind
from aotfuse.errors import AotfuseError

__all__ = ["ModelSpec", "parse_spec", "load_spec", "default_artifact_name", "random_inputs", "parse_dtype",
           "spec_dict"]

_SPEC_FORMS = "expected 'package.module:factory' or 'package.module:factory(key=value, ...)'"
_FACTORY_RE = re.compile(r"^([A-Za-z_]\w*)\s*(?:\((.*)\))?$", re.DOTALL)
# Triton's short names ('bf16') are accepted too; 'float', 'half', 'double' are torch attributes already.
_DTYPE_ALIASES = {TRITON[n]: TORCH[n] for n in FLOATS}


class ModelSpec:
    """A parsed spec: module path, factory name and keyword arguments (already literal values)."""

    __slots__ = ("module", "factory", "kwargs")

    def __init__(self, module: str, factory: str, kwargs: dict[str, Any]):
        self.module, self.factory, self.kwargs = module, factory, dict(kwargs)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.module}:{self.factory}" + (f"({args})" if self.kwargs else "")


def parse_dtype(value: Any) -> torch.dtype:
    """A torch dtype from a dtype, 'torch.float32', 'float32' or a short alias ('bf16')."""
    if isinstance(value, torch.dtype):
        return value
    name = str(value).strip()
    name = name[len("torch."):] if name.startswith("torch.") else name
    dtype = _DTYPE_ALIASES.get(name, getattr(torch, name, None))
    if not isinstance(dtype, torch.dtype):
        raise AotfuseError(f"unknown dtype {value!r}", remedy="use a torch dtype name such as 'float32' or 'bfloat16'")
    return dtype


def _literal(key: str, node: ast.expr, spec: str) -> Any:
    # `torch.<dtype>` is resolved by name; everything else must be a plain literal.
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
        return parse_dtype(node.attr)
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
        raise AotfuseError(
            f"bad value for {key!r} in model spec {spec!r}: {ast.unparse(node)!r} is not a Python literal",
            remedy="use numbers, strings, booleans, None, tuples, lists or dicts",
        ) from e
    return parse_dtype(value) if key == "dtype" and isinstance(value, str) else value


def _parse_kwargs(text: str, spec: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    try:
        call = ast.parse(f"_({text})", mode="eval").body
    except SyntaxError as e:
        raise AotfuseError(f"cannot parse the arguments of model spec {spec!r}: {e.msg}", remedy=_SPEC_FORMS) from e
    assert isinstance(call, ast.Call)
    if call.args or any(kw.arg is None for kw in call.keywords):
        raise AotfuseError(f"model spec {spec!r} passes positional or ** arguments",
                           remedy="pass factory arguments as key=value")
    return {kw.arg: _literal(kw.arg, kw.value, spec) for kw in call.keywords}


def parse_spec(spec: str) -> ModelSpec:
    """Split a spec into module, factory and literal keyword arguments; nothing is imported."""
    module, sep, rest = spec.strip().partition(":")
    if not sep or not module or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", module):
        raise AotfuseError(f"bad model spec {spec!r}", remedy=_SPEC_FORMS)
    m = _FACTORY_RE.match(rest.strip())
    if m is None:
        raise AotfuseError(f"bad factory in model spec {spec!r}", remedy=_SPEC_FORMS)
    return ModelSpec(module, m.group(1), _parse_kwargs(m.group(2) or "", spec))


def _import(module: str, spec: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        # Only a missing spec module (or a parent package) is the user's typo; a missing
        # dependency inside it is reported as an import failure below.
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            raise AotfuseError(f"no module named {module!r} (from model spec {spec!r})",
                               remedy="check the spelling and that the package is importable (pip install -e .)") from e
        raise AotfuseError(f"importing {module!r} failed: {type(e).__name__}: {e}") from e
    except Exception as e:
        raise AotfuseError(f"importing {module!r} failed: {type(e).__name__}: {e}") from e


def _factories(mod) -> list[str]:
    return sorted(n for n, v in vars(mod).items()
                  if not n.startswith("_") and inspect.isfunction(v) and v.__module__ == mod.__name__)


def _factory(spec: ModelSpec, text: str) -> Callable[..., Any]:
    mod = _import(spec.module, text)
    fn = getattr(mod, spec.factory, None)
    if not callable(fn):
        known = ", ".join(_factories(mod)) or "none"
        raise AotfuseError(f"module {spec.module!r} has no factory {spec.factory!r}", remedy=f"factories there: {known}")
    return fn


def accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn` takes a keyword argument `name` (used for --batch)."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def _check_result(result: Any, text: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    bad = f"factory of model spec {text!r} must return (model, example_inputs)"
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise AotfuseError(f"{bad}, got {type(result).__name__}")
    model, inputs = result
    if not isinstance(model, torch.nn.Module):
        raise AotfuseError(f"{bad}, but the model is a {type(model).__name__}, not an nn.Module")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise AotfuseError(f"{bad}, with example_inputs a tuple of tensors; got {type(inputs).__name__}")
    return model, tuple(inputs)


def load_spec(spec: str, **overrides: Any) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """Import the spec's factory and call it: `(model, example_inputs)`.

    `overrides` are keyword arguments that win over the spec's own (the CLI's --batch)."""
    parsed = parse_spec(spec)
    fn = _factory(parsed, spec)
    kwargs = {**parsed.kwargs, **overrides}
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as e:
        raise AotfuseError(f"factory {parsed.module}:{parsed.factory} cannot take {sorted(kwargs)}: {e}",
                           remedy=f"its signature is {parsed.factory}{inspect.signature(fn)}") from e
    return _check_result(fn(**kwargs), spec)


def factory_of(spec: str) -> Callable[..., Any]:
    """The factory a spec names, imported but not called."""
    return _factory(parse_spec(spec), spec)


def default_artifact_name(spec: str) -> str:
    """`artifacts/<factory>.aotf`: the demo spec gives artifacts/demo.aotf."""
    return f"artifacts/{parse_spec(spec).factory}.aotf"


# ---------------------------------------------------------------------------------------------
# Random inputs that satisfy an artifact's guards.

def _kind(spec: dict[str, Any], dtype: torch.dtype) -> str:
    kind = spec.get("kind")
    if kind is None:
        kind = input_kind(dtype)
    if kind not in ("float", "int", "bool"):
        raise AotfuseError(f"input {spec.get('name')!r} has unknown kind {kind!r}", remedy="expected float, int or bool")
    return kind


def _shape(spec: dict[str, Any]) -> tuple[int, ...]:
    shape = spec.get("shape")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise AotfuseError(f"input {spec.get('name')!r} has no concrete shape: {shape!r}",
                           remedy="random inputs need static shapes (pass dims= for a dynamic archive's)")
    return tuple(shape)


def _spec_range(spec: dict[str, Any]) -> tuple[int, int]:
    # Without a recorded range, [0, 2) keeps index-like inputs in bounds and not all zeros.
    low = 0 if spec.get("low") is None else int(spec["low"])
    high = low + 2 if spec.get("high") is None else int(spec["high"])
    if high <= low:
        raise AotfuseError(f"input {spec.get('name')!r} has an empty range [{low}, {high})")
    return low, high


def spec_dict(spec: InputSpec | dict[str, Any]) -> dict[str, Any]:
    """An input spec as a map: an artifact's `InputSpec` (aotfuse.contract), or a hand-written dict."""
    return spec.to_dict() if isinstance(spec, InputSpec) else spec


def random_input(spec: InputSpec | dict[str, Any], *, device: str | torch.device = "cpu",
                 generator: torch.Generator, dims: dict[str, int] | None = None) -> torch.Tensor:
    """One tensor for one input spec. Drawn on the CPU so a seed gives the same values anywhere.
    dims: values of a dynamic archive's dims ({"s0": 4}) for the spec's symbolic sizes."""
    spec = spec_dict(spec)
    if dims:
        spec = {**spec, "shape": [d if isinstance(d, int) else dims.get(d, d) for d in spec.get("shape") or ()]}
    dtype, shape = parse_dtype(spec.get("dtype", "float32")), _shape(spec)
    kind = _kind(spec, dtype)
    if kind == "float":
        t = torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
    elif kind == "bool":
        t = torch.randint(0, 2, shape, generator=generator).bool()
    else:
        low, high = _spec_range(spec)
        t = torch.randint(low, high, shape, generator=generator, dtype=torch.int64).to(dtype)
    if spec.get("stride") is not None:  # the layout the archive reads in place (channels-last)
        order = sorted(range(len(shape)), key=lambda d: (-int(spec["stride"][d]), d))
        t = t.permute(order).contiguous().permute([order.index(d) for d in range(len(shape))])
    return t.to(device)


def random_inputs(input_specs: Sequence[InputSpec | dict[str, Any]], *, device: str | torch.device = "cpu",
                  seed: int = 0, dims: dict[str, int] | None = None) -> tuple[torch.Tensor, ...]:
    """Fresh random inputs satisfying `input_specs` (an artifact's `input_specs`), a dynamic archive's
    dims at `dims` (e.g. `runtime.dims.dims_env(art.dims)`: the build's example sizes).

    Floats are standard normal, ints uniform in [low, high), bools fair coins; fixed by `seed`."""
    g = torch.Generator().manual_seed(seed)
    return tuple(random_input(s, device=device, generator=g, dims=dims) for s in input_specs)


def input_specs_of(inputs: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    """Input specs of example tensors (no ranges): to compare with an artifact's."""
    return [{"name": f"arg{i}", "shape": list(t.shape), "dtype": str(t.dtype)} for i, t in enumerate(inputs)]
