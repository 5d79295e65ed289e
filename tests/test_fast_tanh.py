"""tanh in fused kernels: the fast form (emit/kernel_src._TANH_FAST) where every stored value is half
precision, libdevice's elsewhere; a tanh GELU's backward that also recomputes the GELU computes one tanh."""
from __future__ import annotations

import copy
import math

import msgpack
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.emit.kernel_src import header
from aotfuse.knobs import override

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _run_fast_tanh(x: torch.Tensor) -> torch.Tensor:
    """_tanh_fast on fp32 values through Triton's interpreter (the CPU path's runner)."""
    from aotfuse.runtime.interpret import make_launchers
    from aotfuse.contract.kernels import KernelArg, KernelEntry

    body = ("    xindex = tl.program_id(0) * 1024 + tl.arange(0, 1024)\n    xmask = xindex < xnumel\n"
            "    v = tl.load(in_ptr0 + xindex, xmask, other=0)\n"
            "    tl.store(out_ptr0 + xindex, _tanh_fast(v), xmask)")
    name = "aotf_pw_tanhprobe"
    src = f"{header(body)}\n@triton.jit\ndef {name}(in_ptr0, out_ptr0, xnumel):\n{body}\n"
    assert "def _tanh_fast(" in src
    entry = KernelEntry("pointwise", (), (1, 1, 1), 4, 1024, 1, None, None,
                        (KernelArg("in_ptr0", "float32", "in"), KernelArg("out_ptr0", "float32", "out")), {},
                        size_args=("xnumel",))
    launch = make_launchers({name: entry}, {name: src})[name]
    out = torch.empty_like(x)
    launch((-(-x.numel() // 1024), 1, 1), None, [x, out, x.numel()])
    return out


def test_fast_tanh_accuracy_over_the_whole_range():
    # against the correctly rounded fp32 tanh: within 1-2 ulps below |x| = 1/8 (the series), a few ulps of
    # absolute error above (the exp form), exact +-1 far out, odd, no NaN at the extremes; and what cancels
    # against it (tanhshrink, x - tanh(x)) keeps a relative error far below half precision's rounding
    mags = torch.logspace(-30, math.log10(80.0), 8001, dtype=torch.float64)
    x = torch.cat([mags, -mags, torch.tensor([0.0, 0.125, -0.125, 1e30, -1e30], dtype=torch.float64)]).float()
    got = _run_fast_tanh(x)
    want = torch.tanh(x.double()).float()
    ulp = (torch.nextafter(want.abs(), torch.tensor(float("inf"))) - want.abs()).double()
    ulps = (got.double() - want.double()).abs() / ulp
    small = x.abs() < 0.125
    assert not torch.isnan(got).any()
    assert float(ulps[small].max()) <= 2 and float(ulps[~small].max()) <= 16, (ulps[small].max(), ulps[~small].max())
    assert float((got.double() - want.double()).abs().max()) < 3e-7
    assert got[x == 0].eq(0).all() and got[x.abs() > 20].abs().eq(1).all() and torch.equal(got[:8001], -got[8001:16002])
    m = (x.abs() > 1e-3) & (x.abs() < 8)
    shrink, ref = (x.double() - got.double())[m], (x.double() - want.double())[m]
    assert float(((shrink - ref).abs() / ref.abs()).max()) < 5e-4  # bf16 rounds at 4e-3


class Mlp(nn.Module):
    """LayerNorm -> Linear -> tanh GELU -> Linear, the GPT block's MLP."""

    def __init__(self, d=64, h=256):
        super().__init__()
        self.ln, self.fc, self.proj = nn.LayerNorm(d), nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(self.ln(x)), approximate="tanh")).float().pow(2).mean()


def _tanh_calls(src: str) -> int:
    body = src.split("def aotf_")[-1]  # the kernel itself, not the helper's definition
    return body.count("_tanh_fast(") + body.count("libdevice.tanh(")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gelu_backward_computes_one_tanh_and_matches_eager(dtype):
    torch.manual_seed(0)
    model = Mlp().to(dtype)
    x = torch.randn(4, 32, 64, dtype=dtype)
    res = aotfuse.build(model, (x,), train=True, targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    srcs = msgpack.unpackb(bytes(art.archive.part("sources")))
    with_tanh = {n: s for n, s in srcs.items() if _tanh_calls(s)}
    assert with_tanh, "no kernel computes the GELU's tanh"
    # every kernel computes the tanh at most once (the backward's recompute of the GELU and its
    # derivative share it), in the fast form exactly when the model is half precision
    assert all(_tanh_calls(s) == 1 for s in with_tanh.values()), {n: _tanh_calls(s) for n, s in with_tanh.items()}
    half = dtype == torch.bfloat16
    assert all(("_tanh_fast(" in s) == half and ("libdevice.tanh(" in s) != half for s in with_tanh.values())
    mod = art.as_module()
    torch.manual_seed(1)
    fresh = torch.randn(4, 32, 64, dtype=dtype)
    loss = mod(fresh)
    loss.backward()
    ref_model = copy.deepcopy(model)
    ref = ref_model(fresh)
    ref.backward()
    tol = 2e-2 if half else 1e-5
    assert rel(loss, ref) < tol
    ours = dict(mod.named_parameters())
    for n, p in ref_model.named_parameters():
        assert rel(ours[n].grad, p.grad) < (3e-2 if half else 1e-4), (n, rel(ours[n].grad, p.grad))


def test_fast_tanh_off_keeps_libdevice():
    model = Mlp().to(torch.bfloat16).eval()
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    with override(fast_tanh=False):
        res = aotfuse.build(model, (x,), targets=("sm_90",))
    srcs = msgpack.unpackb(bytes(aotfuse.load(res.data, device="cpu").archive.part("sources")))
    assert not any("_tanh_fast(" in s for s in srcs.values())
