"""Which captured CUDA graph serves a call, and when the outputs it wrote may be overwritten.

Pure Python over tensors, no CUDA: runtime/graphs.py captures and replays, this module decides.

- `OutputSet`: the outputs one graph writes at fixed addresses. A call hands them to the caller as
  new tensors sharing their storage (no copy); the set is free again once no tensor, view, `.grad`
  or autograd-saved tensor of the caller's refers to any of those storages (the storage's use
  count is back to what this set alone holds). Outputs of at most `copy_bytes` are cloned
  instead: a loss or a small statistic the caller keeps must not pin a set of large outputs.
- `InstanceCache`: the graphs of one (program, caller stream), each with the addresses it was
  captured for (its key) and its output set. A call replays a graph of its key whose outputs are
  free; else captures another while fewer than `limit` exist; else evicts a free graph idle for
  `2 * limit` calls, but only for a key that missed before (so addresses that drift on every call,
  or more keys cycling than fit, never make each call capture); else the call runs without a graph.
"""
from __future__ import annotations

import collections
import sys

import torch

_use_count = torch._C._storage_Use_Count  # strong references to a StorageImpl, by its address


def _distinct(storages: list) -> list:
    """One storage object per storage (outputs viewing one buffer share it)."""
    return list({s._cdata: s for s in storages}.values())


def _counts(storages: list) -> list:
    return [(_use_count(s._cdata), sys.getrefcount(s)) for s in storages]


def copy_all(dst: list, src: list) -> None:
    """One multi-tensor copy; a plain copy_ when there is one tensor (less host time)."""
    if len(dst) == 1:
        dst[0].copy_(src[0])
    elif dst:
        torch._foreach_copy_(dst, src)


class OutputSet:
    """Outputs of one graph: `outs[k]` is None where output k is handed out by the caller (an input
    passed through). Only the graph writes these tensors, and only when `held()` is false."""

    def __init__(self, outs: list, copy_bytes: int):
        self.outs = outs
        self.cloned = [k for k, t in enumerate(outs) if t is not None and t.untyped_storage().nbytes() <= copy_bytes]
        self.aliased = [k for k, t in enumerate(outs) if t is not None and k not in self.cloned]
        self.storages = _distinct([outs[k].untyped_storage() for k in self.aliased])
        self.nbytes = sum(s.nbytes() for s in self.storages)
        # measured while only this set refers to them (its tensors and storage objects); a caller's
        # tensor adds a StorageImpl reference, a caller's storage object a Python one
        self.baseline = _counts(self.storages)

    def held(self) -> bool:
        """True while the caller refers to any aliased output of the last hand-out."""
        return _counts(self.storages) != self.baseline

    def hand_out(self) -> list:
        """The outputs for the caller: aliased ones as new tensors on the set's storage, the others cloned
        (passed-through positions stay None). Call right after the replay, on its stream."""
        res = [None] * len(self.outs)
        for k in self.aliased:
            res[k] = self.outs[k].detach()  # a tensor of its own: autograd may steal it into .grad
        if self.cloned:
            src = [self.outs[k] for k in self.cloned]
            fresh = [torch.empty_like(t) for t in src]
            copy_all(fresh, src)
            for k, t in zip(self.cloned, fresh):
                res[k] = t
        return res


class InstanceCache:
    """The graphs of one (program, caller stream). Entries have `key`, `outputs` (an OutputSet) and
    `last` (the call that last used them); `choose` says what serves the next call."""

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self.entries: list = []
        self.calls = 0
        self.misses: collections.deque = collections.deque(maxlen=2 * self.limit)

    def choose(self, key: tuple):
        """("replay", entry) | ("capture", victim or None: evict it first) | ("eager", None)."""
        self.calls += 1
        for e in self.entries:
            if e.key == key and not e.outputs.held():
                e.last = self.calls
                return "replay", e
        if len(self.entries) < self.limit:
            return "capture", None
        seen = key in self.misses
        self.misses.append(key)
        idle = [e for e in self.entries if self.calls - e.last >= 2 * self.limit and not e.outputs.held()]
        if seen and idle:
            return "capture", min(idle, key=lambda e: e.last)
        return "eager", None

    def add(self, entry) -> None:
        entry.last = self.calls
        self.entries.append(entry)

    def remove(self, entry) -> None:
        self.entries.remove(entry)
