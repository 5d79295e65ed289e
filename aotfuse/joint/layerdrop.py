"""LayerDrop-style checks in the training trace: `torch.rand([]) < p` decided where its range decides it.

Hugging Face encoders and decoders (Whisper, Wav2Vec2, BART, ...) skip a layer at random in training:

    dropout_probability = torch.rand([])
    if self.training and dropout_probability < self.layerdrop:  # skip the layer

A traced program cannot branch on the drawn value, so the trace stopped there (a data-dependent read)
even with `layerdrop = 0.0`, where the branch is never taken: `torch.rand` draws from [0, 1). This mode
tracks the tensors `torch.rand` returns and answers a comparison of one with a Python number when the
range alone decides it (`x < c` is False for every c <= 0 and True for every c >= 1, and so on), as a
constant the trace can branch on. The draw itself is then dead code: eager advances the RNG for it and the
packaged program does not, which changes no value the model computes (no other random op's numbers are
the same across backends anyway). A comparison the range does not decide (a layerdrop of 0.1) is left to
torch, and the trace still stops naming the model's line.
"""
from __future__ import annotations

import operator
import weakref

import torch
from torch.overrides import TorchFunctionMode

_CMP = {
    "lt": lambda c: False if c <= 0 else (True if c >= 1 else None),
    "le": lambda c: False if c < 0 else (True if c >= 1 else None),
    "gt": lambda c: True if c < 0 else (False if c >= 1 else None),
    "ge": lambda c: True if c <= 0 else (False if c >= 1 else None),
}
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}
_FUNCS = {}
for _op in _CMP:
    for _f in (getattr(torch, _op), getattr(torch.Tensor, _op), getattr(torch.Tensor, f"__{_op}__"),
               getattr(operator, _op)):
        _FUNCS[_f] = _op


def decide(op: str, c: float) -> bool | None:
    """The value of `u <op> c` for every u in [0, 1), or None when it depends on u."""
    return _CMP[op](float(c))


class uniform_compare_mode(TorchFunctionMode):
    """Tracks torch.rand's results; decides comparisons of them with numbers by their range. `decided` counts
    the comparisons it answered."""

    def __init__(self):
        super().__init__()
        self._uniform: dict[int, weakref.ref] = {}  # id -> the tensor (by identity: a WeakSet would call __eq__)
        self.decided = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _FUNCS.get(func)
        if op is not None and len(args) == 2 and not kwargs:
            a, b = args
            if self._is_uniform(a) and _number(b):
                hit = self._decided(a, op, b)
            elif self._is_uniform(b) and _number(a):
                hit = self._decided(b, _FLIP[op], a)
            else:
                hit = None
            if hit is not None:
                return hit
        out = func(*args, **kwargs)
        if func is torch.rand and isinstance(out, torch.Tensor) and "out" not in kwargs:
            self._uniform[id(out)] = weakref.ref(out)
        return out

    def _is_uniform(self, t) -> bool:
        ref = self._uniform.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    def _decided(self, u: torch.Tensor, op: str, c) -> torch.Tensor | None:
        value = decide(op, c)
        if value is None:
            return None
        self.decided += 1
        if u.dim() == 0:
            # a literal: the trace keeps its value, so `if` on it needs no data
            return torch.tensor(value, device=u.device)
        return torch.full(u.shape, value, dtype=torch.bool, device=u.device)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
