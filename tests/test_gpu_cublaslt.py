"""GPU tier (skipped without CUDA): matmul externs through prepared cuBLASLt calls (runtime/cublaslt.py)
give torch's results, alone and inside programs, eagerly and replayed from CUDA graphs."""
from __future__ import annotations

import pytest
import torch

import aotfuse
from aotfuse.contract.program import TensorRef
from aotfuse.runtime import cublaslt
from aotfuse.runtime.executor import _View

pytestmark = pytest.mark.gpu

# relative Frobenius error vs a float64 reference; torch.mm itself is well inside these
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def lt_call(target, tensors, out, policy=None, kwargs=None):
    """Run one extern through LtMatmul as an executor state would: each tensor its own slot, bound by
    its storage's address (static), the view's offset in elements."""
    views, addr, dtypes = [], [], {}
    for slot, t in enumerate(list(tensors) + [out]):
        if t is None:  # an absent optional operand (mm_residual's bias)
            views.append(None)
            addr.append(0)
            continue
        base = t.untyped_storage().data_ptr()
        views.append(_View(slot, TensorRef(f"b{slot}", tuple(t.shape), tuple(t.stride()), t.storage_offset())))
        addr.append(base)
        dtypes[slot] = t.dtype
    spec = cublaslt.derive(target, views[:-1], kwargs or {}, views[-1], dtypes)
    lib = cublaslt.library()
    handle = lib.take_handle(out.device.index or 0)
    try:
        key = policy or cublaslt.policy_key()
        plan = cublaslt.LtMatmul(lib, handle, spec, cublaslt.Policy(*key), dict(enumerate(addr)), 32 << 20)
        ws = torch.empty(plan.workspace_needed, dtype=torch.uint8, device=out.device)
        plan.use_workspace(ws.data_ptr() if plan.workspace_needed else 0, plan.workspace_needed)
        assert plan.run(torch.cuda.current_stream().cuda_stream, addr)
        torch.cuda.synchronize()
    finally:
        lib.give_handle(out.device.index or 0, handle)
    return spec, plan


def _forms(M, K, N, dt, g):
    """(name, target, operands, reference function): the operand layouts programs pass."""
    r = lambda *s: torch.randn(*s, device="cuda", dtype=dt, generator=g) / 4  # noqa: E731
    a, b, w, bias = r(M, K), r(K, N), r(N, K), r(N)
    at = r(K, M).t()  # column-major lhs
    big = r(M + 3, K + 5)
    return [
        ("rowmajor", "aten.mm.out", (a, b)),
        ("linear", "aten.mm.out", (a, w.t())),
        ("colmajor_lhs", "aten.mm.out", (at, b)),
        ("strided_slice", "aten.mm.out", (big[2:2 + M, 3:3 + K], w.t())),
        ("addmm_bias", "aten.addmm.out", (bias, a, w.t())),
    ]


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N", [(128, 128, 384), (1000, 128, 50257), (1, 64, 33), (37, 5, 1), (2, 768, 3072)])
def test_mm_and_addmm_match_torch(dt, M, K, N):
    g = torch.Generator(device="cuda").manual_seed(M + K + N)
    for name, target, ops in _forms(M, K, N, dt, g):
        big_out = torch.full((M, N + 7), float("nan"), device="cuda", dtype=dt)
        out = big_out[:, :N] if name == "strided_slice" else torch.empty(M, N, device="cuda", dtype=dt)
        spec, plan = lt_call(target, ops, out)
        if target == "aten.addmm.out":
            ref, ref64 = torch.addmm(*ops), torch.addmm(*(o.double() for o in ops))
        else:
            ref, ref64 = torch.mm(*ops), torch.mm(*(o.double() for o in ops))
        err, torch_err = rel(out, ref64), rel(ref, ref64)
        assert err <= max(TOL[dt], 2 * torch_err), (name, spec.describe(), err, torch_err)
        assert rel(out, ref) <= 2 * TOL[dt], (name, spec.describe())
        if name == "strided_slice":
            assert torch.isnan(big_out[:, N:]).all()  # nothing written outside the view


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N", [(128, 128, 512), (8192, 768, 3072), (1, 64, 33), (37, 5, 2)])
def test_addmm_gelu_epilogue_matches_torch(dt, M, K, N):
    """_addmm_activation(use_gelu=True) as GELU_BIAS (export/mm_gelu.py's extern): torch's CUDA op (the same
    epilogue, or addmm + gelu_(tanh)) and a float64 addmm + tanh GELU agree with it."""
    g = torch.Generator(device="cuda").manual_seed(M + K + N)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=dt, generator=g) / 4  # noqa: E731
    a, w, bias = r(M, K), r(N, K), r(N)
    out = torch.empty(M, N, device="cuda", dtype=dt)
    spec, plan = lt_call("aten._addmm_activation.out", (bias, a, w.t()), out, kwargs={"use_gelu": True})
    assert spec.gelu and "+gelu" in plan.record()["matmul"]
    ref = torch._addmm_activation(bias, a, w.t(), use_gelu=True)
    ref64 = torch.nn.functional.gelu(torch.addmm(bias.double(), a.double(), w.t().double()), approximate="tanh")
    err, torch_err = rel(out, ref64), rel(ref, ref64)
    assert err <= max(TOL[dt], 2 * torch_err), (spec.describe(), err, torch_err)
    assert rel(out, ref) <= 2 * TOL[dt], spec.describe()


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N", [(8192, 3072, 768), (128, 768, 768), (1, 64, 33), (37, 5, 2)])
@pytest.mark.parametrize("bias", [True, False])
def test_mm_residual_matches_float64(dt, M, K, N, bias):
    """aotfuse.mm_residual.out as one cublasLtMatmul (C = the residual, beta 1, BIAS epilogue): within the
    dtype's tolerance of float64, and of torch's addmm + add; a padded residual (its own leading dimension)."""
    g = torch.Generator(device="cuda").manual_seed(M + K + N)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=dt, generator=g) / 4  # noqa: E731
    a, w = r(M, K), r(N, K)
    b = r(N) if bias else None
    res_big = r(M, N + 8) * 8  # a residual stream larger than the product
    res = res_big[:, 3:3 + N]
    out = torch.empty(M, N, device="cuda", dtype=dt)
    spec, plan = lt_call("aotfuse.mm_residual.out", (a, w.t(), res, b), out)
    assert "+residual" in plan.record()["matmul"] and (("+bias" in plan.record()["matmul"]) == bias)
    ref = torch.addmm(res, a, w.t()) + (b if bias else 0)
    ref64 = torch.addmm(res.double(), a.double(), w.t().double()) + (b.double() if bias else 0)
    err, torch_err = rel(out, ref64), rel(ref, ref64)
    assert err <= max(TOL[dt], 2 * torch_err), (spec.describe(), err, torch_err)
    assert torch.equal(res_big[:, 3:3 + N], res)  # C is only read


