"""Training keeps attention fused (issue 9, point 1): `aotfuse::attention` in the forward and
`aotfuse::attention_backward` in the backward, as multi-output externs. No B x H x T x T tensor is
materialized or saved; the partition saves q, k, v, out and the fp32 logsumexp. Causal, padding-mask
and GQA variants, on the CPU path (externs as aten calls, kernels in Triton's interpreter)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.testing.train_check import assert_training_matches
from aotfuse.knobs import knobs
from aotfuse.archive import read_archive
from aotfuse.contract import PROGRAM_VERSION
from aotfuse.contract.program import PDL_VERSION
from aotfuse.examples.gpt import demo_train
from aotfuse.joint import trace_joint
from aotfuse.runtime.attention import attention, attention_backward
from aotfuse.runtime.payload import read_payload, read_report

from aotfuse.testing.attention_cases import attn_case as _attn_case

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


CASES = {
    "gpt": lambda: demo_train(dropout=0.0),
    "causal_padding_mask": lambda: _attn_case(masked=True),
    "gqa": lambda: _attn_case(kv_heads=2),
    # saved q, k produced by pointwise ops on transposed views (a Llama/Qwen2 regression: the forward
    # returned them as permuted views and the backward read them as row-major buffers)
    "rope_masked": lambda: _attn_case(masked=True, rope=True),
}
_ATT_SHAPES = {"gpt": (2, 4, 64), "causal_padding_mask": (2, 4, 16), "gqa": (2, 4, 16), "rope_masked": (2, 4, 16)}  # B, H, T


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(name):
        if name not in cache:
            model, inputs = CASES[name]()
            cache[name] = (model, inputs, aotfuse.build(model, inputs, train=True, targets=("sm_90",)))
        return cache[name]
    return get


def _all_shapes(data: bytes) -> dict:
    """program -> every tensor shape its instructions define or read (allocs, inputs, extern results)."""
    with read_archive(data) as ar:
        payload = read_payload(ar)
    out = {}
    for name, prog in payload.programs.items():
        shapes = [tuple(i.shape) for i in prog.inputs]
        for ins in prog.instructions:
            if ins.op == "alloc":
                shapes.append(tuple(ins.shape))
            elif ins.op == "extern":
                shapes.append(tuple(ins.out_view.shape))
                shapes += [tuple(o.out_view.shape) for o in ins.outs]
        out[name] = (shapes, prog)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_fused_attention_loss_and_every_gradient_match_eager(built, name):
    model, inputs, res = built(name)
    mod = aotfuse.load(res.data, device="cpu").as_module()
    loss = mod(*inputs)
    loss.backward()
    ref_model = copy.deepcopy(model)
    ref = ref_model(*inputs)
    ref.backward()
    assert rel(loss, ref) < 1e-4, (float(loss), float(ref))
    ref_params = dict(ref_model.named_parameters())
    for n, p in mod.named_parameters():
        assert rel(p.grad, ref_params[n].grad) < 1e-4, n


@pytest.mark.parametrize("name", list(CASES))
def test_no_b_h_t_t_tensor_and_the_partition_saves_q_k_v_out_lse(built, name):
    _, _, res = built(name)
    b, h, t = _ATT_SHAPES[name]
    progs = _all_shapes(res.data)
    for pname, (shapes, prog) in progs.items():
        # 4; 7 (PDL_VERSION) with knobs.pdl (emit/pdl.py)
        assert prog.version == (PDL_VERSION if knobs.pdl else PROGRAM_VERSION) and PROGRAM_VERSION == 4
        assert not [s for s in shapes if len(s) == 4 and s[0] == b and s[-2:] == (t, t) and s[1] in (h, 1) and
                    s[1] == h], (pname, sorted(set(shapes)))
        assert not [s for s in shapes if s[-2:] == (t, t) and len(s) >= 3 and s[-3] == h], (pname, sorted(set(shapes)))
    fwd = [i for i in progs["forward"][1].instructions if i.op == "extern" and "attention" in i.target]
    bwd = [i for i in progs["backward"][1].instructions if i.op == "extern" and "attention" in i.target]
    assert fwd and {i.target for i in fwd} == {"aotfuse.attention.default"}
    assert len(bwd) == len(fwd) and {i.target for i in bwd} == {"aotfuse.attention_backward.default"}
    assert all(len(i.outs) == 1 for i in fwd) and all(len(i.outs) == 2 for i in bwd)
    with read_archive(res.data) as ar:
        part = read_report(ar).partition
    acts = [s for s in part["saved"] if s["kind"] == "activation"]
    assert not [s for s in acts if len(s["shape"]) >= 2 and s["shape"][-2:] == [t, t]], acts
    lse = [s for s in acts if s["shape"] == [b, h, t] and s["dtype"] == "float32"]
    assert len(lse) == len(fwd), acts  # one logsumexp per attention
    assert [a["kernel"] for a in part["attention"]] == ["fused"] * len(fwd)
    from aotfuse.runtime.explain import explain

    assert "attention 0" in explain(res.data) and "kept whole" in explain(res.data)


class WindowBias(nn.Module):
    """Swin's window attention as transformers calls sdpa: the learned relative position bias [1, H, T, T] (gathered
    from a table by index, as Swin does) plus a constant shifted-window mask over windows [nW, 1, T, T], as one float
    attn_mask that requires grad. T = 49 (7 x 7 windows): not a multiple of 8."""

    def __init__(self, heads=2, t=49, dim=16, windows=2, shifted=True):
        super().__init__()
        self.heads, self.windows = heads, windows
        self.table = nn.Parameter(torch.randn(2 * t, heads) * 0.5)
        self.register_buffer("index", torch.randint(0, 2 * t, (t, t)))
        mask = torch.zeros(windows, t, t)
        if shifted:
            mask[1, : t // 2, t // 2:] = -100.0  # Swin's shifted-window mask: -100 between regions
        self.register_buffer("mask", mask)
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        bw, t, d = x.shape
        q, k, v = self.qkv(x).view(bw, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.table[self.index].permute(2, 0, 1).unsqueeze(0)  # [1, H, T, T]
        m = (bias.unsqueeze(1) + self.mask[None, :, None]).reshape(-1, self.heads, t, t)  # [nW, H, T, T]
        m = m.repeat(bw // self.windows, 1, 1, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return out.square().mean()


def test_learned_bias_is_fused_with_its_gradient():
    """A float mask that requires grad (a learned bias) keeps attention fused: the backward is
    aotfuse::attention_backward_bias, which returns the bias's gradient too; loss and every gradient (the bias table
    included) match eager, and no [B, H, T, T] probabilities are saved."""
    torch.manual_seed(0)
    model = WindowBias()
    x = torch.randn(4, 49, 16)
    joint = trace_joint(model, (x,))
    assert [d["kernel"] for d in joint.decisions] == ["fused"]
    res = aotfuse.build(model, (x,), train=True, targets=("sm_90",))
    targets = [i.target for prog in _all_shapes(res.data).values() for i in prog[1].instructions
               if i.op == "extern" and "attention" in i.target]
    assert sorted(targets) == ["aotfuse.attention.default", "aotfuse.attention_backward_bias.default"], targets
    with read_archive(res.data) as ar:
        acts = [s for s in read_report(ar).partition["saved"] if s["kind"] == "activation"]
    assert not [s for s in acts if s["shape"][-2:] == [49, 49] and len(s["shape"]) == 4 and s["shape"][0] == 4], acts
    assert_training_matches(res.data, model, (torch.randn(4, 49, 16),), grad_rtol=1e-4, grad_atol=1e-6)


def test_bias_gradient_op_matches_autograd_with_gqa_and_broadcast_masks():
    """aotfuse::attention_backward_bias against autograd through sdpa's math: masks [T, S], [1, H, T, S] and
    [B, 1, T, S] (the gradient summed to each), grouped heads, fp32 and fp64 on the CPU."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        for mshape, kv in (((7, 9), 4), ((1, 4, 7, 9), 2), ((2, 1, 7, 9), 4)):
            q = torch.randn(2, 4, 7, 8, dtype=dtype, requires_grad=True)
            k = torch.randn(2, kv, 9, 8, dtype=dtype, requires_grad=True)
            v = torch.randn(2, kv, 9, 8, dtype=dtype, requires_grad=True)
            m = torch.randn(*mshape, dtype=dtype, requires_grad=True)
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=kv != 4)
            g = torch.randn_like(want)
            want.backward(g)
            out, lse = attention(q, k, v, m, False, 8 ** -0.5, kv != 4)
            from aotfuse.runtime.attention import attention_backward_bias

            got = attention_backward_bias(g, q, k, v, m, out, lse, False, 8 ** -0.5, kv != 4)
            tol = 1e-5 if dtype == torch.float32 else 1e-6  # the logsumexp is fp32 (the contract) for fp64 too
            for a, b in zip(got, (q.grad, k.grad, v.grad, m.grad)):
                assert a.shape == b.shape and a.dtype == b.dtype
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_learned_mask_with_a_large_head_dim_takes_the_math_form_with_a_recorded_reason():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(1, 1, 8, 8))

        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias).sum()

    q = torch.randn(1, 2, 8, 160)
    joint = trace_joint(M(), (q, q, q))
    assert [d["kernel"] for d in joint.decisions] == ["math"]
    assert "requires grad with a head dim of 160" in joint.decisions[0]["why"]
    assert not [n for n in joint.gm.graph.nodes if "aotfuse" in str(n.target)]
    # a key length of 8 (the forward may run cuDNN, the bias gradient the efficient kernel: verified on an H100,
    # tests/test_gpu_attention.py's T = 64 cases) is fused
    q = torch.randn(1, 2, 8, 16)
    joint = trace_joint(M(), (q, q, q))
    assert [d["kernel"] for d in joint.decisions] != ["math"], joint.decisions


