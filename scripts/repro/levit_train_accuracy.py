"""LeViT training on the CPU path: gradients 15-30x further from a float64 eager run than float32 eager's (found by
the twenty-fifth session's survey; open). Tiny LevitForImageClassification, every parameter moved by 0.05 N(0, 1)
(transformers' initialization gives ~0 logits), batch 2 at 32 x 32, float32.

    python3 scripts/repro/levit_train_accuracy.py

prints, per parameter (largest first, parameters whose float64 gradient is rounding noise left out), the relative
error against float64 of our gradient and of eager float32's. Seen (2026-11-28): ours 6-8e-3, eager 2-5e-4 on the
stage-0/1 linear and BatchNorm weights. A Linear + BatchNorm1d with a large mean alone is as accurate as eager
(the BatchNorm statistics are not it)."""
from __future__ import annotations

import copy

import torch
import transformers

import aotfuse


def main() -> None:
    cfg = transformers.LevitConfig(image_size=32, patch_size=16, hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 2],
                                   depths=[1, 1, 1], key_dim=[8, 8, 8], drop_path_rate=0, num_labels=10)
    torch.manual_seed(0)
    model = transformers.LevitForImageClassification(cfg).train()
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)
    res = aotfuse.build(model, (), example_kwargs={"pixel_values": x, "labels": y}, train=True, targets=("sm_90",))
    mod = aotfuse.load(res.data, device="cpu").as_module()
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)
    out = mod(pixel_values=x, labels=y)
    (out[0] if isinstance(out, (tuple, list)) else getattr(out, "loss", out)).backward()
    e32 = copy.deepcopy(model)
    e32(pixel_values=x, labels=y).loss.backward()
    e64 = copy.deepcopy(model).double()
    e64(pixel_values=x.double(), labels=y).loss.backward()

    def rel(a, b) -> float:
        return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))

    ours, t32 = dict(mod.named_parameters()), dict(e32.named_parameters())
    rows = sorted(((rel(ours[n].grad, p.grad), rel(t32[n].grad, p.grad), n) for n, p in e64.named_parameters()
                   if p.grad is not None and rel(t32[n].grad, p.grad) < 1e-2), reverse=True)
    for r in rows[:10]:
        print("ours %.2e  eager fp32 %.2e  %s" % r)


if __name__ == "__main__":
    main()
