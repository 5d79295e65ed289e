"""A training archive against eager autograd on the same inputs: the loss and every parameter's gradient."""
from __future__ import annotations

import copy

import torch

import aotfuse


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_training_matches(data: bytes, model: torch.nn.Module, inputs: tuple, *, loss_atol: float = 1e-6,
                            grad_rtol: float = 1e-4, grad_atol: float = 1e-6, loss_rtol: float = 1e-5,
                            device: str = "cpu") -> None:
    """fp32: the archive's loss within loss_rtol of eager's, each gradient within the given tolerances; the archive
    loaded on `device`, eager run there on a copy of the model and the inputs."""
    mod = aotfuse.load(data, device=device).as_module()
    ref = copy.deepcopy(model).to(device)
    inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
    loss, want = mod(*inputs), ref(*inputs)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=loss_rtol, atol=loss_atol)
    got = dict(mod.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=grad_rtol, atol=grad_atol, msg=name)


def assert_half_training_close(data: bytes, model: torch.nn.Module, inputs: tuple, device: str = "cpu") -> None:
    """Half precision: the loss and each gradient no further from an fp32 eager run than max(2e-2, twice the
    half-precision eager run's own error)."""
    mod = aotfuse.load(data, device=device).as_module()
    ref = copy.deepcopy(model).to(device)
    ref32 = copy.deepcopy(model).float().to(device)
    loss, want, want32 = mod(*inputs), ref(*inputs), ref32(*(x.float() for x in inputs))
    for t in (loss, want, want32):
        t.backward()
    assert _rel(loss, want32) <= max(2e-2, 2 * _rel(want, want32))
    got = dict(mod.named_parameters())
    for (name, p), p32 in zip(ref.named_parameters(), ref32.parameters()):
        ours, eager = _rel(got[name].grad, p32.grad), _rel(p.grad, p32.grad)
        assert torch.isfinite(got[name].grad).all() and ours <= max(2e-2, 2 * eager), (name, ours, eager)
