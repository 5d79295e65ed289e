"""A mixture of experts run grouped (transformers' default experts): aotfuse::grouped_mm against a per-group loop
(both of its forms, empty groups, rows past the last offset, transposed and strided operands), the host and the
device formulations alike, and a routed MoE layer written with aten._grouped_mm and histc built for inference and
training against eager (tests/test_zoo_more.py's Mixtral runs transformers' own, float32 and through the rewrite)."""
from __future__ import annotations

import copy

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
    # several chunks (the device form cuts the rows into chunks of max(64, S / E)): groups across chunk
    # boundaries, empty ones, many small ones beside a long one, rows past the end
    "chunks": (300, 8, 16, [70, 0, 130, 60, 40]),
    "small_and_long": (270, 8, 8, [1, 0, 2, 1, 1, 3, 0, 1, 1, 2, 250]),
    "chunks_tail": (200, 16, 8, [64, 64, 30]),
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


@pytest.mark.parametrize("seed", range(12))
def test_device_form_matches_group_loop_on_random_groupings(seed):
    """Random sizes (zeros among them), random totals (rows past the end), both forms, against float64."""
    g = torch.Generator().manual_seed(seed)
    experts = int(torch.randint(1, 12, (1,), generator=g))
    s = int(torch.randint(1, 400, (1,), generator=g))
    sizes = torch.randint(0, 3, (experts,), generator=g) * torch.randint(0, 80, (experts,), generator=g)
    sizes = (sizes.float() * (s / max(1, int(sizes.sum()))) * 0.9).long()  # leaves some rows past the end
    offs = sizes.cumsum(0).to(torch.int32)
    a, w = torch.randn(s, 8, generator=g), torch.randn(experts, 8, 5, generator=g)
    torch.testing.assert_close(gm._on_device(a, w, offs).double(), _reference(a, w, offs), rtol=1e-5, atol=1e-5)
    at, b = torch.randn(6, s, generator=g), torch.randn(s, 7, generator=g)
    torch.testing.assert_close(gm._on_device(at, b, offs).double(), _reference(at, b, offs), rtol=1e-5, atol=1e-5)


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


# ---------------------------------------------------------------- GPU tier

