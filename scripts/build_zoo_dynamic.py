"""Build a zoo model at its realistic size (inference, bf16) with dynamic dims, on any machine (no GPU needed).

    python3 scripts/build_zoo_dynamic.py llama /tmp/llama_dyn.aotf --dynamic input_ids.0=1..8 \
        --dynamic input_ids.1=2..2048 [--arch sm_90] [--knob output_hosts=0]

--knob NAME=VALUE (repeatable): aotfuse.knobs overrides for this build (an A/B against the defaults)."""
from __future__ import annotations

import argparse
import time

import torch

import aotfuse
from aotfuse.knobs import override
from aotfuse.testing.zoo import entry


def _value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("out")
    ap.add_argument("--dynamic", action="append", default=[], metavar="INPUT.DIM=LO..HI")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE")
    a = ap.parse_args()
    ex = entry(a.name).realistic(train=False, dtype=torch.bfloat16)
    knobs = dict(k.split("=", 1) for k in a.knob)
    t0 = time.perf_counter()
    with override(**{k: _value(v) for k, v in knobs.items()}):
        res = aotfuse.build(ex.model, ex.args, example_kwargs=ex.kwargs, targets=tuple(a.arch.split(",")),
                            dynamic_shapes=a.dynamic or None)
    res.save(a.out)
    m = res.report.memory
    print(f"{a.name}: built in {time.perf_counter() - t0:.1f} s, {len(res.data) / 2 ** 20:.0f} MiB; arena at the "
          f"example {m.arena_bytes / 2 ** 20:.1f} MiB ({m.plan}); hosts: {m.donation or '-'}")


if __name__ == "__main__":
    main()
