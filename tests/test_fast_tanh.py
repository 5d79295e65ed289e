"""tanh in fused kernels: the fast form (emit/kernel_src._TANH_FAST) where every stored value is half
precision, libdevice's elsewhere. The tanh GELU is x * sigmoid(2u), forward and backward: a backward kernel
that also recomputes the GELU computes one sigmoid, and the derivative keeps its relative accuracy on the
negative tail (against float64)."""
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


def _body(src: str) -> str:
    return src.split("def aotf_")[-1]  # the kernel itself, not the helpers' definitions


def _tanh_calls(src: str) -> int:
    return _body(src).count("_tanh_fast(") + _body(src).count("libdevice.tanh(")


def _sources(res) -> dict:
    return msgpack.unpackb(bytes(aotfuse.load(res.data, device="cpu").archive.part("sources")))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gelu_backward_computes_one_sigmoid_and_matches_eager(dtype):
    torch.manual_seed(0)
    model = Mlp().to(dtype)
    x = torch.randn(4, 32, 64, dtype=dtype)
    res = aotfuse.build(model, (x,), train=True, targets=("sm_90",))
    srcs = _sources(res)
    with_sigmoid = {n: s for n, s in srcs.items() if "tl.sigmoid(" in _body(s)}
    assert len(with_sigmoid) >= 2, "no forward and backward kernels compute the GELU's sigmoid"
    # every kernel computes the sigmoid at most once (the backward's recompute of the GELU and its
    # derivative share it), and no tanh
    # (a matmul template with a heavy epilogue evaluates it in two column halves: once per half)
    assert all(_body(s).count("tl.sigmoid(") == (2 if "acc_h1" in s else 1) for s in with_sigmoid.values()), \
        with_sigmoid.keys()
    assert not any(_tanh_calls(s) for s in srcs.values())
    mod = aotfuse.load(res.data, device="cpu").as_module()
    torch.manual_seed(1)
    fresh = torch.randn(4, 32, 64, dtype=dtype)
    loss = mod(fresh)
    loss.backward()
    ref_model = copy.deepcopy(model)
    ref = ref_model(fresh)
    ref.backward()
    half = dtype == torch.bfloat16
    tol = 2e-2 if half else 1e-5
    assert rel(loss, ref) < tol
    ours = dict(mod.named_parameters())
    for n, p in ref_model.named_parameters():
        assert rel(ours[n].grad, p.grad) < (3e-2 if half else 1e-4), (n, rel(ours[n].grad, p.grad))


_K = math.sqrt(2.0 / math.pi)


def _gelu_tanh_grad64(x: torch.Tensor) -> torch.Tensor:
    """d/dx of x * 0.5 * (1 + tanh(u)), u = k (x + 0.044715 x^3), in float64 without cancellation:
    sigmoid(2u) + 0.5 x u' sech(u)^2, sech^2 as 4 / (e^u + e^-u)^2."""
    x = x.double()
    u = _K * (x + 0.044715 * x ** 3)
    du = _K * (1.0 + 3.0 * 0.044715 * x * x)
    return torch.sigmoid(2.0 * u) + 0.5 * x * du * 4.0 / (torch.exp(u) + torch.exp(-u)) ** 2


class GeluTail(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return F.gelu(x * self.w, approximate="tanh").sum()


def test_tanh_gelu_backward_keeps_the_negative_tail_against_float64():
    """aten's 0.5 (1 + tanh(u)) + ... form cancels to exactly 0 below x = -5.5 in fp32 (true value about
    -5e-8) and is 4.5e-4 off at x = -4; the sigmoid form stays within a few fp32 roundings there."""
    from aotfuse.joint.decomp_train import training_decompositions

    decomp = training_decompositions()[torch.ops.aten.gelu_backward.default]
    x = torch.cat([torch.linspace(-12.0, 12.0, 24001), torch.tensor([-4.0, -5.5, -6.0, -9.0])])
    want = _gelu_tanh_grad64(x)
    normal = want.abs() > 1e-30  # representable in fp32 with some precision left
    got = decomp(torch.ones_like(x), x, approximate="tanh").double()
    err = (got - want).abs() / want.abs()
    # the floor of any fp32 evaluation: exp(2u) carries the rounding of 2u (|2u| up to 140 here), about
    # |2u| * 6e-8 relative
    assert float(err[normal & (x < -3)].max()) < 3e-5, float(err[normal & (x < -3)].max())
    assert float((got - want).abs().max()) < 3e-6  # absolute, everywhere (d lies within [-0.17, 1.13])
    huge = torch.tensor([-1e15, -1e10, 1e10, 1e15])
    assert torch.equal(decomp(torch.ones(4), huge, approximate="tanh"), torch.tensor([0.0, 0.0, 1.0, 1.0]))
    aten_form = torch.ops.aten.gelu_backward(torch.ones_like(x), x, approximate="tanh").double()
    assert float(((aten_form - want).abs() / want.abs())[x == -6.0]) == 1.0  # what the rewrite fixes

    # through a train build: the gradient of x on the negative tail, fp32, against float64
    model = GeluTail()
    xs = -torch.rand(512) * 6.0 - 3.0  # [-9, -3)
    res = aotfuse.build(model, (xs.clone().requires_grad_(),), train=True, targets=("sm_90",))
    mod = aotfuse.load(res.data, device="cpu").as_module()
    xs = -torch.rand(512) * 6.0 - 3.0
    xg = xs.clone().requires_grad_()
    mod(xg).backward()
    want = _gelu_tanh_grad64(xs)
    assert float(((xg.grad.double() - want).abs() / want.abs()).max()) < 3e-5


class TanhMlp(nn.Module):
    def __init__(self, d=32, h=48):
        super().__init__()
        self.fc, self.proj = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.proj(torch.tanh(self.fc(x))).float().pow(2).mean()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fast_tanh_exactly_where_every_stored_value_is_half(dtype):
    torch.manual_seed(2)
    model = TanhMlp().to(dtype)
    x = torch.randn(4, 8, 32, dtype=dtype)
    res = aotfuse.build(model, (x,), train=True, targets=("sm_90",))
    with_tanh = {n: s for n, s in _sources(res).items() if _tanh_calls(s)}
    assert with_tanh, "no kernel computes the tanh"
    half = dtype == torch.bfloat16
    assert all(("_tanh_fast(" in s) == half and ("libdevice.tanh(" in s) != half for s in with_tanh.values())
    mod = aotfuse.load(res.data, device="cpu").as_module()
    fresh = torch.randn(4, 8, 32, dtype=dtype)
    loss = mod(fresh)
    loss.backward()
    ref_model = copy.deepcopy(model)
    ref = ref_model(fresh)
    ref.backward()
    assert rel(loss, ref) < (2e-2 if half else 1e-5)
    ours = dict(mod.named_parameters())
    for n, p in ref_model.named_parameters():
        assert rel(ours[n].grad, p.grad) < (3e-2 if half else 1e-4), (n, rel(ours[n].grad, p.grad))


def test_fast_tanh_off_keeps_libdevice():
    model = TanhMlp().to(torch.bfloat16).eval()
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16)
    srcs = _sources(aotfuse.build(model, (x,), targets=("sm_90",)))
    assert any("_tanh_fast(" in _body(s) for s in srcs.values())
    with override(fast_tanh=False):
        srcs = _sources(aotfuse.build(model, (x,), targets=("sm_90",)))
    assert not any("_tanh_fast(" in _body(s) for s in srcs.values())
    assert any("libdevice.tanh(" in _body(s) for s in srcs.values())
