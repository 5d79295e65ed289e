"""Structural selects (emit/predicate.py): a concatenation's branches load under their predicate with the
clamps the predicate decides dropped, so the loads vectorize; numerics match eager; a data-dependent or
clamp-free select is left alone."""
from __future__ import annotations

import pytest
import sympy
import torch

import aotfuse
from aotfuse.knobs import override
from aotfuse.emit.predicate import condition_bounds, index_only, merge, resolve_clamps
from aotfuse.ir.indexing import ModIdx
from aotfuse.ir.loop import Const, IndexValue, Load, Op
from aotfuse.runtime.payload import read_sources
from aotfuse.runtime.resources import kernel_resources

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
X = sympy.Symbol("x", integer=True, nonnegative=True)


def test_bounds_and_clamp_resolution():
    u = ModIdx(X, sympy.Integer(2304))
    lt = Op("lt", (IndexValue(u, "int64"), Const(768, "int64")), "bool")
    assert index_only(lt) and not index_only(Op("lt", (Load("a", X, "float32"), Const(0, "float32")), "bool"))
    assert condition_bounds(lt, True) == {u: (None, 767)} and condition_bounds(lt, False) == {u: (768, None)}
    second = merge(condition_bounds(lt, False), condition_bounds(
        Op("lt", (IndexValue(u, "int64"), Const(1536, "int64")), "bool"), True))
    assert second == {u: (768, 1535)}
    ext = {X: 18874368}
    assert resolve_clamps(768 * (X // 2304) + sympy.Min(767, u), {u: (None, 767)}, ext) == 768 * (X // 2304) + u
    clamped = sympy.Max(0, sympy.Min(767, u - 768))
    assert resolve_clamps(clamped, second, ext) == u - 768
    assert resolve_clamps(clamped, {u: (None, 767)}, ext) != u - 768  # not decided: kept (still in bounds)
    assert resolve_clamps(clamped, {}, ext) == clamped


class _Cat(torch.nn.Module):
    def forward(self, a, b, c):
        return torch.cat([a * 2, b, c + 1], dim=1)


class _Causal(torch.nn.Module):
    def forward(self, x):  # a select whose condition is positional but whose load needs no clamp
        return torch.tril(x) + 1


def test_cat_loads_vectorize_and_match_eager():
    args = (torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(64, 512, dtype=torch.bfloat16),
            torch.randn(64, 128, dtype=torch.bfloat16))
    with override(predicated_selects=False):  # the knob off: every branch loaded with clamped indices
        off = aotfuse.build(_Cat(), args, targets=("sm_90",))
    src_off = "\n".join(read_sources(*(lambda a: (a.archive, a.kernels))(aotfuse.load(off.data, device="cpu"))).values())
    assert "tl.minimum" in src_off
    res = aotfuse.build(_Cat(), args, targets=("sm_90",))  # the default
    art = aotfuse.load(res.data, device="cpu")
    src = "\n".join(read_sources(art.archive, art.kernels).values())
    assert "tl.minimum" not in src and "tl.maximum" not in src  # every clamp decided by its predicate
    res_use = kernel_resources(art.kernels, "sm_90")
    assert not isinstance(res_use, str)
    (only,) = res_use.values()
    assert only.loads and only.loads[0][0] == 16 and all(w == 16 for w, _ in only.loads)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        xs = tuple(torch.randn(t.shape, generator=g).to(t.dtype) for t in args)
        torch.testing.assert_close(art(*xs), _Cat()(*xs), rtol=0, atol=0)


def test_selects_without_clamps_are_not_predicated():
    x = torch.randn(32, 32)
    with override(predicated_selects=True):
        res = aotfuse.build(_Causal(), (x,), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    src = "\n".join(read_sources(art.archive, art.kernels).values())
    assert "xmask & " not in src  # the load keeps its plain mask: one vector, not split by the triangle
    xs = torch.randn(32, 32)
    torch.testing.assert_close(art(xs), _Causal()(xs))


class ShiftMask(torch.nn.Module):
    """torchvision's shifted-window attention mask: a zero [8, 8] grid filled slice by slice with region ids (3 x 3
    slices). In the joint graph a branch of the fill read one constant element under a block mask, which Triton
    refuses (a scalar pointer with a block mask); the pointer is now a block."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        m = x.new_zeros((8, 8))
        sl = ((0, -4), (-4, -2), (-2, None))
        c = 0
        for h in sl:
            for w in sl:
                m[h[0]:h[1], w[0]:w[1]] = c
                c += 1
        return (x * self.w + m).square().mean()


def test_constant_element_under_a_branch_mask_trains():
    from aotfuse.testing.train_check import assert_training_matches

    torch.manual_seed(0)
    model = ShiftMask().train()
    res = aotfuse.build(model, (torch.randn(8, 8),), train=True, targets=("sm_90",))
    assert_training_matches(res.data, model, (torch.randn(8, 8),))
