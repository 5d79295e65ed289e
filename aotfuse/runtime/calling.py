"""A model-style call of an archive: keyword inputs in, the model's output structure out.

The manifest's `call` (aotfuse/contract/manifest.py; FORMAT.md) records how the program's flat
inputs and outputs map to the model's call: `inputs = {positional: n, keywords: [name, ...]}` (the
n positional tensors, then the keyword tensors in this order) and `outputs`, a tree whose leaves
are the program's outputs in order. `flatten` turns `(args, kwargs)` into the flat inputs, refusing
a missing or unknown keyword by name (all inputs passed positionally, in program order, are accepted
as they are); `rebuild` turns the flat outputs into the tree: tuples and
lists as such, dicts as dicts. A dict node names the model's output class (a transformers
ModelOutput, say): when that class's module is already imported and the class is a dict subclass,
the result is an instance of it (so `out.loss`, `out.logits` work as with the model); the runtime
never imports a module for it. Archives written before `call` existed take positional tensors and
return a tensor or a tuple, as they always did.
"""
from __future__ import annotations

import sys
from typing import Any, Iterator, Sequence

from ..errors import GuardError


def flatten(call: dict | None, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
    """The program's flat inputs for a call `model(*args, **kwargs)`."""
    if call is None:
        if kwargs:
            raise GuardError(f"this archive takes positional inputs only; got keyword inputs {sorted(kwargs)}",
                             remedy="build it with example_kwargs= to call it with keywords")
        return tuple(args)
    n, names = call["inputs"]["positional"], list(call["inputs"]["keywords"])
    if not kwargs and (not names or len(args) == n + len(names)):
        # positional only, or every input flat in program order (as `Artifact.run` takes them):
        # the input guards check the count, naming the inputs
        return tuple(args)
    if len(args) != n:
        how = f"and keywords {', '.join(names)}" if names else "and no keywords"
        raise GuardError(f"expected {n} positional input(s) {how}, got {len(args)} positional",
                         remedy="call the archive as the model was called at build time"
                                + (f": pass {', '.join(names)} by keyword" if names else ""))
    consts = call["inputs"].get("constants", {})
    missing = [k for k in names if k not in kwargs]
    unknown = [k for k in kwargs if k not in names and k not in consts]
    if missing or unknown:
        parts = ([f"missing keyword input(s) {', '.join(missing)}"] if missing else []) + \
                ([f"unknown keyword input(s) {', '.join(unknown)}"] if unknown else [])
        baked = f"; the constants {', '.join(f'{k}={v!r}' for k, v in consts.items())} were baked in" if consts else ""
        raise GuardError("; ".join(parts), remedy=f"this archive takes the keywords {', '.join(names) or '(none)'}"
                         + baked)
    for k, v in kwargs.items():
        # a keyword constant of the build (return_loss=True, output_hidden_states=False) may be passed again,
        # with the value it was built with: the program computes that value's call, and no other
        if k in consts and not _same_constant(v, consts[k]):
            raise GuardError(f"keyword {k}={v!r}, but the archive was built with {k}={consts[k]!r}, baked into "
                             "its program", remedy=f"pass {k}={consts[k]!r} or leave it out, or build an archive "
                             f"with {k}={v!r}")
    return tuple(args) + tuple(kwargs[k] for k in names)


def plain_constant(v: Any) -> Any:
    """A keyword constant as plain data (what the manifest records): a bool stays a bool, other int, float and
    str subclasses (an IntEnum, numpy's float64) become the plain type; None as is."""
    if v is None or type(v) in (bool, int, float, str):  # bool has no subclasses
        return v
    for t in (int, float, str):
        if isinstance(v, t):
            return t(v)
    return v


def _same_constant(v: Any, built: Any) -> bool:
    """Is `v` the build's constant `built`: the same plain type (True is not 1, 1.0 is not 1) and value; floats
    by their bits' meaning (NaN is NaN, -0.0 is not 0.0)."""
    v = plain_constant(v)
    if type(v) is not type(built):
        return False
    if type(v) is float:
        return v.hex() == built.hex()
    return v == built


def rebuild(tree: dict, outputs: Sequence[Any]) -> Any:
    """The flat outputs as the model's output structure (see the module docstring)."""
    it = iter(outputs)
    out = _node(tree, it)
    rest = sum(1 for _ in it)
    if rest:
        raise GuardError(f"the program returned {rest} more output(s) than the archive's output structure has",
                         remedy="the archive is inconsistent; rebuild it")
    return out


def _node(tree: dict, it: Iterator) -> Any:
    kind = tree["kind"]
    if kind == "tensor":
        try:
            return next(it)
        except StopIteration:
            raise GuardError("the program returned fewer outputs than the archive's output structure has",
                             remedy="the archive is inconsistent; rebuild it") from None
    if kind in ("tuple", "list"):
        items = [_node(t, it) for t in tree["items"]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        d = {k: _node(t, it) for k, t in zip(tree["keys"], tree["items"])}
        cls = _loaded_dict_class(tree.get("class", ""))
        if cls is None:
            return d
        if issubclass(cls, tuple) and not hasattr(cls, "_fields"):  # a structseq (torch.return_types.*)
            return cls(tuple(d.values()))
        return cls(**d)
    raise GuardError(f"unknown output node kind {kind!r} in the archive's output structure",
                     remedy="upgrade aotfuse, or rebuild the archive with this one")


def _loaded_dict_class(qualname: str):
    module, _, name = qualname.rpartition(".")
    mod = sys.modules.get(module)  # never imported here: only a class the process already has
    cls = getattr(mod, name, None) if mod is not None and "." not in name else None
    if not isinstance(cls, type) or cls in (dict, tuple):
        return None
    if issubclass(cls, dict):
        return cls
    # a namedtuple or structseq whose fields are the recorded keys (else the equivalent dict)
    fields = getattr(cls, "_fields", None) or getattr(cls, "__match_args__", None)
    return cls if issubclass(cls, tuple) and fields else None


def loss_tree(call: dict | None) -> dict | None:
    """A train archive's forward returns the loss only: the output structure it is rebuilt into
    (the model's class with just `loss`, if the model returned a dict or ModelOutput), or None
    (the model returned the loss tensor itself)."""
    if call is None or call["outputs"]["kind"] != "dict":
        return None
    tree = call["outputs"]
    leaf, name, seen = call.get("loss_leaf", 0), "loss", 0
    for key, item in zip(tree["keys"], tree["items"]):  # the top-level field holding that leaf
        n = _leaves(item)
        if seen <= leaf < seen + n:
            name = key
            break
        seen += n
    return {"kind": "dict", "class": tree.get("class", ""), "keys": [name], "items": [{"kind": "tensor"}]}


def _leaves(tree: dict) -> int:
    return 1 if tree["kind"] == "tensor" else sum(_leaves(t) for t in tree.get("items", ()))