def test_attention_ops_match_sdpa_with_gqa_and_masks():
    torch.manual_seed(0)
    for gqa, causal, mask in ((False, True, None), (True, True, None), (False, False, "bool"), (True, False, "float")):
        b, h, hk, t, e = 2, 4, 2 if gqa else 4, 16, 8
        q = torch.randn(b, h, t, e, dtype=torch.float64, requires_grad=True)
        k = torch.randn(b, hk, t, e, dtype=torch.float64, requires_grad=True)
        v = torch.randn(b, hk, t, e, dtype=torch.float64, requires_grad=True)
        m = None
        if mask == "bool":
            m = torch.rand(b, 1, t, t) > 0.3
            m[..., 0] = True
        elif mask == "float":
            m = torch.randn(b, 1, 1, t, dtype=torch.float64)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=gqa)
        g = torch.randn_like(ref)
        want = torch.autograd.grad(ref, (q, k, v), g)
        out, lse = attention(q, k, v, m, causal, e ** -0.5, gqa)
        assert lse.shape == (b, h, t) and lse.dtype == torch.float32 and lse.is_contiguous()
        assert out.stride() == out.transpose(1, 2).contiguous().transpose(1, 2).stride()  # [B, T, H, E] storage
        torch.testing.assert_close(out, ref)
        got = attention_backward(g, q, k, v, m, out, lse, causal, e ** -0.5, gqa)
        for x, y in zip(got, want):  # the contract's lse is float32, also for float64 inputs
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("w", [1, 3, 16])
def test_sliding_window_ops_match_sdpa_with_the_window_as_a_mask(w):
    """The `window` argument (export/masks.py sets it for a constant sliding-window mask): off CUDA's local
    kernel the window is rebuilt as a mask; forward, logsumexp, gradients and autograd against sdpa."""
    from aotfuse.runtime.attention import _window_mask

    torch.manual_seed(0)
    b, h, hk, t, e = 2, 4, 2, 16, 8
    q = torch.randn(b, h, t, e, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hk, t, e, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hk, t, e, dtype=torch.float64, requires_grad=True)
    keep = _window_mask(t, t, w, "cpu")
    assert keep.tolist() == [[0 <= i - j < w for j in range(t)] for i in range(t)]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    g = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), g)
    out, lse = attention(q, k, v, None, True, e ** -0.5, True, w)
    torch.testing.assert_close(out, ref)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * e ** -0.5
    torch.testing.assert_close(lse.double(), scores.masked_fill(~keep, float("-inf")).logsumexp(-1))
    got = attention_backward(g, q, k, v, None, out, lse, True, e ** -0.5, True, w)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    for x, y in zip(torch.autograd.grad(attention(q, k, v, None, True, e ** -0.5, True, w)[0], (q, k, v), g), want):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_bool_mask_made_additive_once_in_the_graph():
    """Two fused attentions reading one bool padding mask: the additive mask (0 / -inf) the runtime would make in
    every forward and backward is made once in the joint graph (the conversions merge); loss and gradients match
    eager."""

    class TwoLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 96), nn.Linear(32, 96)

        def forward(self, x, m):
            b, t, _ = x.shape
            for lin in (self.a, self.b):
                q, k, v = lin(x).view(b, t, 3, 2, 16).permute(2, 0, 3, 1, 4)
                x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=m).transpose(1, 2).reshape(b, t, 32)
            return x.square().mean()

    torch.manual_seed(0)
    m = torch.ones(2, 1, 1, 24, dtype=torch.bool)
    m[1, ..., 18:] = False
    model = TwoLayers()
    res = aotfuse.build(model, (torch.randn(2, 24, 32), m), train=True, targets=("sm_90",))
    with read_archive(res.data) as ar:
        part = read_report(ar).partition
    assert [a["kernel"] for a in part["attention"]] == ["fused"] * 2
    assert all("made additive" in a["why"] for a in part["attention"]), part["attention"]
    joint = trace_joint(model, (torch.randn(2, 24, 32), m))
    conv = [n for n in joint.gm.graph.nodes if n.op == "call_function" and "where" in str(n.target)
            and any(getattr(a, "op", None) == "placeholder" for a in n.args)]
    assert len(conv) == 1, conv  # one conversion of the mask for both layers
    assert_training_matches(res.data, model, (torch.randn(2, 24, 32), m))


