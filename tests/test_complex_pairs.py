"""Complex values computed as real pairs (export/complex.py): the complex rotary embedding of Meta's Llama reference
code (a complex buffer of rotations, view_as_complex, a product, view_as_real) in inference and training, the
other supported ops (polar, conj, real/imag, sums, cat, permutes, slices, scaling), and the refusals: an op with
no pair form, a complex result, a complex input. transformers' Llama 4 and DeepSeek-V2 use the same rotary and
stopped at lowering with "dtype torch.complex64" before (tests/test_zoo_more.py's survey notes)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.errors import AotfuseError, UnsupportedOpError
from aotfuse.testing.train_check import assert_training_matches


def _rotations(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def _rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * rot.view(1, z.shape[1], 1, z.shape[-1])).flatten(3).type_as(x)


class RotaryAttention(nn.Module):
    """Meta's Llama reference attention: q and k rotated as complex pairs by a complex buffer, causal sdpa."""

    def __init__(self, d=32, heads=4, seq=16):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.heads = heads
        self.register_buffer("rot", _rotations(d // heads, 2 * seq), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, -1) for w in (self.wq, self.wk, self.wv))
        q, k = _rotate(q, self.rot[:t]), _rotate(k, self.rot[:t])
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return o.transpose(1, 2).reshape(b, t, d)


class RotaryLoss(RotaryAttention):
    def forward(self, x):
        return super().forward(x).pow(2).mean()


def test_rotary_inference_matches_eager():
    torch.manual_seed(0)
    model = RotaryAttention().eval()
    art = aotfuse.load(aotfuse.build(model, (torch.randn(2, 16, 32),), targets=("sm_90",)).data, device="cpu")
    x = torch.randn(2, 16, 32)
    torch.testing.assert_close(art(x), model(x), rtol=1e-5, atol=1e-5)
    assert not any("complex" in str(w.dtype) for w in art.weights.values())  # the rotations stored as pairs


def test_rotary_bf16_inference_close_to_eager():
    torch.manual_seed(1)
    model = RotaryAttention().eval().to(torch.bfloat16)
    art = aotfuse.load(aotfuse.build(model, (torch.randn(2, 16, 32, dtype=torch.bfloat16),),
                                     targets=("sm_90",)).data, device="cpu")
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    ref32 = RotaryAttention().eval()
    ref32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    want = ref32(x.float()).detach().double()

    def rel(a):
        return float((a.detach().double() - want).norm() / want.norm())

    assert rel(art(x)) <= max(2e-2, 2 * rel(model(x)))


def test_rotary_training_matches_eager():
    torch.manual_seed(2)
    model = RotaryLoss()
    res = aotfuse.build(model, (torch.randn(2, 16, 32),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(2, 16, 32),))


class ComplexOps(nn.Module):
    """polar from the data, a complex product, sum and difference, conj, scaling by a real tensor and a number,
    cat, permute, slice, unsqueeze, real and imag: every pair form, one forward."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4, 2))

    def forward(self, x, y):
        z = torch.polar(x.abs() + 0.5, y)  # [3, 4]
        w = torch.view_as_complex(self.w)  # [3, 4]
        p = z * w
        s = (z + w).conj() - p * 2.0
        r = torch.cat([p, s * x], dim=1).permute(1, 0)[1:6].unsqueeze(0)  # [1, 5, 3]
        return torch.view_as_real(r).sum(-1) + r.real * r.imag


def test_complex_ops_match_eager_in_inference_and_training():
    torch.manual_seed(3)
    model = ComplexOps()
    ex = (torch.randn(3, 4), torch.randn(3, 4))
    art = aotfuse.load(aotfuse.build(model, ex, targets=("sm_90",)).data, device="cpu")
    fresh = (torch.randn(3, 4), torch.randn(3, 4))
    torch.testing.assert_close(art(*fresh), model(*fresh), rtol=1e-5, atol=1e-5)

    class Loss(ComplexOps):
        def forward(self, x, y):
            return super().forward(x, y).pow(2).mean()

    loss = Loss()
    loss.load_state_dict(model.state_dict())
    res = aotfuse.build(loss, ex, train=True, targets=("sm_90",))
    assert_training_matches(res.data, loss, fresh)


def test_complex_op_without_a_pair_form_is_refused_by_name():
    class Exp(nn.Module):
        def forward(self, x):
            return torch.view_as_real(torch.exp(torch.view_as_complex(x)))

    with pytest.raises(UnsupportedOpError, match="aten.exp.default") as e:
        aotfuse.build(Exp(), (torch.randn(4, 2),), targets=("sm_90",))
    assert "real pairs" in str(e.value) and e.value.remedy


def test_complex_result_and_complex_input_are_refused():
    class Out(nn.Module):
        def forward(self, x):
            return torch.view_as_complex(x) * 2

    with pytest.raises(UnsupportedOpError, match="complex result"):
        aotfuse.build(Out(), (torch.randn(4, 2),), targets=("sm_90",))

    class In(nn.Module):
        def forward(self, z):
            return torch.view_as_real(z * 2)

    with pytest.raises(AotfuseError, match="complex"):
        aotfuse.build(In(), (torch.randn(4, dtype=torch.complex64),), targets=("sm_90",))


def test_real_made_complex_broadcast_parts_and_complex_scalars():
    """x.to(complex64) (imaginary part 0), torch.complex of parts that broadcast, products with complex numbers."""
    class Mixed(nn.Module):
        def forward(self, x, y):
            z = x.to(torch.complex64) * torch.view_as_complex(y)
            w = torch.complex(x, y[..., 0].mean(0))
            return torch.view_as_real(z * 1j + w * (2 - 0.5j))

    model = Mixed()
    art = aotfuse.load(aotfuse.build(model, (torch.randn(3, 4), torch.randn(3, 4, 2)), targets=("sm_90",)).data,
                       device="cpu")
    x, y = torch.randn(3, 4), torch.randn(3, 4, 2)
    torch.testing.assert_close(art(x, y), model(x, y), rtol=1e-5, atol=1e-5)
