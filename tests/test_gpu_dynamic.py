"""GPU tier (skipped without CUDA): one dynamic archive at many shapes on the GPU (issue 10.2, 10.4).

The cubins take the dims as int32 arguments (no compile at load or call); each new shape is linked
and captured into a CUDA graph once, later calls at that shape replay it."""
from __future__ import annotations

import pytest
import torch

import aotfuse
from test_dynamic import NormSoftmax, RowSoftmax  # the CPU tier's models (tests/ is on sys.path)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _arch():
    major, minor = torch.cuda.get_device_capability()
    return [f"sm_{major}{minor}"]



def test_rows_and_reduction_lengths_on_the_gpu():
    torch.manual_seed(0)
    m = NormSoftmax().eval()
    res = aotfuse.build(m, (torch.randn(3, 5, 100), torch.randn(100)), targets=_arch(),
                        dynamic_shapes=["x.0=1..64", "x.1=1..300"])
    m.cuda()
    art = aotfuse.load(res.data, device="cuda")
    y = torch.randn(100, device="cuda")
    shapes = [(3, 5), (1, 1), (64, 300), (7, 13), (33, 257), (3, 5)]
    for b, t in shapes:
        x = torch.randn(b, t, 100, device="cuda")
        torch.testing.assert_close(art(x, y), m(x, y), rtol=1e-5, atol=1e-5)
    st = art.shape_stats()["forward"]
    # each shape linked once (no compile); captures: one per shape, plus one whenever a keyed input
    # (x: read in place) arrives at a new address, as for a static archive
    assert st["linked"] == len(set(shapes)) and st["cached"] == len(set(shapes)), st
    assert len(set(shapes)) <= st["captures"] <= len(shapes) and st["eager_calls"] == 0, st

    r = RowSoftmax()
    res = aotfuse.build(r, (torch.randn(4, 50),), targets=_arch(), dynamic_shapes=["x.1=1..5000"])
    art = aotfuse.load(res.data, device="cuda")
    for n in (50, 1, 1023, 1025, 5000):
        x = torch.randn(4, n, device="cuda")
        got, want = art(x), r(x)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)


def test_gpt_bf16_one_archive_many_shapes():
    from aotfuse.examples.gpt import demo

    m, (tok,) = demo(batch=2, dtype=torch.bfloat16)
    res = aotfuse.build(m, (tok,), targets=_arch(), dynamic_shapes=["tokens.0=1..8", "tokens.1=1..64"])
    art = aotfuse.load(res.data, device="cuda")
    m = m.cuda()
    g = torch.Generator().manual_seed(3)
    for b, t in [(2, 64), (1, 1), (8, 64), (3, 17), (5, 63), (2, 64)]:
        x = torch.randint(0, 512, (b, t), generator=g).cuda()
        with torch.no_grad():
            want = m(x).float()
        got = art(x).float()
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 3e-2, (b, t, err)


def test_transformers_llama_dynamic_batch_and_sequence_on_the_gpu():
    from aotfuse.testing.zoo import entry, have_transformers

    if not have_transformers():
        pytest.skip("needs transformers")
    ex = entry("llama").tiny()
    res = aotfuse.build(ex.model, ex.args, example_kwargs=ex.kwargs, targets=_arch(),
                        dynamic_shapes=["input_ids.0=1..8", "input_ids.1=2..32"])
    art = aotfuse.load(res.data, device="cuda")
    model = ex.model.cuda()
    g = torch.Generator().manual_seed(2)
    lo_b = res.manifest.dims[0].lo  # 1 where torch keeps the asked range, 2 where it narrows it (torch 2.11)
    for b, t in ((lo_b, 2), (3, 7), (8, 32), (2, 16)):
        ids = torch.randint(0, 100, (b, t), generator=g).cuda()
        with torch.no_grad():
            want = model(input_ids=ids).logits
        torch.testing.assert_close(art(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("how", [dict(step="split"), dict(step="auto"), dict(step="split", backward_stages=3)],
                         ids=["split", "fused_step", "staged"])
def test_one_train_archive_many_shapes_on_the_gpu(how):
    """A `--train` archive with dynamic batch and sequence (issue 10.1): loss and every gradient vs eager on
    the GPU at the range ends and odd sizes, with CUDA graphs per shape (captured at a shape's first step,
    replayed after), and AdamW steps that follow eager."""
    import copy

    from test_dynamic_train import DIMS, SHAPES, _tokens, rel, small_gpt

    model, inputs = small_gpt()
    res = aotfuse.build(model, inputs, train=True, targets=_arch(), dynamic_shapes=DIMS, **how)
    art = aotfuse.load(res.data, device="cuda")
    mod = art.as_module(cuda_graphs=True)
    ref_model = copy.deepcopy(model).cuda()
    ref_params = dict(ref_model.named_parameters())
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    shapes = SHAPES + [(3, 5), (1, 1), (4, 8)]  # again: replays
    for k, shape in enumerate(shapes):
        x = tuple(t.cuda() for t in _tokens(shape, seed=30 + k))
        loss = mod(*x)
        loss.backward()
        ref = ref_model(*x)
        ref.backward()
        assert rel(loss, ref) < 1e-4, (shape, float(loss), float(ref))
        for name, p in mod.named_parameters():
            assert rel(p.grad, ref_params[name].grad) < 1e-3, (shape, name)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    st = mod.shape_stats()
    assert st["cached"] == len(set(SHAPES)), st
    for s in st["shapes"]:
        for name, g in s["graphs"].items():
            assert g["captures"] >= 1 and g["eager_calls"] == 0, (s["dims"], name, g)
    # a repeated shape replays: no capture beyond its first step's
    assert sum(g["replays"] for s in st["shapes"] for g in s["graphs"].values()) > 0, st
