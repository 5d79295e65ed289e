"""A mixture of experts run grouped (transformers' default experts): aotfuse::grouped_mm against a per-group loop
(both of its forms, empty groups, rows past the last offset, transposed and strided operands), the host and the
device formulations alike, and a routed MoE layer written with aten._grouped_mm and histc built for inference and
training against eager (tests/test_zoo_more.py's Mixtral runs transformers' own, float32 and through the rewrite)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import aotfuse
from aotfuse.errors import ArchiveError, UnsupportedOpError
from aotfuse.runtime import grouped_mm as gm
from aotfuse.testing.opcases import RoutedExperts, RoutedLoss
from aotfuse.testing.train_check import assert_half_training_close


def _reference(a, b, offs):
    """Group by group in float64, rows (columns) past the last offset zero."""
    a64, b64 = a.double(), b.double()
    ends = [int(x) for x in offs]
    if b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
        start = 0
        for e, end in enumerate(ends):
            out[start:end] = a64[start:end] @ b64[e]
            start = end
        return out
    out = torch.zeros(len(ends), a.shape[0], b.shape[1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends):
        out[e] = a64[:, start:end] @ b64[start:end]
        start = end
    return out


CASES = {
    # (S, K, N, group sizes); the sizes may leave rows past the end (expert-parallel sentinels)
    "even": (12, 8, 16, [3, 3, 3, 3]),
    "empty_groups": (10, 8, 4, [0, 7, 0, 3]),
    "tail_rows": (11, 4, 8, [2, 5, 1]),
    "one_group": (5, 16, 8, [5]),
}


@pytest.mark.parametrize("form", ["rows", "weight_grad"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("path", ["host", "device"])
def test_grouped_mm_matches_group_loop(case, form, path):
    torch.manual_seed(0)
    s, k, n, sizes = CASES[case]
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if form == "rows":
        a = torch.randn(s, k)
        b = torch.randn(len(sizes), n, k).transpose(-2, -1)  # transformers' layout: [E, out, in] transposed
    else:
        a = torch.randn(s, k).t()  # input^T: [K, S], columns grouped
        b = torch.randn(s, n)
    fn = gm._on_host if path == "host" else gm._on_device
    got = fn(a, b, offs)
    want = _reference(a, b, offs)
    assert got.shape == want.shape == tuple(gm.result_shape(tuple(a.shape), tuple(b.shape), tuple(offs.shape)))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # the op on the CPU dispatches to the host form; int64 offsets mean the same
    torch.testing.assert_close(gm.grouped_mm(a, b, offs.long()), gm._on_host(a, b, offs), rtol=0, atol=0)


def test_grouped_mm_rejects_mismatched_operands():
    offs = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="groups"):
        gm.grouped_mm(torch.randn(4, 8), torch.randn(3, 8, 4), offs)  # 3 groups, 2 offsets
    with pytest.raises(RuntimeError, match="jagged"):
        gm.grouped_mm(torch.randn(8, 4), torch.randn(5, 6), offs)
    with pytest.raises(RuntimeError, match="float64"):
        gm.grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 4, dtype=torch.float64), offs)


# torch.export takes aten._grouped_mm in bf16 only (its shape function refuses other dtypes): the layer in bf16,
# checked against eager in float32 (transformers' float32 experts take its fallback op: tests/test_zoo_more.py)
BF16 = torch.bfloat16


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def test_routed_experts_inference_matches_eager():
    torch.manual_seed(0)
    model = RoutedExperts().eval()
    res = aotfuse.build(model.to(BF16), (torch.randn(24, 16, dtype=BF16),), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    x = torch.randn(24, 16, dtype=BF16)  # fresh inputs: another routing than the example's
    ref32 = RoutedExperts().eval()
    ref32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    want32, eager = ref32(x.float()), model(x)
    assert _rel(art(x), want32) <= max(2e-2, 2 * _rel(eager, want32))
    targets = [getattr(i, "target", None) for i in art.programs["forward"].instructions]
    assert targets.count("aotfuse.grouped_mm.default") == 2 and targets.count("aten.histc.default") == 1


def test_routed_experts_training_matches_eager():
    torch.manual_seed(1)
    model = RoutedLoss().to(BF16)
    res = aotfuse.build(model, (torch.randn(24, 16, dtype=BF16),), train=True, targets=("sm_90",))
    assert_half_training_close(res.data, model, (torch.randn(24, 16, dtype=BF16),))


def test_histc_with_the_range_from_the_data_is_refused():
    class Counts(nn.Module):
        def forward(self, x):
            return x * torch.histc(x.argmax(-1).float(), bins=4).sum()

    with pytest.raises(UnsupportedOpError, match="min == max"):
        aotfuse.build(Counts(), (torch.randn(8, 4),), targets=("sm_90",))


def test_archive_validation_checks_grouped_operands():
    """A program whose grouped matmul does not fit its output view is refused at load, before anything runs."""
    from aotfuse.runtime.validate_extern import _Ref, _meta_check

    a = _Ref("a", "float32", (6, 8), (8, 1))
    b = _Ref("b", "float32", (2, 8, 4), (32, 4, 1))
    offs = _Ref("o", "int32", (2,), (1,))
    _meta_check(gm.grouped_mm, [a, b, offs], {}, {"shape": [6, 4]}, "float32", "here")
    with pytest.raises(ArchiveError):
        _meta_check(gm.grouped_mm, [a, b, offs], {}, {"shape": [6, 8]}, "float32", "here")
    with pytest.raises(ArchiveError):
        _meta_check(gm.grouped_mm, [a, b, _Ref("o", "float32", (2,), (1,))], {}, {"shape": [6, 4]}, "float32",
                    "here")
