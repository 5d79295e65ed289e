"""The map of the model zoo: for each entry of aotfuse/testing/zoo.py, build it for inference and for
training (tiny configs, the CPU path) and print where it stops: stage, exception, first op.

    PYTHONPATH=. python scripts/zoo_probe.py [name ...] [--more] [--run] [--dtype bfloat16]

--more: also the entries of aotfuse/testing/zoo_more.py (MORE, then SPARE).
--run: also load each archive that builds on the CPU (Triton interpreter), call it as the model is called
(keyword tensors in, the model's output structure out) and compare with eager as tests/test_zoo.py does
(inference: every output; train: the loss, every gradient and every buffer the forward updates; an error
past the tolerance is judged against float64, no further than twice eager's own), printing the worst
relative error.
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
# tests/test_zoo.py's tolerances
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def _rel(a, b, floor: float = 1e-30) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / max(float(b.norm()), floor))


def _cast(inputs, dtype):
    """The inputs with their floating tensors in `dtype` (the float64 and fp32 references)."""
    args, kw = inputs
    c = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    return tuple(c(a) for a in args), {k: c(v) for k, v in kw.items()}


def _float64(ex, inputs):
    """A float64 copy of the model after a training step's call and backward: (loss, its parameters'
    gradients, its buffers). A model with an op that has no float64 kernel (torch._grouped_mm: a mixture of
    experts) is judged against float32 instead, which is then the precision bf16 eager is measured from."""
    try:
        model = copy.deepcopy(ex.model).double()
        loss = loss_of(ex.call(model, _cast(inputs, torch.float64)))
    except RuntimeError:
        model = copy.deepcopy(ex.model).float()
        loss = loss_of(ex.call(model, _cast(inputs, torch.float32)))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, dict(model.named_buffers())


def compare(ex, res, art, inputs, train: bool, dtype) -> dict[str, tuple[float, bool]]:
    """name -> (relative error from eager, within tests/test_zoo.py's tolerance), for every output
    (inference) or the loss, every gradient and every floating buffer the forward updates (training)."""
    args, kw = inputs[0], {k: v for k, v in inputs[1].items() if isinstance(v, torch.Tensor)}  # constants baked in
    ref_model = copy.deepcopy(ex.model)
    errs = {}
    if not train:
        with torch.no_grad():
            eager = ex.call(ref_model, inputs)
        got = art(*args, **kw)
        if hasattr(eager, "keys") and (type(got).__name__ != type(eager).__name__ or list(got.keys()) != list(eager)):
            return {f"output structure {type(got).__name__} vs eager's {type(eager).__name__}": (float("inf"), False)}
        outs, refs = output_leaves(got), output_leaves(eager)
        if len(outs) != len(refs):
            return {f"{len(outs)} outputs vs eager's {len(refs)}": (float("inf"), False)}
        ref32 = None
        for i, (o, r) in enumerate(zip(outs, refs)):
            if o.shape != r.shape or o.dtype != r.dtype:
                errs[f"out{i} {tuple(o.shape)} {o.dtype} vs {tuple(r.shape)} {r.dtype}"] = (float("inf"), False)
                continue
            err = _rel(o, r)
            if dtype != torch.float32:  # both against fp32 eager: bf16 eager rounds after every op
                if ref32 is None:
                    with torch.no_grad():
                        ref32 = output_leaves(ex.call(copy.deepcopy(ex.model).float(), _cast(inputs, torch.float32)))
                err, eager_err = _rel(o, ref32[i]), _rel(r, ref32[i])
                errs[f"out{i}"] = (err, err <= max(TOL[dtype], 2 * eager_err))
            else:
                errs[f"out{i}"] = (err, err <= TOL[dtype])
        return errs
    mod = art.as_module()
    loss = loss_of(mod(*args, **kw))
    loss.backward()
    ref = loss_of(ex.call(ref_model, inputs))
    ref.backward()
    exact = None

    def f64():
        nonlocal exact
        exact = exact or _float64(ex, inputs)
        return exact

    err = _rel(loss, ref)
    ok = err < TOL[dtype]
    if not ok:  # a deep train-mode network's loss amplifies summation order: both against float64
        loss64 = f64()[0]
        ok = _rel(loss, loss64) <= max(TOL[dtype], 2 * _rel(ref, loss64))
    errs["loss"] = (err, ok)
    ours = dict(mod.named_parameters())
    grads = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    for n in {n for n, _ in ref_model.named_parameters()} - set(ours):
        errs[f"parameter {n} missing"] = (float("inf"), False)
    floor = 1e-3 * max((float(g.double().norm()) for g in grads.values()), default=0.0)  # gradients 0 exactly
    for n, g in grads.items():
        if n not in ours or ours[n].grad is None:
            errs[f"grad {n}"] = (float("inf"), False)
            continue
        err = _rel(ours[n].grad, g, floor)
        ok = err < GRAD_TOL[dtype]
        if not ok:  # ill-conditioned: no further from float64 than twice eager's own error
            g64 = f64()[1][n]
            ok = _rel(ours[n].grad, g64, floor) <= 2 * _rel(g, g64, floor)
        errs[f"grad {n}"] = (err, ok)
    ref_bufs, our_bufs = dict(ref_model.named_buffers()), dict(mod.named_buffers())
    if set(our_bufs) != set(res.manifest.train.mutated_buffers):
        errs["the module's buffers are not the mutated ones"] = (float("inf"), False)
    # buffers 0 in exact arithmetic (a BatchNorm's mean after a bias-free 1x1 conv of a BatchNorm's output)
    bfloor = 1e-3 * max((float(b.double().norm()) for b in ref_bufs.values() if b.is_floating_point()), default=0.0)
    for n, b in our_bufs.items():
        if not b.is_floating_point():
            errs[f"buffer {n}"] = (0.0, True) if torch.equal(b, ref_bufs[n]) else (float("inf"), False)
            continue
        err = _rel(b, ref_bufs[n], bfloor)
        ok = err < TOL[dtype]
        if not ok:
            b64 = f64()[2][n]
            ok = _rel(b, b64, bfloor) <= max(TOL[dtype], 2 * _rel(ref_bufs[n], b64, bfloor))
        errs[f"buffer {n}"] = (err, ok)
    return errs


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
            art = aotfuse.load(res.data, device="cpu")
            inputs = ex.make_inputs(11)  # fresh random inputs, as tests/test_zoo.py
            assert len(flat_inputs(inputs, res.manifest.call["inputs"])) == len(art.input_specs)
            errs = compare(ex, res, art, inputs, train, dtype)
            bad = [k for k, (_, ok) in errs.items() if not ok]
            worst = bad[0] if bad else max(errs, key=lambda k: errs[k][0])
            verdict = f"MISMATCH ({len(bad)}: {worst}" if bad else f"matches (worst {worst}"
            row.update(status=f"{verdict} {errs[worst][0]:.1e})")
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
    ap.add_argument("--more", action="store_true", help="also aotfuse/testing/zoo_more.py's MORE and SPARE")
    ap.add_argument("--run", action="store_true")
    ap.add_argument("--mode", choices=("infer", "train", "both"), default="both")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    from aotfuse.testing.zoo_more import MORE, SPARE, unmet

    entries = ZOO + (MORE + SPARE if a.more else ())
    unknown = set(a.names) - {e.name for e in entries}
    if unknown:
        hint = " (zoo_more entries: pass --more)" if unknown & {e.name for e in MORE + SPARE} else ""
        ap.error(f"no zoo entry {', '.join(sorted(unknown))}{hint}")
    rows = []
    for entry in entries:
        if a.names and entry.name not in a.names:
            continue
        why = unmet(entry)
        if why:
            print(f"{entry.name:12} skipped: {why}", flush=True)
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
