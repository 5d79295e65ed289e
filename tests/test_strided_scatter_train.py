"""Training through an in-place update of a view of a non-contiguous tensor (Funnel Transformer's relative
attention: `positional_attn *= cls_mask` on reshapes and slices of a permuted einsum result). The joint trace's
slice_scatter decomposition (joint/decomp_train._slice_scatter) must keep the base's strides: functionalization
replays the view chain on its result, and a row-major result made that replay fail ("Cannot view a tensor with
shape [2, 4, 8, 1, 16] and strides ..."), so Funnel's training build failed."""
from __future__ import annotations

import copy

import pytest
import torch

import aotfuse

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class _ShiftedScores(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 4, 16))

    def forward(self, q, r, mask):
        rh = torch.einsum("td,dnh->tnh", r, self.w)  # [T, N, H]
        pa = torch.einsum("binh,tnh->bnit", q, rh)  # [B, N, S, T], permuted storage
        b, n, s, t = pa.shape
        pa = torch.reshape(pa, [b, n, t, s])[:, :, 1:, :]
        pa = torch.reshape(pa, [b, n, s, t - 1])[..., :s]
        pa *= mask  # in place on the view
        return pa.square().mean()


def test_in_place_update_of_a_strided_view_trains_as_eager():
    torch.manual_seed(0)
    model = _ShiftedScores().train()
    args = (torch.randn(2, 8, 4, 16), torch.randn(17, 8), (torch.rand(8, 8) > 0.3).float())
    res = aotfuse.build(model, args, train=True, targets=("sm_90",))
    mod = aotfuse.load(res.data, device="cpu").as_module()
    g = torch.Generator().manual_seed(3)
    fresh = (torch.randn(2, 8, 4, 16, generator=g), torch.randn(17, 8, generator=g),
             (torch.rand(8, 8, generator=g) > 0.3).float())
    loss = mod(*fresh)
    loss.backward()
    ref_model = copy.deepcopy(model)
    ref = ref_model(*fresh)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    got = dict(mod.named_parameters())["w"].grad
    assert float((got - ref_model.w.grad).norm() / ref_model.w.grad.norm()) < 1e-5