class _Residual(torch.nn.Module):
    """Two residual adds fed by matmuls (a biased one and one without bias), as a transformer block's."""

    def __init__(self, d=64):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.out = torch.nn.Linear(d, d)
        self.proj = torch.nn.Linear(d, d, bias=False)

    def forward(self, x):
        x = x + self.out(self.ln(x))
        return self.ln(self.proj(self.ln(x)) + x)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_residual_programs_match_eager_in_graphs(dt):
    torch.manual_seed(0)
    model = _Residual().to(dt).eval()
    x = torch.randn(4, 32, 64, dtype=dt)
    res = aotfuse.build(model, (x,), targets=("sm_90",))
    model = model.cuda()
    for graphs in (False, True):
        art = aotfuse.load(res.data, device="cuda", cuda_graphs=graphs)
        for seed in (1, 2):
            xs = (torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(seed)) * 2 + 1).to(dt).cuda()
            with torch.no_grad():
                assert rel(art(xs), model(xs)) <= TOL[dt] * 4, (graphs, seed)
        rep = art.executors["forward"].matmul_report()
        assert sorted(r["target"] for r in rep) == ["aotfuse.mm_residual.out"] * 2, rep
        assert all(r["path"] == "cublaslt" and "+residual" in r["matmul"] for r in rep), rep
        art.close()


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_bmm_matches_torch(dt):
    g = torch.Generator(device="cuda").manual_seed(3)
    B, M, K, N = 8, 64, 32, 48
    q, k = torch.randn(B, M, K, device="cuda", dtype=dt, generator=g), torch.randn(B, N, K, device="cuda", dtype=dt,
                                                                                  generator=g)
    p = torch.randn(B, K, M, device="cuda", dtype=dt, generator=g)
    for lhs, rhs in ((q, k.transpose(1, 2)), (p.transpose(1, 2), k.transpose(1, 2)), (q, k.transpose(1, 2)[:, :, :7])):
        out = torch.empty(B, M, rhs.shape[2], device="cuda", dtype=dt)
        lt_call("aten.bmm.out", (lhs, rhs), out)
        ref64 = torch.bmm(lhs.double(), rhs.double())
        assert rel(out, ref64) <= max(TOL[dt], 2 * rel(torch.bmm(lhs, rhs), ref64))


