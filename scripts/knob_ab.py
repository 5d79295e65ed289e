"""A/B of build knobs on the GPU: each variant's archive of a case, side by side with torch.compile, in one
process: GPU kernel time per call (torch.profiler: the sum of the device kernels' durations, and the largest
kernels) and that time as percent of the measured device copy, with every variant checked against eager
(outputs, and the gradients of training cases) first.

    python3 scripts/knob_ab.py [--cases ln,ce,softmax50257] VARIANT ...

A VARIANT is `name:knob=value,knob=value` (knobs of aotfuse.knobs; `name:` alone is the defaults), e.g.
    python3 scripts/knob_ab.py base: nomix:mix_order=0 p64k:persistent_rblock_max=65536
The archive is built for the device's own target unless a variant names them: `multi:targets=sm_80+sm_90`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

import aotfuse
from aotfuse.knobs import knobs, override

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import CrossEntropyLoss, LayerNorm, LayerNormLoss, Softmax, copy_bandwidth  # noqa: E402
from step_ab import kernel_time, print_table, time_ms  # noqa: E402

BF16 = torch.bfloat16


def _ln():
    x = torch.randn(16384, 4096, dtype=BF16).requires_grad_()
    return LayerNormLoss(4096), (x,), True, 2 * x.numel() * 2


def _ce():
    L = torch.randn(8192, 32000, dtype=BF16).requires_grad_()
    return CrossEntropyLoss(), (L, torch.randint(0, 32000, (8192,))), True, 2 * L.numel() * 2


def _ln768():
    # the anchor GPT's LayerNorm backward size: the weight and bias gradients are column sums of 8192 rows
    x = torch.randn(8192, 768, dtype=BF16).requires_grad_()
    return LayerNormLoss(768), (x,), True, 2 * x.numel() * 2


class ColSum(torch.nn.Module):
    """x.sum(0): a bias gradient's column sum (split into partial column sums and a final one)."""

    def forward(self, x):
        return x.sum(0)


class AddLayerNorm(torch.nn.Module):
    """h = x + r + b, LayerNorm(h): the anchor GPT's residual add and LayerNorm (both outputs kept)."""

    def __init__(self, n):
        super().__init__()
        self.b = torch.nn.Parameter(torch.randn(n, dtype=BF16))
        self.ln = torch.nn.LayerNorm(n, dtype=BF16)

    def forward(self, x, r):
        h = x + r + self.b
        return h, self.ln(h)


def _addln768():
    x, r = (torch.randn(8192, 768, dtype=BF16) for _ in range(2))
    return AddLayerNorm(768), (x, r), False, 4 * x.numel() * 2


def _anchor():
    from aotfuse.examples.gpt import anchor_train

    model, inputs = anchor_train(batch=8)
    return model, inputs, True, 0  # no one byte count: % of copy is not meaningful here


def _anchor_infer():
    # the anchor GPT's inference at 8 x 1024 (issue 11.4), e.g. `base: nogelu:mm_gelu=0`
    from aotfuse.examples.gpt import anchor

    model, inputs = anchor(batch=8)
    return model, inputs, False, 0


def _fwd(model, shape, extra=0, dtype=BF16):
    def make():
        x = torch.randn(*shape, dtype=dtype)
        size = torch.finfo(dtype).bits // 8
        return model(), (x,), False, 2 * x.numel() * size + extra
    return make


CASES = {"ln": _ln, "ce": _ce, "anchor": _anchor, "anchor_infer": _anchor_infer,
         "softmax50257": _fwd(Softmax, (1024, 50257)),
         "softmax32000": _fwd(Softmax, (8192, 32000)),
         "softmax4096": _fwd(Softmax, (16384, 4096)),
         "ln4096": _fwd(lambda: LayerNorm(4096), (16384, 4096), 4 * 4096),
         "softmax1000": _fwd(Softmax, (65536, 1000)),
         "ln50257": _fwd(lambda: LayerNorm(50257), (1024, 50257), 4 * 50257),
         "softmax197": _fwd(Softmax, (327680, 197)),
         "ln197": _fwd(lambda: LayerNorm(197), (327680, 197), 4 * 197),
         "ln1000": _fwd(lambda: LayerNorm(1000), (65536, 1000), 4 * 1000),
         "ln768": _ln768,
         "ln768fwd": _fwd(lambda: LayerNorm(768), (8192, 768), 4 * 768),
         "addln768": _addln768,
         "colsum3072": _fwd(ColSum, (8192, 3072), -8192 * 3072 * 2),
         "colsum2304": _fwd(ColSum, (8192, 2304), -8192 * 2304 * 2),
         "colsum768": _fwd(ColSum, (8192, 768), -8192 * 768 * 2),
         "batchsum": _fwd(ColSum, (8, 1024 * 768), -7 * 1024 * 768 * 2),  # a position embedding's batch sum
         # a split BatchNorm statistic's final (ResNet-18: 392 partials of 64 channels, 196 of 128, 98 of 256)
         "final64": _fwd(ColSum, (392, 64), -391 * 64 * 4, torch.float32),
         "final128": _fwd(ColSum, (196, 128), -195 * 128 * 4, torch.float32),
         "final256": _fwd(ColSum, (98, 256), -97 * 256 * 4, torch.float32)}


