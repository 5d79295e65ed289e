"""Patterns of models outside the zoo that built archives which then failed at load or run (a probe of 41
transformers architectures, 2026-11-27): Gemma 3's unused full causal mask kept alive by export's metadata
check (export/checks.py), SigLIP's convolution with padding="valid" in training."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.testing.train_check import assert_training_matches


class DeadMask(nn.Module):
    """Two masks built from positions (packed-sequence ids through cumsum), only the sliding one used; the
    full one's `.to(device=, dtype=)` leaves an aten._assert_tensor_metadata node on it."""

    def forward(self, q):
        pos = torch.arange(16, device=q.device).expand(2, 16)
        i = torch.arange(16, device=q.device)

        def mask(window):
            seg = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
            m = (i[:, None] >= i[None, :])[None, None]
            if window:
                m = m & (i[:, None] - i[None, :] < window)[None, None]
            return m & (seg[:, None, :, None] == seg[:, None, None, :]).to(device=q.device, dtype=torch.bool)

        mask(None)  # built, never used
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask(8).expand(2, -1, 16, 16))


def test_dead_mask_is_not_lowered():
    model = DeadMask()
    res = aotfuse.build(model, (torch.randn(2, 4, 16, 16),), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")  # before: a kernel with no output, refused at load
    q = torch.randn(2, 4, 16, 16)
    torch.testing.assert_close(art(q), model(q), rtol=1e-5, atol=1e-5)


class ValidConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, kernel_size=8, stride=8, padding="valid")

    def forward(self, x):
        return self.conv(x).float().pow(2).mean()


def test_valid_padding_conv_training():
    torch.manual_seed(0)
    model = ValidConv()
    res = aotfuse.build(model, (torch.randn(2, 3, 32, 32),), train=True, targets=("sm_90",))
    # before: the backward's convolution_backward extern with padding [0] was refused at run
    assert_training_matches(res.data, model, (torch.randn(2, 3, 32, 32),))


def test_a_value_read_off_the_data_is_refused_by_name():
    """A count taken with .item() (JetMoE's experts count their tokens so): export keeps it as an unbacked size;
    lowering names the op and the model line (before: a ValueError from the size table)."""
    import pytest

    from aotfuse.errors import UnsupportedOpError

    class Count(nn.Module):
        def forward(self, x):
            n = (x > 0).sum().item()
            torch._check_is_size(n)
            return x.sum() * n

    with pytest.raises(UnsupportedOpError, match="_local_scalar_dense") as e:
        aotfuse.build(Count(), (torch.randn(4, 6),), targets=("sm_90",))
    assert "depends on the data" in str(e.value) and "test_probe_patterns.py" in str(e.value) and e.value.remedy