def _cuda_operands(case, form, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    s, k, n, sizes = CASES[case]
    if form == "rows":
        a = torch.randn(s, k, generator=g)
        b = torch.randn(len(sizes), n, k, generator=g).transpose(-2, -1)
    else:
        a = torch.randn(s, k, generator=g).t()
        b = torch.randn(s, n, generator=g)
    return a.to(dtype), b.to(dtype)


def _offsets(sizes, perm_seed=None):
    if perm_seed is not None:  # the same total, another split among the groups (another routing)
        g = torch.Generator().manual_seed(perm_seed)
        cuts = sorted(torch.randint(0, sum(sizes) + 1, (len(sizes) - 1,), generator=g).tolist())
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [sum(sizes)])]
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _close_where_defined(got, a, b, offs, dtype):
    """Against the float64 group loop: bf16 within 1e-2 of its norm, float32 within 1e-5; the rows past the last
    offset (left as torch's bf16 kernel finds them) not compared."""
    want = _reference(a.float().cpu(), b.float().cpu(), offs.cpu())
    got = got.double().cpu()
    if b.dim() == 3:
        end = int(offs[-1])
        got, want = got[:end], want[:end]
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert float((got - want).norm()) <= tol * float(want.norm()) + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("form", ["rows", "weight_grad"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_mm_on_cuda_in_a_graph(case, form, dtype):
    """Both CUDA paths (torch's bf16 kernel; the masked form otherwise) match the group loop, and a CUDA graph that
    captured the call gives the right result after the offsets change on the device: no host sync, no size fixed
    at capture."""
    a, b = (t.cuda() for t in _cuda_operands(case, form, dtype, 0))
    offs = _offsets(CASES[case][3]).cuda()
    _close_where_defined(gm.grouped_mm(a, b, offs), a, b, offs, dtype)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gm.grouped_mm(a, b, offs)
    for seed in (1, 2):
        offs.copy_(_offsets(CASES[case][3], perm_seed=seed))
        graph.replay()
        _close_where_defined(out, a, b, offs, dtype)


@pytest.mark.gpu
def test_routed_experts_on_cuda_training_and_graphs():
    """The routed layer in bf16 on the GPU: training against eager (float32 reference), and inference with CUDA
    graphs on inputs that route differently each call."""
    torch.manual_seed(3)
    model = RoutedLoss().to(BF16)
    res = aotfuse.build(model, (torch.randn(24, 16, dtype=BF16),), train=True, targets=("sm_90",))
    mod = aotfuse.load(res.data, device="cuda").as_module()
    # the float32 reference on the CPU (torch's CUDA grouped kernel takes bf16 only), bf16 eager on the GPU
    ref, ref32 = copy.deepcopy(model).cuda(), copy.deepcopy(model).float()
    x = torch.randn(24, 16, dtype=BF16)
    loss, want, want32 = mod(x.cuda()), ref(x.cuda()), ref32(x.float())
    for t in (loss, want, want32):
        t.backward()
    assert _rel(loss.cpu(), want32) <= max(2e-2, 2 * _rel(want.cpu(), want32))
    got = dict(mod.named_parameters())
    for (name, p), p32 in zip(ref.named_parameters(), ref32.parameters()):
        ours, eager = _rel(got[name].grad.cpu(), p32.grad), _rel(p.grad.cpu(), p32.grad)
        assert torch.isfinite(got[name].grad).all() and ours <= max(2e-2, 2 * eager), (name, ours, eager)
    layer = RoutedExperts().to(BF16).eval()
    art = aotfuse.load(aotfuse.build(layer, (torch.randn(24, 16, dtype=BF16),), targets=("sm_90",)).data,
                       device="cuda", cuda_graphs=True)
    ref32 = RoutedExperts().eval()
    ref32.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    for seed in (4, 5, 6):
        x = torch.randn(24, 16, dtype=BF16, generator=torch.Generator().manual_seed(seed))
        want32, eager = ref32(x.float()), layer(x)
        assert _rel(art(x.cuda()).cpu(), want32) <= max(2e-2, 2 * _rel(eager, want32))


def test_kernel_layout_keeps_aligned_operands_and_reorders_the_rest():
    """torch's CUDA kernel wants one unit stride and the other a 16-byte multiple: an operand that has them is
    passed as it is, one that has not is copied into the order that has them, and one no order suits (too few
    elements along both dims) sends the call to the device form."""
    bf = torch.bfloat16
    w = torch.randn(4, 24, 16, dtype=bf).transpose(-2, -1)  # [E, 16, 24], column-major: strides 16-byte multiples
    assert gm._kernel_layout(w) is w
    odd = torch.randn(11, 16, dtype=bf).t()  # [16, 11] with row stride 1 and column stride 16: fine as it is
    assert gm._kernel_layout(odd) is odd
    narrow = torch.randn(16, 12, dtype=bf)[:, :4]  # [16, 4] with row stride 12 elements (24 bytes): copied
    moved = gm._kernel_layout(narrow)
    assert moved is not narrow and torch.equal(moved, narrow) and moved.stride() == (1, 16)
    assert gm._kernel_layout(torch.randn(6, 4, dtype=bf)) is None


def test_routed_experts_with_a_dynamic_token_count():
    """One archive at several token counts (tokens 2..64): the routed rows, the histogram's input and every
    grouped matmul's jagged dim are expressions of the dim; the inverse permutation's empty_like lowers too."""
    torch.manual_seed(5)
    model = RoutedExperts().to(BF16).eval()
    tokens = torch.export.Dim("tokens", min=2, max=64)
    res = aotfuse.build(model, (torch.randn(24, 16, dtype=BF16),), targets=("sm_90",),
                        dynamic_shapes=({0: tokens},))
    art = aotfuse.load(res.data, device="cpu")
    ref32 = RoutedExperts().eval()
    ref32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    for t in (2, 5, 24, 64):
        x = torch.randn(t, 16, dtype=BF16)
        want32 = ref32(x.float())
        assert _rel(art(x), want32) <= max(2e-2, 2 * _rel(model(x), want32)), t


@pytest.mark.parametrize("path", ["host", "device"])
def test_a_bad_value_stays_in_its_group(path):
    """An inf in one group's rows (or in a row past the last offset) leaves every other group's result finite, as
    the per-group loop does: both operands' other rows are dropped before the product, never multiplied by 0."""
    fn = gm._on_host if path == "host" else gm._on_device
    offs = torch.tensor([50, 150], dtype=torch.int32)
    a, b = torch.randn(2, 200), torch.randn(200, 3)
    b[60] = float("inf")  # group 1's
    b[170] = float("inf")  # past the end
    out = fn(a, b, offs)
    assert torch.isfinite(out[0]).all()
    rows, w = torch.randn(200, 4), torch.randn(2, 4, 3)
    rows[60] = float("inf")
    out = fn(rows, w, offs)
    assert torch.isfinite(out[:50]).all() and torch.isfinite(out[150:]).all()


def test_device_form_edge_cases():
    """No rows at all; float64 kept at float64 precision in the weight gradient's sums."""
    offs = torch.tensor([0, 0], dtype=torch.int32)
    assert gm._on_device(torch.randn(0, 4), torch.randn(2, 4, 3), offs).shape == (0, 3)
    assert torch.equal(gm._on_device(torch.randn(5, 0), torch.randn(0, 3), offs), torch.zeros(2, 5, 3))
    offs = torch.tensor([90, 300], dtype=torch.int32)
    a, b = torch.randn(7, 300, dtype=torch.float64), torch.randn(300, 5, dtype=torch.float64)
    torch.testing.assert_close(gm._on_device(a, b, offs), _reference(a, b, offs), rtol=1e-12, atol=1e-12)


def test_kernel_layout_copies_a_misaligned_operand():
    base = torch.randn(64 * 32 + 1, dtype=torch.bfloat16)
    t = base[1:].view(64, 32)  # contiguous, its data 2 bytes past a 16-byte boundary
    assert t.data_ptr() % 16 != 0
    moved = gm._kernel_layout(t)
    assert moved.data_ptr() % 16 == 0 and torch.equal(moved, t)