def _value(knob: str, raw: str):
    cur = getattr(knobs, knob)
    if isinstance(cur, tuple):  # targets=sm_80+sm_90
        return tuple(raw.split("+"))
    return type(cur)(int(raw)) if isinstance(cur, bool) else type(cur)(raw)


def parse_variant(text: str):
    name, _, rest = text.partition(":")
    kv = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        kv[k] = _value(k, v)
    return name, kv


def build(model, inputs, train: bool, kv: dict, step: str | None = "auto"):
    """Training cases default to one fused step (a loss's forward and backward in one program), the
    anchor GPT to the product's default (knobs.train_step); a variant's train_step knob decides."""
    path = tempfile.mktemp(suffix=".aotf")
    major, minor = torch.cuda.get_device_capability()
    kv = dict(kv)
    targets = kv.pop("targets", None) or (f"sm_{major}{minor}",)  # a variant may name several: targets=sm_80+sm_90
    with override(**kv):
        res = aotfuse.build(model, inputs, train=train, targets=targets,
                            **({"step": step} if train and "train_step" not in kv else {}))
    res.save(path)
    art = aotfuse.load(path, device="cuda")
    os.unlink(path)
    if not train:  # the artifact itself: art(*inputs), parameters are its weights
        art.parameters = lambda: []
        art.named_parameters = lambda: []
        return art, res
    return art.as_module(), res


def call_of(fn, params, inputs, train: bool):
    if not train:
        def fwd():
            with torch.no_grad():
                fn(*inputs)
        return fwd

    def step():
        for t in list(params) + [x for x in inputs if x.requires_grad]:
            t.grad = None
        fn(*inputs).backward()
    return step


def grads(fn, params, inputs, train: bool):
    if not train:
        with torch.no_grad():
            out = fn(*inputs)
            return [o.float() for o in (out if isinstance(out, (tuple, list)) else (out,))]
    call_of(fn, params, inputs, True)()
    return [t.grad.float() for t in list(params) + [x for x in inputs if x.requires_grad]]


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--cases", default="ln,ce")
    ap.add_argument("--top", type=int, default=4)
    a = ap.parse_args()
    variants = [parse_variant(v) for v in a.variants]
    copy = copy_bandwidth()
    rows = []
    for cname in a.cases.split(","):
        torch.manual_seed(0)
        model, inputs, train, nbytes = CASES[cname]()
        model = model.cuda()
        x = tuple(t.detach().cuda().requires_grad_(t.requires_grad) for t in inputs)
        want = grads(model, list(model.parameters()), x, train)
        calls = {}
        for vname, kv in variants:
            try:
                mod, res = build(model.cpu(), inputs, train, kv, None if cname == "anchor" else "auto")
                model.cuda()
                with torch.no_grad():
                    for n, p in mod.named_parameters():
                        p.copy_(dict(model.named_parameters())[n])
                got = grads(mod, list(mod.parameters()), x, train)
                err = max(rel(g, w) for g, w in zip(got, want))
                calls[vname] = (call_of(mod, list(mod.parameters()), x, train), err,
                                res.report.fusion_summary.kernel_launches)
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the others still run
                model.cuda()
                print(f"{cname} {vname}: FAILED {type(e).__name__}: {e}", flush=True)
        compiled = torch.compile(model)
        calls["torch.compile"] = (call_of(compiled, list(model.parameters()), x, train), 0.0, "-")
        for k, (fn, err, launches) in calls.items():
            for _ in range(3):
                fn()
            ts = [kernel_time(fn)[0] for _ in range(3)]
            wall = statistics.median(time_ms(fn, 20) for _ in range(3))
            total, per = kernel_time(fn)
            ms = statistics.median(ts + [total]) / 1e3
            top = "; ".join(f"{n} {us:.0f}" for n, us in per.most_common(a.top))
            rows.append((cname, k, f"{ms * 1e3:.1f}", f"{wall * 1e3:.1f}", f"{100 * nbytes / (ms * 1e-3) / copy:.0f}%" if nbytes else "-", launches,
                         f"{err:.1e}", top))
            print(rows[-1], flush=True)
    print_table(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy {copy / 1e12:.2f} TB/s",
                ("case", "variant", "GPU kernel us per call", "call us (events, graphs as loaded)", "% of copy", "launches", "max rel err", "top kernels (us)"),
                rows)


if __name__ == "__main__":
    main()
