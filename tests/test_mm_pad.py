"""Matmuls with a size that is not a multiple of 16 bytes' worth of elements (a vocabulary of 50257,
AOTFUSE_MM_PAD): computed over padded sizes, operands copied into zero-padded matrices once (a producer fused into
the copy), the result a slice of a padded buffer; the numbers are eager's (CPU path)."""
from __future__ import annotations

import msgpack
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.archive import read_archive
from aotfuse.knobs import override
from aotfuse.lower.ctx import pad_row

from test_lifted_constants import _check as _train_check  # build, one step, loss and gradients vs eager


class Head(nn.Module):
    def __init__(self, d=128, vocab=1001, bias=False):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=bias)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x)))


class BiasedHead(Head):
    """BERT's MLM decoder: a biased head, kept as one addmm (its result is the output)."""

    def __init__(self):
        super().__init__(bias=True)


class HeadLoss(Head):
    def forward(self, x, t):
        return F.cross_entropy(super().forward(x).float(), t)


def _mm_externs(data: bytes) -> list:
    arc = read_archive(data)
    found = []
    for prog in arc.part_names:
        if prog.startswith("program."):
            p = arc.part(prog)
            p = msgpack.unpackb(p) if isinstance(p, (bytes, memoryview)) else p
            found += [st for st in p["instructions"] if st.get("op") == "extern" and "mm" in st["target"]]
    return found


def test_pad_row():
    assert pad_row(50257, "bfloat16") == 50264 and pad_row(50257, "float32") == 50260 and pad_row(768, "bfloat16") == 768


@pytest.mark.parametrize("pad", [True, False])
def test_inference_result_rows_padded(pad):
    torch.manual_seed(0)
    model = Head().eval()
    x = torch.randn(256, 128)
    with override(mm_pad=pad):
        res = aotfuse.build(model, (x,))
    head = [st for st in _mm_externs(res.data) if st["out_view"]["shape"] in ([256, 1001], [256, 1004])]
    assert len(head) == 1 and head[0]["out_view"]["shape"] == ([256, 1004] if pad else [256, 1001])
    if pad:  # the weight's transpose [128, 1001] read as a padded copy of the weight, [1004, 128]
        assert head[0]["args"][1]["shape"] == [128, 1004] and head[0]["args"][1]["stride"] == [1, 128]
    art = aotfuse.load(res.data, device="cpu")
    xs = torch.randn(256, 128)
    out = art(xs)
    torch.testing.assert_close(out, model(xs), rtol=1e-5, atol=1e-5)
    assert out.stride() == ((1004, 1) if pad else (1001, 1))  # a view of the padded rows, as torch.compile's


def test_a_biased_head_is_padded_with_its_bias():
    torch.manual_seed(0)
    model = BiasedHead().eval()
    res = aotfuse.build(model, (torch.randn(256, 128),))
    (head,) = [st for st in _mm_externs(res.data) if st["out_view"]["shape"] == [256, 1004]]
    assert head["target"] == "aten.addmm.out" and head["args"][0]["shape"] == [1004]
    art = aotfuse.load(res.data, device="cpu")
    xs = torch.randn(256, 128)
    torch.testing.assert_close(art(xs), model(xs), rtol=1e-5, atol=1e-5)


class BiasedHeadLoss(HeadLoss):
    def __init__(self):
        Head.__init__(self, bias=True)


def test_training_a_biased_head():
    torch.manual_seed(0)
    x, t = torch.randn(256, 128), torch.randint(0, 1001, (256,))
    _train_check(BiasedHeadLoss().train(), (x, t), (torch.randn(256, 128) * 2, torch.randint(0, 1001, (256,))))


def test_training_pads_the_logits_gradient_once():
    torch.manual_seed(0)
    model = HeadLoss().train()
    x, t = torch.randn(256, 128), torch.randint(0, 1001, (256,))
    res = aotfuse.build(model, (x, t), train=True)
    sizes = [d for st in _mm_externs(res.data) for a in [*st["args"], st["out_view"]] if isinstance(a, dict)
             for d in a["shape"]]
    assert 1001 not in sizes and 1004 in sizes  # every matmul computes over padded sizes
    _train_check(model, (x, t), (torch.randn(256, 128) * 2, torch.randint(0, 1001, (256,))))


@pytest.mark.gpu
def test_padded_matmuls_on_cuda_in_training_and_graphs():
    """bf16 on the GPU (cuBLAS over padded sizes, replayed in CUDA graphs): inference output and a training step's
    loss and gradients against eager."""
    import copy

    major, minor = torch.cuda.get_device_capability()
    target = (f"sm_{major}{minor}",)
    torch.manual_seed(0)
    for model in (Head().to(torch.bfloat16).eval(), BiasedHead().to(torch.bfloat16).eval()):
        res = aotfuse.build(model, (torch.randn(256, 128, dtype=torch.bfloat16),), targets=target)
        art = aotfuse.load(res.data, device="cuda")
        ref = copy.deepcopy(model).cuda()
        for seed in (1, 2):
            x = torch.randn(256, 128, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).cuda()
            with torch.no_grad():
                torch.testing.assert_close(art(x).float(), ref(x).float(), rtol=2e-2, atol=2e-2)
    train = HeadLoss().train()
    res = aotfuse.build(train, (torch.randn(256, 128), torch.randint(0, 1001, (256,))), train=True, targets=target)
    mod = aotfuse.load(res.data, device="cuda").as_module()
    ref = copy.deepcopy(train).cuda()
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        x, t = torch.randn(256, 128, generator=g).cuda(), torch.randint(0, 1001, (256,), generator=g).cuda()
        for p in list(mod.parameters()) + list(ref.parameters()):
            p.grad = None
        loss, want = mod(x, t), ref(x, t)
        loss.backward()
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-5)
        grads = dict(mod.named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-3, atol=1e-5, msg=name)
