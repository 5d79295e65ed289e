"""Row reductions held in registers issue their per-column loads (a norm's weight and bias) before the
first reduction (knob hoist_loads): the kernel source's order, the explain line, numerics against eager
on the CPU path (Triton interpreter) in every mode, and a typed error for an unknown mode."""
from __future__ import annotations

import msgpack
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.errors import BuildError
from aotfuse.knobs import override
from aotfuse.runtime.explain import explain_report

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


class AddNorm(nn.Module):
    """LayerNorm(x + r) * w + b over rows of an odd length, the kind the hoisting was measured on."""

    def __init__(self, n: int, dtype):
        super().__init__()
        self.ln = nn.LayerNorm(n, dtype=dtype)
        with torch.no_grad():
            self.ln.weight.copy_(torch.randn(n, dtype=dtype))
            self.ln.bias.copy_(torch.randn(n, dtype=dtype))

    def forward(self, x, r):
        return self.ln(x + r)


def _sources(res) -> list[str]:
    art = aotfuse.load(res.data, device="cpu")
    return list(msgpack.unpackb(bytes(art.archive.part("sources"))).values())


def _load_lines(src: str) -> list[str]:
    return [ln.strip() for ln in src.splitlines() if "tl.load(" in ln or "tl.sum(" in ln]


@pytest.mark.parametrize("mode", ["columns", "all", "off"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modes_match_eager(mode, dtype):
    torch.manual_seed(3)
    model = AddNorm(197, dtype).eval()
    x, r = torch.randn(24, 197, dtype=dtype), torch.randn(24, 197, dtype=dtype)
    with override(hoist_loads=mode):
        res = aotfuse.build(model, (x, r), targets=("sm_90",))
    (src,) = _sources(res)
    seq = _load_lines(src)
    first_sum = next(i for i, ln in enumerate(seq) if "tl.sum(" in ln)
    before = [ln for ln in seq[:first_sum] if "tl.load(" in ln]
    column_loads = [ln for ln in before if "rmask, other=0" in ln and "xmask" not in ln]
    row_loads = [ln for ln in before if "xmask & rmask" in ln]
    assert len(row_loads) == 2, src  # x and r are read for the first sum in every mode
    assert len(column_loads) == (0 if mode == "off" else 2), src
    text = explain_report(res.report)
    assert ("issued before the first reduction" in text) == (mode != "off"), text
    art = aotfuse.load(res.data, device="cpu")
    got = art(x, r)
    want = F.layer_norm((x + r).float(), (197,), model.ln.weight.float(), model.ln.bias.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((got.float() - want).abs().max()) < tol * float(want.abs().max())


def test_columns_mode_leaves_the_row_loads_where_they_are():
    """A later row load (the second phase's) stays after the first reduction in "columns", moves up in "all"."""

    class Mixed(nn.Module):
        def forward(self, x, y, w):
            m = x.float().mean(-1, keepdim=True)
            return ((x.float() - m) * y.float() * w.float()).to(x.dtype)

    x, y, w = torch.randn(16, 100), torch.randn(16, 100), torch.randn(100)
    pos = {}
    for mode in ("columns", "all"):
        with override(hoist_loads=mode):
            res = aotfuse.build(Mixed(), (x, y, w), targets=("sm_90",))
        (src,) = _sources(res)
        seq = _load_lines(src)
        first_sum = next(i for i, ln in enumerate(seq) if "tl.sum(" in ln)
        y_at = next(i for i, ln in enumerate(seq) if "in_ptr1 +" in ln)
        pos[mode] = y_at < first_sum
        got = aotfuse.load(res.data, device="cpu")(x, y, w)
        assert torch.allclose(got, Mixed()(x, y, w), atol=1e-5, rtol=1e-5)
    assert pos == {"columns": False, "all": True}


def test_unknown_mode_is_a_typed_error():
    with override(hoist_loads="sideways"), pytest.raises(BuildError, match="AOTFUSE_HOIST_LOADS"):
        aotfuse.build(AddNorm(64, torch.float32), (torch.randn(4, 64), torch.randn(4, 64)), targets=("sm_90",))
