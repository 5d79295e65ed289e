"""Why a program captures a second CUDA-graph instance (issue 12.2: a staged backward's backward_2/3).

    python3 scripts/stage_holds.py ARCHIVE [--spec aotfuse.examples.gpt:anchor_train] [--steps 4]

Runs AdamW steps on the packaged module with CUDA graphs; whenever a program with graphs would capture
again, prints for each existing instance whether its key (input addresses) matched and, if its output set
is held, which outputs are still referenced and by what (gc referrers' types).
"""
from __future__ import annotations

import argparse
import gc

import torch

import aotfuse
from aotfuse.runtime import graph_cache
from aotfuse.specs import load_spec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("archive")
    ap.add_argument("--spec", default="aotfuse.examples.gpt:anchor_train")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    model, inputs = load_spec(a.spec)
    art = aotfuse.load(a.archive, device="cuda")
    mod = art.as_module(cuda_graphs=True)
    x = [t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs]
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-4)
    step = [0]
    orig = graph_cache.InstanceCache.choose

    def choose(self, key):
        action, e = orig(self, key)
        if action == "capture" and self.entries:
            print(f"step {step[0]}: capture #{len(self.entries) + 1} ({len(key)} keyed inputs)")
            for i, ent in enumerate(self.entries):
                same_key = ent.key == key
                moved = [j for j, (p, q) in enumerate(zip(ent.key, key)) if p != q]
                held = ent.outputs.held()
                print(f"  instance {i}: key {'matches' if same_key else f'differs at keyed inputs {moved[:8]}'}; "
                      f"outputs {'HELD' if held else 'free'}")
                if held:
                    for s, (cnt, ref), (c0, r0) in zip(ent.outputs.storages, graph_cache._counts(ent.outputs.storages),
                                                       ent.outputs.baseline):
                        if (cnt, ref) != (c0, r0):
                            ts = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel()
                                  and o.untyped_storage()._cdata == s._cdata]
                            kinds = sorted({type(r).__name__ for t in ts for r in gc.get_referrers(t)})
                            print(f"    storage {s.nbytes()} B: use count {cnt} (baseline {c0}); tensors on it "
                                  f"{len(ts)}, their referrers {kinds[:8]}")
        return action, e

    graph_cache.InstanceCache.choose = choose
    for k in range(a.steps):
        step[0] = k
        opt.zero_grad(set_to_none=True)
        loss = mod(*x)
        getattr(loss, "loss", loss).backward()
        opt.step()
    torch.cuda.synchronize()
    print({name: g.stats for name, g in (mod._graphs or {}).items()})


if __name__ == "__main__":
    main()