@pytest.mark.parametrize("s", [49, 64])
def test_bias_layouts_handed_to_the_cuda_kernels(s):
    """runtime/attention._dense_bias (what the efficient and cuDNN kernels get, checked here on the CPU): a
    heads-last bias (T5's position bias, key dim strided) becomes row-major with 16-byte aligned rows, padded past
    a key length off a multiple of 8; a broadcast bias stays broadcast; an aligned row-major bias passes as is."""
    from aotfuse.runtime.attention import _cudnn_bias, _dense_bias, _expand_bias

    heads_last = torch.randn(2, s, s, 4).permute(0, 3, 1, 2)
    for b in (_dense_bias(heads_last, s), _expand_bias(heads_last, torch.empty(2, 4, s, 8), torch.empty(2, 4, s, 8)),
              _cudnn_bias(heads_last, torch.empty(2, 4, s, 8), torch.empty(2, 4, s, 8))):
        assert b.stride(-1) == 1 and all(st % 8 == 0 for st in b.stride()[:-1]) and b.storage_offset() % 8 == 0
        assert torch.equal(b, heads_last)
    broadcast = torch.randn(1, 4, s, s)
    q = torch.empty(3, 4, s, 8)
    e = _expand_bias(broadcast, q, q)
    assert e.shape == (3, 4, s, s) and e.stride(0) == 0 and torch.equal(e[2], broadcast[0])
    aligned = torch.randn(2, 4, s, 64)[..., :s] if s % 8 else torch.randn(2, 4, s, s)
    assert _dense_bias(aligned, s) is aligned
