"""The bundled example models: each factory runs eagerly, with the right shapes, dtypes and modes,
and is deterministic (same weights, inputs and outputs on every call, global RNG untouched)."""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

F32, BF16, F16, I64 = torch.float32, torch.bfloat16, torch.float16, torch.int64

# (module, factory, input shapes, input dtypes, output shape ([] = scalar loss), output dtype, trains)
CASES = [
    ("llama", "block", [(2, 32, 128)], [F32], (2, 32, 128), F32, False),
    ("llama", "block_bf16", [(2, 32, 128)], [BF16], (2, 32, 128), BF16, False),
    ("llama", "block_fp16", [(2, 32, 128)], [F16], (2, 32, 128), F16, False),
    ("llama", "block_train", [(2, 32, 128), (2, 32, 128)], [F32, F32], (), F32, True),
    ("cnn", "cnn", [(2, 3, 32, 32)], [F32], (2, 10), F32, False),
    ("cnn", "cnn_bf16", [(2, 3, 32, 32)], [BF16], (2, 10), BF16, False),
    ("cnn", "cnn_fp16", [(2, 3, 32, 32)], [F16], (2, 10), F16, False),
    ("cnn", "cnn_train", [(2, 3, 32, 32), (2,)], [F32, I64], (), F32, True),
    ("gpt", "demo", [(2, 64)], [I64], (2, 64, 512), F32, False),
    ("gpt", "demo_bf16", [(2, 64)], [I64], (2, 64, 512), BF16, False),
]
IDS = [f"{m}:{f}" for m, f, *_ in CASES]


def _factory(module: str, name: str):
    return getattr(importlib.import_module(f"aotfuse.examples.{module}"), name)


@pytest.mark.parametrize("module,name,shapes,dtypes,out_shape,out_dtype,trains", CASES, ids=IDS)
def test_factory_runs_eagerly(module, name, shapes, dtypes, out_shape, out_dtype, trains):
    model, inputs = _factory(module, name)()
    assert isinstance(model, nn.Module) and isinstance(inputs, tuple)
    assert [tuple(t.shape) for t in inputs] == shapes
    assert [t.dtype for t in inputs] == dtypes
    assert model.training is trains
    with torch.no_grad():
        out = model(*inputs)
    assert tuple(out.shape) == out_shape and out.dtype == out_dtype
    assert torch.isfinite(out.float()).all()
    assert all(p.dtype == out_dtype for p in model.parameters())


@pytest.mark.parametrize("module,name", [(m, f) for m, f, *_ in CASES], ids=IDS)
def test_factory_is_deterministic(module, name):
    rng = torch.random.get_rng_state()
    (m1, x1), (m2, x2) = _factory(module, name)(), _factory(module, name)()
    assert torch.equal(rng, torch.random.get_rng_state()) or module == "gpt"  # gpt seeds the global RNG
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert all(torch.equal(a, b) for a, b in zip(x1, x2))
    if not m1.training:
        with torch.no_grad():
            assert torch.equal(m1(*x1), m2(*x2))


@pytest.mark.parametrize("factory", ["block_train", "cnn_train"])
def test_train_factories_backprop_to_every_parameter(factory):
    module = "llama" if factory.startswith("block") else "cnn"
    model, inputs = _factory(module, factory)()
    loss = model(*inputs)
    assert loss.dim() == 0 and loss.item() > 0
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_llama_block_matches_reference_formula():
    from aotfuse.examples.llama import block

    model, (x,) = block()
    assert model.gate.out_features == 344 and model.gate.bias is None and model.down.bias is None
    w = model.norm.weight
    assert not torch.allclose(w, torch.ones_like(w))
    h = F.rms_norm(x, (x.shape[-1],), w, eps=model.norm.eps)
    want = x + model.down(F.silu(model.gate(h)) * model.up(h))
    with torch.no_grad():
        torch.testing.assert_close(model(x), want)


def test_llama_block_train_loss_is_mse_of_block():
    from aotfuse.examples.llama import block, block_train

    model, (x, target) = block_train()
    infer, (x0,) = block()
    assert torch.equal(x, x0)
    with torch.no_grad():
        torch.testing.assert_close(model(x, target), F.mse_loss(infer(x), target))


def test_cnn_batchnorm_has_nontrivial_stats_and_eval_mode():
    from aotfuse.examples.cnn import cnn

    model, _ = cnn()
    for bn in (model.bn1, model.bn2):
        assert not bn.training
        assert bn.running_mean.abs().max() > 0.01
        assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))


def test_cnn_train_keeps_batchnorm_frozen():
    from aotfuse.examples.cnn import cnn_train

    model, inputs = cnn_train()
    model.train()
    assert model.training and not model.cnn.bn1.training and not model.cnn.bn2.training
    before = model.cnn.bn1.running_mean.clone()
    model(*inputs).backward()
    assert torch.equal(before, model.cnn.bn1.running_mean)
    assert inputs[1].min() >= 0 and inputs[1].max() < 10


def test_batch_and_seed_arguments():
    from aotfuse.examples.cnn import cnn
    from aotfuse.examples.llama import block

    _, (x,) = block(batch=5, seq=7)
    assert x.shape == (5, 7, 128)
    (m0, _), (m1, _) = cnn(seed=0), cnn(seed=1)
    assert not torch.equal(m0.conv1.weight, m1.conv1.weight)