def test_tf32_follows_torchs_setting():
    g = torch.Generator(device="cuda").manual_seed(5)
    a, b = torch.randn(256, 512, device="cuda", generator=g), torch.randn(512, 256, device="cuda", generator=g)
    ref64 = a.double() @ b.double()
    full, tf32 = torch.empty(256, 256, device="cuda"), torch.empty(256, 256, device="cuda")
    key = cublaslt.policy_key()
    lt_call("aten.mm.out", (a, b), full, policy=(False,) + key[1:])
    lt_call("aten.mm.out", (a, b), tf32, policy=(True,) + key[1:])
    assert rel(full, ref64) < 2e-6 and 2e-5 < rel(tf32, ref64) < 5e-3  # TF32 rounds inputs to 10 mantissa bits


class _Mats(torch.nn.Module):
    """mm (an input as operand), addmm kept (bias epilogue), mm + a fused bias add, and bmm."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 96) / 8)
        self.lin = torch.nn.Linear(96, 80)
        self.fc = torch.nn.Linear(80, 80)

    def forward(self, x):
        h = x @ self.w  # [32, 96]
        y = self.lin(h)  # addmm, consumed by an extern only: kept with its bias
        z = torch.relu(self.fc(y))  # mm + bias add fused with the relu
        zz = z.view(4, 8, 80)
        return torch.bmm(zz, zz.transpose(1, 2)), y


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_programs_take_cublaslt_eagerly_and_in_graphs(dt):
    torch.manual_seed(0)
    model = _Mats().to(dt).eval()
    x = torch.randn(32, 64, dtype=dt)
    data = aotfuse.build(model, (x,), targets=("sm_90",)).data
    model = model.cuda()
    for graphs in (False, True):
        art = aotfuse.load(data, device="cuda", cuda_graphs=graphs)
        for seed in (1, 2):  # the second call replays the graph with new inputs
            xs = torch.randn(32, 64, dtype=dt, generator=torch.Generator().manual_seed(seed)).cuda()
            with torch.no_grad():
                for o, r in zip(art(xs), model(xs)):
                    assert rel(o, r) <= TOL[dt] * 4, (graphs, seed)
        rep = art.executors["forward"].matmul_report()
        targets = sorted(r["target"] for r in rep)
        assert targets == ["aten.addmm.out", "aten.bmm.out", "aten.mm.out", "aten.mm.out"], rep
        assert all(r["path"] == "cublaslt" for r in rep), rep
        assert any("+bias" in r["matmul"] for r in rep)
        art.close()


def test_settings_change_rebinds_and_misaligned_input_takes_torch():
    torch.manual_seed(0)
    model = _Mats().eval()
    x = torch.randn(32, 64)
    art = aotfuse.load(aotfuse.build(model, (x,), targets=("sm_90",)).data, device="cuda", cuda_graphs=False)
    model = model.cuda()
    ex = art.executors["forward"]
    xs = x.cuda()
    with torch.no_grad():
        ref = model(xs)
        art(xs)
        st = ex._last_state()
        assert st.matmul_policy == cublaslt.policy_key()
        old = torch.backends.cuda.matmul.allow_tf32
        try:
            torch.backends.cuda.matmul.allow_tf32 = not old
            out = art(xs)
            assert st.matmul_policy[0] == (not old)  # re-bound for the new setting
            assert all(r["path"] == "cublaslt" for r in st.matmul_report())
            assert rel(out[1], ref[1]) < 5e-3
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
        # an input 16 bytes past a 256-byte boundary (the guards allow it): that call's first mm takes
        # torch's binding, counted, with the same result
        base = torch.empty(32 * 64 + 4, device="cuda")
        xm = base[4:].view(32, 64)
        xm.copy_(xs)
        assert xm.data_ptr() % 256 == 16
        out = art(xm)
        for o, r in zip(out, ref):
            assert rel(o, r) < 1e-5
        rep = ex.matmul_report()
        assert sum(r.get("torch_calls_misaligned", 0) for r in rep) == 1, rep
    art.close()


def test_cublaslt_off_keeps_torch_bindings():
    from aotfuse.knobs import override

    model = _Mats().eval()
    x = torch.randn(32, 64)
    data = aotfuse.build(model, (x,), targets=("sm_90",)).data
    with override(cublaslt=False):
        art = aotfuse.load(data, device="cuda", cuda_graphs=False)
        with torch.no_grad():
            out = art(x.cuda())
    rep = art.executors["forward"].matmul_report()
    assert all(r["path"] == "torch" and r["why"] == "AOTFUSE_CUBLASLT=0" for r in rep), rep
    with torch.no_grad():
        for o, r in zip(out, model.cuda()(x.cuda())):
            assert rel(o, r) < 1e-5
