"""Shared helpers for the example factories."""
from __future__ import annotations

import torch


def new_module(cls, cfg):
    """cls(cfg) without touching the caller's global RNG (constructors draw default inits from it)."""
    with torch.random.fork_rng(devices=[]):
        return cls(cfg)
