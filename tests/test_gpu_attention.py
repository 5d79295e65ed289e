"""GPU tier (skipped without CUDA): training's fused attention ops on CUDA, each kernel they pick.

`aotfuse::attention` / `aotfuse::attention_backward` (runtime/attention.py) pick cuDNN attention on sm_90 /
sm_100 with cuDNN > 9.15 (fp16/bf16, head dim <= 128), else flash (no mask, T == S when causal), else the
memory-efficient kernel. Every case is checked against a float64 sdpa on the same inputs: out, the contract's
logsumexp and the three gradients, each no further from it than twice eager sdpa's own error (plus a floor).
q, k, v are views of one packed projection, as programs pass them (storage [B, T, H, E]).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from aotfuse.runtime import attention as A

pytestmark = pytest.mark.gpu

CASES = {  # name: (B, H, Hk, T, S, E, causal, mask)
    "causal": (2, 4, 4, 256, 256, 64, True, None),
    "causal_T1000": (2, 4, 4, 1000, 1000, 64, True, None),
    "causal_padding_mask": (2, 4, 4, 200, 200, 64, False, "bool"),
    "gqa_causal": (2, 4, 2, 256, 256, 64, True, None),
    "gqa_mask_T1000": (2, 4, 2, 1000, 1000, 64, False, "bool"),
    "float_mask_odd_S": (2, 4, 4, 100, 100, 64, False, "float"),  # S % 8 != 0: the bias is padded
    "causal_cross": (2, 4, 4, 64, 128, 64, True, None),  # T != S: sdpa's causal mask is aligned top left
    "head_dim_128": (1, 2, 2, 300, 300, 128, True, None),
}


def _cudnn_expected() -> bool:
    major, _ = torch.cuda.get_device_capability()
    return (major in (9, 10) and torch.backends.cudnn.is_available()
            and torch.backends.cudnn.version() > A._CUDNN_MIN_VERSION and torch.backends.cuda.cudnn_sdp_enabled())


def _inputs(case, dtype, seed=0):
    b, h, hk, t, s, e, _, mask = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    # one packed projection [B, T, (H + 2 Hk) E] (T == S here, else separate q and kv buffers), as GPT's qkv
    qb = torch.randn(b, t, h * e, device="cuda", dtype=dtype, generator=g)
    kvb = torch.randn(b, s, 2 * hk * e, device="cuda", dtype=dtype, generator=g)
    q = qb.view(b, t, h, e).transpose(1, 2)
    k, v = kvb.view(b, s, 2, hk, e).unbind(2)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    m = None
    if mask == "bool":  # causal and padding: the second sequence's last quarter is padding
        keep = torch.ones(b, s, dtype=torch.bool, device="cuda")
        keep[1, 3 * s // 4:] = False
        m = torch.ones(t, s, dtype=torch.bool, device="cuda").tril() & keep[:, None, None, :]
    elif mask == "float":
        m = torch.randn(b, 1, t, s, device="cuda", dtype=dtype, generator=g)
    grad = torch.randn(b, t, h, e, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    return q, k, v, m, grad


def _sdpa_grads(q, k, v, m, grad, causal, gqa):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=gqa)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def _lse64(q, k, m, causal, scale):
    rep = q.shape[1] // k.shape[1]
    s = (q.double() @ k.double().repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if m is not None:
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
    return torch.logsumexp(s, -1)


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _check(name, dtype, want_kernel):
    case = CASES[name]
    b, h, hk, t, _, e, causal, _ = case
    q, k, v, m, grad = _inputs(case, dtype)
    gqa, scale = hk != h, e ** -0.5
    out, lse = A.attention(q, k, v, m, causal, scale, gqa)
    key = (q.shape, k.shape, q.dtype, q.get_device(), m is not None, causal, 0)
    assert A.chosen_kernels()[key] == want_kernel
    # the contract: out [B, H, T, E] laid out [B, T, H, E] (what the meta kernel says), lse float32 [B, H, T]
    meta_out, meta_lse = A.attention(*(x.to("meta") for x in (q, k, v)), None if m is None else m.to("meta"),
                                     causal, scale, gqa)
    assert out.shape == meta_out.shape and out.stride() == meta_out.stride()
    assert lse.shape == (b, h, t) and lse.dtype == torch.float32 and lse.stride() == meta_lse.stride()
    grads = A.attention_backward(grad, q, k, v, m, out, lse, causal, scale, gqa)
    for x, want in zip(grads, (q, k, v)):
        assert x.shape == want.shape and x.dtype == dtype
        assert x.stride() == x.transpose(1, 2).contiguous().transpose(1, 2).stride()  # [B, T, H, E] storage
    _against_float64(name, dtype, (q, k, v, m, grad), causal, gqa, scale, out, lse, grads)


def _against_float64(name, dtype, inputs, causal, gqa, scale, out, lse, grads):
    """out and dq, dk, dv against a float64 sdpa, each no further than twice eager's own error plus a floor; the
    logsumexp against float64's."""
    q, k, v, m, grad = inputs
    m64 = m if m is None or m.dtype == torch.bool else m.double()
    ref = _sdpa_grads(q.double(), k.double(), v.double(), m64, grad.double(), causal, gqa)
    eager = _sdpa_grads(q, k, v, m, grad, causal, gqa)
    floor = 2e-3 if dtype == torch.float16 else 1e-2
    for what, got, ours_eager, want in zip(("out", "dq", "dk", "dv"), (out, *grads), eager, ref):
        err, eager_err = rel(got, want), rel(ours_eager, want)
        assert err <= 2 * eager_err + floor, (name, dtype, what, err, eager_err)
    lse_err = float((lse.double() - _lse64(q, k, m, causal, scale)).abs().max())
    assert lse_err < 1e-2, (name, dtype, lse_err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_attention_ops_match_float64_sdpa_on_the_kernel_they_pick(name, dtype):
    A.forget_choices()
    _, _, _, t, s, _, causal, mask = CASES[name]
    if mask is not None and s % 8:  # a bias over a key length off a multiple of 8: the efficient kernel, as sdpa's
        want = A.EFFICIENT
    elif _cudnn_expected():
        want = A.CUDNN
    else:
        want = A.FLASH if mask is None and not (causal and t != s) else A.EFFICIENT
    _check(name, dtype, want)


@pytest.mark.parametrize("name", ["causal_T1000", "causal_padding_mask", "gqa_causal", "causal_cross"])
def test_with_cudnn_sdp_off_the_ops_fall_back_to_flash_then_efficient(name):
    A.forget_choices()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        causal, t, s, mask = CASES[name][6], CASES[name][3], CASES[name][4], CASES[name][7]
        _check(name, torch.bfloat16, A.FLASH if mask is None and not (causal and t != s) else A.EFFICIENT)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
        A.forget_choices()


WINDOWS = {  # name: (B, H, Hk, T, E, window)
    "gemma3_local": (1, 4, 1, 1000, 256, 128),  # Gemma-3-1B's shape (T off a block multiple), one key/value head
    "head_dim_64": (2, 4, 4, 256, 64, 64),
    "gqa_128": (2, 8, 2, 300, 128, 100),
    "window_1": (1, 2, 2, 64, 64, 1),  # each query sees itself only
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(WINDOWS))
def test_sliding_window_runs_on_flash_local_attention_and_matches_float64(name, dtype):
    """A window (export/masks.py's rewrite of a constant sliding-window mask) runs on flash's local attention:
    out, logsumexp and the gradients against a float64 sdpa with the window as a mask, each no further from it
    than twice eager sdpa's own error (on the mask) plus a floor."""
    A.forget_choices()
    b, h, hk, t, e, w = WINDOWS[name]
    q, k, v, _, grad = _inputs((b, h, hk, t, t, e, True, None), dtype)
    gqa, scale = hk != h, e ** -0.5
    out, lse = A.attention(q, k, v, None, True, scale, gqa, w)
    assert A.chosen_kernels()[(q.shape, k.shape, q.dtype, q.get_device(), False, True, w)] == A.FLASH_WINDOW
    meta_out, meta_lse = A.attention(*(x.to("meta") for x in (q, k, v)), None, True, scale, gqa, w)
    assert out.shape == meta_out.shape and out.stride() == meta_out.stride()
    assert lse.shape == (b, h, t) and lse.dtype == torch.float32 and lse.stride() == meta_lse.stride()
    grads = A.attention_backward(grad, q, k, v, None, out, lse, True, scale, gqa, w)
    for x, want in zip(grads, (q, k, v)):
        assert x.shape == want.shape and x.dtype == dtype
        assert x.stride() == x.transpose(1, 2).contiguous().transpose(1, 2).stride()
    _against_float64(name, dtype, (q, k, v, A._window_mask(t, t, w, "cuda"), grad), False, gqa, scale, out, lse, grads)


def test_sliding_window_in_float32_runs_on_its_mask():
    A.forget_choices()
    q, k, v, _, grad = _inputs((1, 2, 1, 200, 200, 64, True, None), torch.float32)
    out, lse = A.attention(q, k, v, None, True, 0.125, True, 50)
    assert (q.shape, k.shape, q.dtype, q.get_device(), False, True, 50) not in A.chosen_kernels()
    assert A.chosen_kernels()[(q.shape, k.shape, q.dtype, q.get_device(), True, False, 0)] == A.EFFICIENT
    m = A._window_mask(200, 200, 50, "cuda")
    ref = _sdpa_grads(q.double(), k.double(), v.double(), m, grad.double(), False, True)
    grads = A.attention_backward(grad, q, k, v, None, out, lse, True, 0.125, True, 50)
    for got, want in zip((out, *grads), ref):
        assert rel(got, want) < 1e-4


def test_float32_uses_the_efficient_kernel():
    A.forget_choices()
    _check("causal_padding_mask", torch.float32, A.EFFICIENT)


def test_gpt_training_step_matches_eager_through_the_archive():
    import aotfuse
    from aotfuse.bench import verify_train
    from aotfuse.examples.gpt import anchor_train
    from aotfuse.specs import random_inputs

    A.forget_choices()
    model, inputs = anchor_train(batch=2, seq=256)  # bf16, 12 heads of 64, causal
    major, minor = torch.cuda.get_device_capability()
    res = aotfuse.build(model, inputs, train=True, targets=(f"sm_{major}{minor}",))
    art = aotfuse.load(res.data, device="cuda")
    x = random_inputs(art.input_specs, device="cuda", seed=3)
    checks = verify_train(copy.deepcopy(model).cuda(), art, x)
    bad = [c for c in checks if not c.passed]
    assert not bad, bad[:3]
    kinds = set(A.chosen_kernels().values())
    assert kinds == {A.CUDNN if _cudnn_expected() else A.FLASH}, A.chosen_kernels()


@pytest.mark.parametrize("kw", [{"masked": True}, {"kv_heads": 2}, {"masked": True, "rope": True}],
                         ids=["causal_padding_mask", "gqa", "rope_masked"])
def test_masked_and_gqa_training_through_the_archive_in_bf16(kw):
    import aotfuse
    from aotfuse.bench import verify_train
    from aotfuse.testing.attention_cases import attn_case as _attn_case

    A.forget_choices()
    model, (x, keep, target) = _attn_case(**kw)
    model = model.to(torch.bfloat16)
    inputs = (x.to(torch.bfloat16), keep, target.to(torch.bfloat16))
    major, minor = torch.cuda.get_device_capability()
    res = aotfuse.build(model, inputs, train=True, targets=(f"sm_{major}{minor}",))
    art = aotfuse.load(res.data, device="cuda")
    checks = verify_train(copy.deepcopy(model).cuda(), art, [t.cuda() for t in inputs])
    bad = [c for c in checks if not c.passed]
    assert not bad, bad[:3]
    assert set(A.chosen_kernels().values()) == {A.CUDNN if _cudnn_expected() else
                                                A.EFFICIENT if kw.get("masked") else A.FLASH}


@pytest.mark.parametrize("t", [49, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mshape", [(1, 4), (8, 1), ()], ids=["1H", "B1", "TS"])
def test_bias_gradient_op_matches_float64_sdpa(dtype, mshape, t):
    """aotfuse::attention_backward_bias on CUDA (the efficient kernel's bias gradient, summed to the mask's shape):
    T = S = 49 (Swin's window; the forward on the efficient kernel too) and 64 (the forward on cuDNN where torch
    prefers it, its logsumexp read by the efficient backward); dq, dk, dv and the mask's gradient against float64
    sdpa, no further than twice eager's own error in `dtype` (plus a floor)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(8, 4, t, 32, device="cuda", generator=g) for _ in range(3))
    m = torch.randn(*mshape, t, t, device="cuda", generator=g)
    go = torch.randn(8, 4, t, 32, device="cuda", generator=g)

    def grads(dt, fn):
        ts = [t.to(dt).requires_grad_() for t in (q, k, v, m)]
        out = fn(*ts)
        out.backward(go.to(dt))
        return [t.grad.double() for t in ts]

    ref = grads(torch.float64, lambda a, b, c, d: F.scaled_dot_product_attention(a, b, c, attn_mask=d))
    eager = grads(dtype, lambda a, b, c, d: F.scaled_dot_product_attention(a, b, c, attn_mask=d))
    qd, kd, vd, md = (t.to(dtype) for t in (q, k, v, m))
    out, lse = A.attention(qd, kd, vd, md, False, 32 ** -0.5, False)
    ours = A.attention_backward_bias(go.to(dtype), qd, kd, vd, md, out, lse, False, 32 ** -0.5, False)
    for name, o, e, r in zip(("dq", "dk", "dv", "dmask"), ours, eager, ref):
        assert o.shape == r.shape and o.dtype == dtype, name
        err, eager_err = float((o.double() - r).norm() / r.norm()), float((e - r).norm() / r.norm())
        assert err <= max(2 * eager_err, 1e-5 if dtype == torch.float32 else 1e-2), (name, err, eager_err)


@pytest.mark.parametrize("t", [49, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_heads_last_bias_is_copied_dense_for_the_kernels(dtype, t):
    """A [B, H, T, S] bias stored heads-last (strides (T S H, 1, S H, H): T5's position bias plus its mask, as the
    model computes it). cuDNN failed to execute on it and the efficient kernel refused it ("last dimension must
    be contiguous"); the ops copy it dense first. Output, logsumexp-backed gradients and the bias gradient
    against float64 sdpa."""
    A.forget_choices()
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, go = (torch.randn(8, 4, t, 32, device="cuda", generator=g) for _ in range(4))
    m = torch.randn(8, t, t, 4, device="cuda", generator=g).permute(0, 3, 1, 2)
    assert m.stride(-1) == 4

    def grads(dt):
        ts = [x.to(dt).requires_grad_() for x in (q, k, v)] + [m.to(dt).requires_grad_()]
        out = F.scaled_dot_product_attention(*ts[:3], attn_mask=ts[3])
        out.backward(go.to(dt))
        return [out.detach().double()] + [x.grad.double() for x in ts]

    ref, eager = grads(torch.float64), grads(dtype)
    qd, kd, vd = (x.to(dtype) for x in (q, k, v))
    md = m.to(dtype)  # keeps the heads-last strides
    assert md.stride(-1) == 4
    out, lse = A.attention(qd, kd, vd, md, False, 32 ** -0.5, False)
    ours = [out] + list(A.attention_backward_bias(go.to(dtype), qd, kd, vd, md, out, lse, False, 32 ** -0.5, False))
    for name, o, e, r in zip(("out", "dq", "dk", "dv", "dmask"), ours, eager, ref):
        assert o.shape == r.shape, (name, o.shape, r.shape)
        err, eager_err = float((o.double() - r).norm() / r.norm()), float((e - r).norm() / r.norm())
        assert err <= max(2 * eager_err, 1e-5 if dtype == torch.float32 else 1e-2), (name, err, eager_err)


def test_learned_bias_training_in_bf16_pairs_the_cudnn_forward_with_the_bias_gradient():
    """T = 64 in bf16: where torch prefers cuDNN the forward runs it, and the bias gradient comes from the efficient
    kernel's dS (aotfuse::attention_backward_bias) on cuDNN's logsumexp; loss and gradients against eager within
    bf16's tolerance (aotfuse.bench.verify_train)."""
    import aotfuse
    from aotfuse.bench import verify_train
    from test_train_attention import WindowBias

    A.forget_choices()
    torch.manual_seed(0)
    model = WindowBias(t=64, heads=2, dim=64).to(torch.bfloat16)
    x = torch.randn(4, 64, 64, dtype=torch.bfloat16)
    major, minor = torch.cuda.get_device_capability()
    res = aotfuse.build(model, (x,), train=True, targets=(f"sm_{major}{minor}",))
    art = aotfuse.load(res.data, device="cuda")
    checks = verify_train(copy.deepcopy(model).cuda(), art, [torch.randn(4, 64, 64, dtype=torch.bfloat16).cuda()])
    bad = [c for c in checks if not c.passed]
    assert not bad, bad[:3]
    kinds = set(A.chosen_kernels().values())
    assert kinds == {A.CUDNN if _cudnn_expected() else A.EFFICIENT}, A.chosen_kernels()


@pytest.mark.parametrize("t", [49, 64])
def test_learned_bias_training_through_the_archive(t):
    """Swin-style window attention with a learned relative position bias trained through the archive on CUDA
    (tests/test_train_attention.py's WindowBias): loss and every gradient against eager, fp32 (cuDNN takes no
    fp32: the efficient kernel both ways; the bf16 test above pairs cuDNN with the bias gradient)."""
    import aotfuse
    from aotfuse.testing.train_check import assert_training_matches
    from test_train_attention import WindowBias

    torch.manual_seed(0)
    model = WindowBias(t=t)
    x = torch.randn(4, t, 16)
    major, minor = torch.cuda.get_device_capability()
    res = aotfuse.build(model, (x,), train=True, targets=(f"sm_{major}{minor}",))
    assert_training_matches(res.data, model, (torch.randn(4, t, 16),), loss_rtol=1e-4, loss_atol=1e-5,
                            grad_rtol=1e-3, grad_atol=1e-5, device="cuda")
