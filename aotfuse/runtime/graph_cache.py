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
- `PoolChain`: graphs captured one after another into one memory pool (a staged backward's programs on
  one stream, in stage order: graphs.py). A graph may replay only while no graph captured after it in
  the pool has its outputs held (`PoolChains.held_after`): the allocator may have given the blocks an
  earlier capture freed (its scratch, which its replay writes again) to a later capture's outputs.
"""
from __future__ import annotations

import collections
import sys
import threading

import torch

_use_count = torch._C._storage_Use_Count  # strong references to a StorageImpl, by its address


def _distinct(storages: list) -> list:
    """One storage object per storage (outputs viewing one buffer share it)."""
    return list({s._cdata: s for s in storages}.values())


def _counts(storages: list) -> list:
    return [(_use_count(s._cdata), sys.getrefcount(s)) for s in storages]


def copy_all(dst: list, src: list) -> None:
    """One multi-tensor copy per (dtype, device) of the pairs; a plain copy_ for a group of one (less host
    time). Grouped because torch._foreach_copy_ takes its one-kernel path only for tensors of one dtype: a
    list that mixed float32 statistics with int64 counters fell back to a copy per tensor (ResNet-18's
    training step: 83 copies of about 1.2 us of GPU time each, H100, scripts/copy_sources.py)."""
    if len(dst) == 1:
        dst[0].copy_(src[0])
        return
    groups: dict = {}
    for d, s in zip(dst, src):
        groups.setdefault((d.dtype, s.dtype, d.device), ([], []))
        groups[d.dtype, s.dtype, d.device][0].append(d)
        groups[d.dtype, s.dtype, d.device][1].append(s)
    for ds, ss in groups.values():
        if len(ds) == 1:
            ds[0].copy_(ss[0])
        else:
            torch._foreach_copy_(ds, ss)


class OutputSet:
    """Outputs of one graph: `outs[k]` is None where output k is handed out by the caller (an input
    passed through). Only the graph writes these tensors, and only when `held()` is false."""

    def __init__(self, outs: list, copy_bytes: int, alias_small: frozenset = frozenset()):
        """alias_small: outputs handed out on the set's buffers however small (a backward's gradients: the
        large ones hold the set anyway, and cloning forty bias gradients cost a training step more host
        time than its graph replays)."""
        self.outs = outs
        self.cloned = [k for k, t in enumerate(outs) if t is not None and k not in alias_small
                       and t.untyped_storage().nbytes() <= copy_bytes]
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

    def __init__(self, limit: int, blocked=None):
        """blocked(entry): whether a graph whose outputs are free still must not replay (graphs sharing a
        memory pool: PoolChains.held_after)."""
        self.limit = max(1, limit)
        self.blocked = blocked
        self.entries: list = []
        self.calls = 0
        self.misses: collections.deque = collections.deque(maxlen=2 * self.limit)

    def choose(self, key: tuple):
        """("replay", entry) | ("capture", victim or None: evict it first) | ("eager", None)."""
        self.calls += 1
        for e in self.entries:
            if e.key == key and not e.outputs.held() and not (self.blocked is not None and self.blocked(e)):
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



class PoolChain:
    """Graphs captured into one memory pool, in capture order (`members`: entries with `outputs` and `order`).

    Why sharing is safe under `PoolChains.held_after`: a replay writes its outputs (allocated to it for its
    lifetime, so no other capture got them), the caller-stream state (arena, static inputs: ordered on the
    stream) and its scratch: the blocks its capture allocated and freed. Only captures allocate from the
    pool, so a scratch block can since have gone to a later member only, as scratch (dead between replays;
    replays on one stream never overlap) or as an output. Replaying member i therefore overwrites nothing
    anyone reads as long as no member after i has its outputs held; the caller reads a later member's
    outputs only after that member replayed again (its hand-out). Whether members join in the order they
    replay (`PoolChains.open_for`) decides only how often that holds, not whether the rule is kept."""
    __slots__ = ("handle", "members")

    def __init__(self, handle):
        self.handle = handle  # the pool's id (torch.cuda.graph_pool_handle())
        self.members: list = []


class _Ghost:
    """A member dropped (a parameter's tensor changed, the artifact closed) while the caller still holds its
    outputs: they stay in the pool, so the members before it must not replay until they are let go."""
    __slots__ = ("outputs", "order")

    def __init__(self, entry):
        self.outputs, self.order = entry.outputs, entry.order


class PoolChains:
    """The pool chains of one caller stream. `lock` is held across a capture into a chain, so members are
    listed in the order they were captured into its pool. Entries do not refer to their chain (no cycle)."""

    def __init__(self, new_handle):
        self.new_handle = new_handle
        self.chains: list[PoolChain] = []
        self.lock = threading.RLock()

    def open_for(self, order: int) -> PoolChain:
        """The newest chain whose last member comes before `order` (a stage captured after the stages before
        it, as they replay), else a new chain on a new pool. Call with `lock` held."""
        for c in reversed(self.chains):
            if not c.members or c.members[-1].order < order:
                return c
        c = PoolChain(self.new_handle())
        self.chains.append(c)
        return c

    def add(self, chain: PoolChain, entry) -> None:
        with self.lock:
            chain.members.append(entry)

    def _chain_of(self, entry) -> PoolChain | None:
        return next((c for c in self.chains if any(m is entry for m in c.members)), None)

    def held_after(self, entry) -> bool:
        """Whether a member captured after `entry` in its pool has its outputs held (then `entry` must not
        replay). Ghosts no longer held are let go here."""
        with self.lock:
            chain = self._chain_of(entry)
            if chain is None:
                return False
            chain.members = [m for m in chain.members if not isinstance(m, _Ghost) or m.outputs.held()]
            later = False
            for m in chain.members:
                if later and m.outputs.held():
                    return True
                later = later or m is entry
            return False

    def remove(self, entry) -> None:
        """A dropped graph leaves its chain (as a _Ghost while its outputs are held); an empty chain goes
        (its pool is not captured into again)."""
        with self.lock:
            chain = self._chain_of(entry)
            if chain is None:
                return
            ghost = [_Ghost(entry)] if entry.outputs.held() else []
            chain.members = [n for m in chain.members for n in ([m] if m is not entry else ghost)]
            if not chain.members:
                self.chains.remove(chain)
