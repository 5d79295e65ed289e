"""The state of a packaged training module besides its parameters: the buffers its forward updates.

A train archive whose forward updates buffers (train-mode BatchNorm's running_mean, running_var and
num_batches_tracked; `TrainInfo.mutated_buffers`) passes each buffer to the forward program after
the parameters and gets its new value back after the loss. `UpdatedBuffers` holds those buffers
for `PackagedModule` (runtime/training.py): registered on a submodule (so `.to()`, `.cuda()` and
`state_dict()` see them), started from the archive's weights, and written in place after each
forward (`write_back`), as eager BatchNorm updates its buffers in place: the next call reads the
new values.

`original_state_dict_names(module, groups)` makes `state_dict()` / `load_state_dict()` use the
original model's names (`bn.running_mean`, `conv.weight`) rather than the mangled attribute names
(nn.Module names cannot hold dots), so a packaged module's state loads into the eager model and back.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ..errors import AotfuseError, ArchiveError
from .graph_cache import copy_all


def mangle(fqn: str) -> str:
    """An attribute name for a dotted name (nn.Module refuses dots in parameter and buffer names)."""
    return fqn.replace(".", "__")


class UpdatedBuffers(nn.Module):
    """The buffers the forward program updates, in `TrainInfo.mutated_buffers` order."""

    def __init__(self, art, names: tuple[str, ...]):
        super().__init__()
        self.names = tuple(names)
        self._keys = [mangle(n) for n in self.names]
        if len(set(self._keys)) != len(self._keys):
            raise ArchiveError(f"updated buffers {list(self.names)} collide once dots become '__'",
                               remedy="rename the model's buffers so that no two differ only in '.' vs '__'")
        for name, key in zip(self.names, self._keys):
            t = art.weights[name]
            if t.device.type == "cpu":  # on the CPU path weights are views of the archive's bytes: never write there
                t = t.clone()
            self.register_buffer(key, t)

    def tensors(self) -> list[torch.Tensor]:
        """The current buffer tensors (looked up per call: `.to()` replaces buffer objects)."""
        return [self._buffers[k] for k in self._keys]

    def named(self, prefix: str = ""):
        for name, key in zip(self.names, self._keys):
            yield prefix + name, self._buffers[key]

    def check_mode(self, training: bool) -> None:
        """The packaged forward uses batch statistics and updates the buffers, whatever `.eval()` says:
        an eval-mode call would silently differ from the eager model's, so it is refused."""
        if self.names and not training:
            raise AotfuseError("this module's forward was packaged in train mode (BatchNorm normalizes with "
                               "batch statistics and updates its running statistics); .eval() cannot change it",
                               remedy="evaluate with an archive built from model.eval() (load this module's "
                                      "state_dict() into the model first), or call .train()")

    def write_back(self, updates) -> None:
        """Copy the forward program's new values into the buffers, in place (no autograd history)."""
        if len(updates) != len(self._keys):
            raise ArchiveError(f"the forward returned {len(updates)} buffer updates for {len(self._keys)} buffers",
                               remedy="rebuild the archive with this aotfuse")
        with torch.no_grad():
            # multi-tensor copies (one per dtype): a ResNet-18 step's 60 BatchNorm statistics took 60 copies
            # of about 1.2 us of GPU time each (H100, scripts/copy_sources.py)
            copy_all(self.tensors(), list(updates))


def _rename(mapping: dict, module, state_dict, prefix, *_):
    """state_dict post-hook: mangled attribute keys -> the original names."""
    for attr, name in mapping.items():
        key = prefix + attr
        if key in state_dict:
            state_dict[prefix + name] = state_dict.pop(key)


def _unrename(mapping: dict, module, state_dict, prefix, *_):
    """load_state_dict pre-hook: the original names -> mangled attribute keys (those pass as they are)."""
    for attr, name in mapping.items():
        key = prefix + name
        if key in state_dict and prefix + attr not in state_dict:
            state_dict[prefix + attr] = state_dict.pop(key)


def original_state_dict_names(module: nn.Module, groups: dict[str, tuple[str, ...]]) -> None:
    """`module.state_dict()` keys its entries `<child>.<mangled>` by their original names, and
    `load_state_dict` takes either. `groups`: child attribute -> the original names it holds."""
    mapping = {f"{child}.{mangle(n)}": n for child, names in groups.items() for n in names}
    module.register_state_dict_post_hook(functools.partial(_rename, mapping))
    module.register_load_state_dict_pre_hook(functools.partial(_unrename, mapping))
