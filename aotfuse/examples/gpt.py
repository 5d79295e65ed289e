"""A small GPT-style transformer: the bundled demo model.

Token + position embeddings, pre-LayerNorm blocks with causal attention through
scaled_dot_product_attention and a GELU MLP, residuals, final LayerNorm and an LM head.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 512
    seq: int = 64
    dim: int = 128
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 4
    dropout: float = 0.0
    gelu: str = "none"  # F.gelu's `approximate`: "none" (erf) or "tanh" (GPT-2's)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.gelu = cfg.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.out(self.drop(F.gelu(self.fc(self.ln2(x)), approximate=self.gelu)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class GPTWithLoss(nn.Module):
    """The demo GPT returning the mean cross-entropy of next-token prediction (on fp32 logits)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gpt = GPT(cfg)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(tokens)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _init(model: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, std=0.05)
        elif name.endswith("bias"):
            nn.init.normal_(p, std=0.02)
        else:
            nn.init.normal_(p, mean=1.0, std=0.05)
    return model


def demo(batch: int = 2, dtype: torch.dtype = torch.float32, cfg: GPTConfig = GPTConfig()):
    """The bundled demo: (model, example_inputs) with token ids of shape [batch, seq]."""
    model = _init(GPT(cfg), seed=0).to(dtype).eval()
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=torch.Generator().manual_seed(1))
    return model, (tokens,)


def demo_bf16(batch: int = 2):
    return demo(batch=batch, dtype=torch.bfloat16)


def demo_train(batch: int = 2, dropout: float = 0.1, dtype: torch.dtype = torch.float32):
    """The demo GPT with a cross-entropy loss and dropout in the MLP: (model, (tokens, targets))."""
    cfg = dataclasses.replace(GPTConfig(), dropout=dropout)
    model = _init(GPTWithLoss(cfg), seed=0).to(dtype).train()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
    targets = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
    return model, (tokens, targets)


MEDIUM = GPTConfig(vocab=8192, seq=256, dim=768, heads=12, layers=4)


def medium(batch: int = 8, dtype: torch.dtype = torch.bfloat16):
    """A GPT-2-small-width model (4 layers) for benchmarks where kernels, not launches, dominate."""
    return demo(batch=batch, dtype=dtype, cfg=MEDIUM)


# The anchor of the training and serving issues: GPT-2-small width, 4 layers, T = 1024, tanh GELU.
ANCHOR = GPTConfig(vocab=8192, seq=1024, dim=768, heads=12, layers=4, gelu="tanh")


def anchor(batch: int = 8, seq: int = 1024, dtype: torch.dtype = torch.bfloat16):
    """Inference: (model, (tokens [batch, seq],)) of the anchor GPT, bf16 weights."""
    cfg = dataclasses.replace(ANCHOR, seq=seq)
    model = _init(GPT(cfg), seed=0).to(dtype).eval()
    tokens = torch.randint(0, cfg.vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, (tokens,)


def anchor_train(batch: int = 8, seq: int = 1024, dtype: torch.dtype = torch.bfloat16):
    """Training: the anchor GPT with cross-entropy on logits.float(), dropout off: (model, (tokens, targets))."""
    cfg = dataclasses.replace(ANCHOR, seq=seq)
    model = _init(GPTWithLoss(cfg), seed=0).to(dtype).train()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (batch, seq), generator=g)
    targets = torch.randint(0, cfg.vocab, (batch, seq), generator=g)
    return model, (tokens, targets)
