"""Saved activation bytes: our min-cut partition vs torch's min_cut_rematerialization_partition.

Both partition the same joint graph (our training decompositions); a saved tensor is a
forward-produced tensor kept for the backward (not a parameter, buffer or user input), bytes from
meta['val'] (ours: bit-packed size for bool tensors).

    python scripts/compare_partition.py [--budget 1.0] [--verbose]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from aotfuse.joint import trace_joint
from aotfuse.partition import partition
from aotfuse.partition.mincut import torch_min_cut_saved, torch_saved_bytes
from aotfuse.specs import load_spec

SPECS = ("aotfuse.examples.gpt:demo_train", "aotfuse.examples.llama:block_train", "aotfuse.examples.cnn:cnn_train")


def compare(spec: str, budget: float = 1.0):
    model, inputs = load_spec(spec)
    joint = trace_joint(model, inputs)
    t0 = time.perf_counter()
    ours = partition(joint, budget)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = torch_min_cut_saved(joint)
    t_torch = time.perf_counter() - t0
    return joint, ours, theirs, t_ours, t_torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("specs", nargs="*", default=list(SPECS))
    args = ap.parse_args(argv)
    rows = []
    for spec in args.specs:
        joint, ours, theirs, t_ours, t_torch = compare(spec, args.budget)
        acts = [s for s in ours.saved if s.kind == "activation"]
        raw, alive = torch_saved_bytes(theirs)
        rows.append((spec, ours.saved_bytes, len(acts), sum(s.packed for s in acts), len(ours.recomputed),
                     raw, alive, len(theirs)))
        if args.verbose:
            print(f"\n{spec}\n  ours : " + ", ".join(f"{s.name}({s.nbytes}{' packed' if s.packed else ''})"
                                                       for s in acts))
            print("  torch: " + ", ".join(f"{e['name']}({e['bytes']}{' alias of input' if e['alias_of_input'] else ''})"
                                          for e in theirs))
            print(f"  partition time: ours {t_ours:.2f}s, torch {t_torch:.2f}s")
    print(f"{'model':<36} {'ours B':>9} {'n':>3} {'packed':>6} {'recomp':>6} | {'torch B':>9} {'alive B':>9} {'n':>3}"
          f" | {'ours/alive':>10}")
    for spec, ob, on, pk, rc, raw, alive, tn in rows:
        print(f"{spec:<36} {ob:>9} {on:>3} {pk:>6} {rc:>6} | {raw:>9} {alive:>9} {tn:>3} | "
              f"{ob / alive if alive else float('nan'):>10.3f}")
    print(f"memory_budget={args.budget}. ours B: bytes of forward-produced tensors we keep (bool masks bit-packed). "
          "torch B: sum over torch's saved tensors; alive B: the same counting each distinct base once and views "
          "of params/inputs as free (what torch's saved tensors actually keep alive).")
    return 0


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
