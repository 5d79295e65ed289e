"""The map of the model zoo: for each entry of aotfuse/testing/zoo.py, build it for inference and for
training (tiny configs, the CPU path) and print where it stops: stage, exception, first op.

    PYTHONPATH=. python scripts/zoo_probe.py [name ...] [--run] [--dtype bfloat16]

--run: also load each archive that builds on the CPU (Triton interpreter) and compare with eager
(inference: every output; train: the loss and every gradient), printing the worst relative error.
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
import time
import traceback

import torch

import aotfuse
from aotfuse.errors import UnsupportedOpError
from aotfuse.testing.zoo import ZOO, flat_inputs, loss_of, output_leaves

_OP = re.compile(r"aten\.[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)?")


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _first_op(exc: BaseException) -> str:
    if isinstance(exc, UnsupportedOpError):
        return exc.op
    e = exc
    while e is not None:
        m = _OP.search(str(e))
        if m:
            return m.group(0)
        e = e.__cause__
    return "-"


def _root(exc: BaseException) -> str:
    e = exc
    while e.__cause__ is not None:
        e = e.__cause__
    if e is exc:
        return ""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def probe(entry, train: bool, dtype, run: bool, verbose: bool) -> dict:
    ex = entry.tiny(train=train, dtype=dtype)
    stage = ["setup"]

    def progress(kind, info):
        if kind == "stage" and info.get("status") == "start":
            stage[0] = info["name"]

    t0 = time.perf_counter()
    row = {"model": entry.name, "mode": "train" if train else "infer", "dtype": str(dtype).split(".")[-1]}
    try:
        res = aotfuse.build(ex.model, ex.args, example_kwargs=ex.kwargs, train=train, targets=("sm_90",),
                            progress=progress)
    except Exception as exc:  # noqa: BLE001 - this is the map of failures
        if verbose:
            traceback.print_exc()
        row.update(status="FAIL", stage=stage[0], error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:140]}",
                   cause=_root(exc), op=_first_op(exc), seconds=round(time.perf_counter() - t0, 1))
        return row
    row.update(status="builds", stage="-", error="", cause="", op="-")
    if run:
        try:
            call = res.manifest.call["inputs"]
            art = aotfuse.load(res.data, device="cpu")
            inputs = ex.make_inputs(7)
            flat = flat_inputs(inputs, call)
            ref_model = copy.deepcopy(ex.model)
            if train:
                mod = art.as_module()
                loss = mod(*flat)
                loss.backward()
                ref = loss_of(ex.call(ref_model, inputs))
                ref.backward()
                errs = {"loss": _rel(loss, ref)}
                ours = dict(mod.named_parameters())
                for n, p in ref_model.named_parameters():
                    if p.grad is not None:
                        errs[n] = _rel(ours[n].grad, p.grad) if ours[n].grad is not None else float("inf")
            else:
                outs = art(*flat)
                outs = list(outs) if isinstance(outs, tuple) else [outs]
                with torch.no_grad():
                    refs = output_leaves(ex.call(ref_model, inputs))
                errs = {f"out{i}": _rel(o, r) for i, (o, r) in enumerate(zip(outs, refs))}
            worst = max(errs, key=errs.get)
            row.update(status=f"matches (worst {worst} {errs[worst]:.1e})")
        except Exception as exc:  # noqa: BLE001
            if verbose:
                traceback.print_exc()
            row.update(status="RUN FAIL", stage="run", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:140]}",
                       op=_first_op(exc))
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--run", action="store_true")
    ap.add_argument("--mode", choices=("infer", "train", "both"), default="both")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    rows = []
    for entry in ZOO:
        if a.names and entry.name not in a.names:
            continue
        for train in {"infer": (False,), "train": (True,), "both": (False, True)}[a.mode]:
            row = probe(entry, train, dtype, a.run, a.verbose)
            rows.append(row)
            print(f"{row['model']:12} {row['mode']:5} {row['status']:34} {row['stage']:14} {row['op']:40} "
                  f"{row['seconds']}s\n    {row['error']}" + (f"\n    cause: {row['cause']}" if row["cause"] else ""),
                  flush=True)
    print("\n| model | mode | dtype | status | stage | first op | error |\n|---|---|---|---|---|---|---|")
    for r in rows:
        err = r["error"].replace("|", "\\|") + (f" <- {r['cause']}".replace("|", "\\|") if r["cause"] else "")
        print(f"| {r['model']} | {r['mode']} | {r['dtype']} | {r['status']} | {r['stage']} | {r['op']} | {err} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
