"""nn.MultiheadAttention and nn.TransformerEncoder in training: the sdpa inside F.multi_head_attention_forward
is routed like a direct call (joint/decomp_train.sdpa_math_mode), so the backward lowers. Loss and gradients
against eager on the CPU path."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from test_lifted_constants import _check as _train_check  # build, one step, loss and gradients vs eager

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class MHALoss(nn.Module):
    def __init__(self, causal=False):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)
        self.causal = causal

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1]) if self.causal else None
        y, _ = self.mha(x, x, x, need_weights=False, attn_mask=mask, is_causal=self.causal)
        return y.square().mean()


class EncoderLoss(nn.Module):
    def __init__(self, norm_first):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x):
        return self.enc(x).square().mean()


def _check(model, shape):
    _train_check(model, (torch.randn(*shape),), (torch.randn(*shape) * 2,))


@pytest.mark.parametrize("causal", [False, True])
def test_multihead_attention_trains(causal):
    torch.manual_seed(0)
    _check(MHALoss(causal), (2, 6, 16))


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_trains(norm_first):
    torch.manual_seed(0)
    _check(EncoderLoss(norm_first), (2, 5, 16))
