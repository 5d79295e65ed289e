"""The model zoo: the models people use, each built the way its users build and call it.

ONE list, `ZOO`, read by tests/test_zoo.py (CPU path, tiny configs), scripts/zoo_probe.py (the map of
what builds), and later by docs/models.md generation and the GPU benchmark (realistic sizes).

Each `ZooEntry` has two factories, `tiny(train=False, dtype=torch.float32, seed=0)` and
`realistic(...)` with the same signature; both return an `Example`:
- `model`: in eval() mode for inference, train() mode for training (dropout probabilities are 0 in
  every config, so train mode changes only BatchNorm, which then uses batch statistics and updates
  its running buffers, as in a user's training step);
- `args`, `kwargs`: the example call `model(*args, **kwargs)`, keyword arguments as users pass them
  (`input_ids=`, `attention_mask=`, `pixel_values=`, and `labels=` for training, so the model computes
  its own loss and returns it as `out.loss` / `out["loss"]`);
- `make_inputs(seed)`: fresh random `(args, kwargs)` with the same shapes, dtypes and value ranges
  (token ids in the vocabulary, ignore-index -100 where the model's loss expects it).

Attention: transformers models are built with `attn_implementation="sdpa"` (what they use by
default on a GPU; the eager path writes the same math out in matmul + softmax and is covered by our
own examples). Sizes: tiny = 2 layers, hidden 64, vocab 128, seq 16, batch 2 (ViT image 32 patch 8;
CNNs 32-36 px images with narrow channels); realistic = the sizes a GPU benchmark wants (Llama
8 layers hidden 2048 heads 16/4kv batch 2x2048; ResNet-18 batch 64 224x224 channels_last; ViT-B/16
batch 64).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from .tv_resnet import ResNet18, WithCrossEntropy
from .unet import NoiseLoss, UNet

__all__ = ["Example", "ZooEntry", "ZOO", "entry", "have_transformers"]


@dataclasses.dataclass
class Example:
    model: torch.nn.Module
    args: tuple
    kwargs: dict[str, Any]
    make_inputs: Callable[[int], tuple[tuple, dict[str, Any]]]

    def call(self, model=None, inputs=None):
        args, kwargs = inputs if inputs is not None else (self.args, self.kwargs)
        return (self.model if model is None else model)(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    name: str
    tiny: Callable[..., Example]
    realistic: Callable[..., Example]
    needs: tuple[str, ...] = ()  # importable packages the entry needs ("transformers")
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)  # what the test tier checks (fp32; a bf16 subset)
    note: str = ""


def have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _finish(model: torch.nn.Module, train: bool, dtype: torch.dtype) -> torch.nn.Module:
    model = model.to(dtype)
    return model.train() if train else model.eval()


def _hf(cls_name: str, cfg_name: str, seed: int, attn: str | None = "sdpa", **cfg):
    import transformers

    config = getattr(transformers, cfg_name)(**cfg)
    if attn is not None:  # models without attention (ResNet) refuse the setting
        config._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):  # building an example must not disturb the caller's RNG
        torch.manual_seed(seed)
        return getattr(transformers, cls_name)(config)


# ---------------------------------------------------------------- causal LMs

def _causal_lm(cls_name: str, cfg_name: str, cfg: dict, batch: int, seq: int, train: bool, dtype, seed: int):
    model = _finish(_hf(cls_name, cfg_name, seed, use_cache=False, **cfg), train, dtype)
    vocab = cfg["vocab_size"]

    def make_inputs(s: int):
        ids = torch.randint(0, vocab, (batch, seq), generator=_gen(s))
        kw = {"input_ids": ids}
        if train:
            kw["labels"] = ids.clone()
        return (), kw

    return Example(model, *make_inputs(seed + 1), make_inputs)


def _llama_cfg(tiny: bool) -> dict:
    if tiny:
        return dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)


def llama(train=False, dtype=torch.float32, seed=0):
    """LlamaForCausalLM: RMSNorm, RoPE, GQA (4 heads / 2 kv heads), SwiGLU, causal mask."""
    return _causal_lm("LlamaForCausalLM", "LlamaConfig", _llama_cfg(True), 2, 16, train, dtype, seed)


def llama_realistic(train=False, dtype=torch.bfloat16, seed=0):
    return _causal_lm("LlamaForCausalLM", "LlamaConfig", _llama_cfg(False), 2, 2048, train, dtype, seed)


def qwen2(train=False, dtype=torch.float32, seed=0):
    """Qwen2ForCausalLM: Llama-like with q/k/v biases and GQA."""
    cfg = _llama_cfg(True)
    return _causal_lm("Qwen2ForCausalLM", "Qwen2Config", cfg, 2, 16, train, dtype, seed)


def qwen2_realistic(train=False, dtype=torch.bfloat16, seed=0):
    return _causal_lm("Qwen2ForCausalLM", "Qwen2Config", _llama_cfg(False), 2, 2048, train, dtype, seed)


def _gpt2_cfg(tiny: bool) -> dict:
    drop = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if tiny:
        return dict(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
                    **drop)
    return dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, **drop)


def gpt2(train=False, dtype=torch.float32, seed=0):
    """GPT2LMHeadModel: learned positions, LayerNorm, Conv1D projections, tanh-GELU, tied head."""
    return _causal_lm("GPT2LMHeadModel", "GPT2Config", _gpt2_cfg(True), 2, 16, train, dtype, seed)


def gpt2_realistic(train=False, dtype=torch.bfloat16, seed=0):
    return _causal_lm("GPT2LMHeadModel", "GPT2Config", _gpt2_cfg(False), 8, 1024, train, dtype, seed)


# ---------------------------------------------------------------- BERT (masked LM, padding mask)

def _bert(tiny: bool, train, dtype, seed):
    if tiny:
        cfg = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                   max_position_embeddings=32)
        batch, seq = 2, 16
    else:
        cfg = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                   intermediate_size=3072, max_position_embeddings=512)
        batch, seq = 32, 512
    model = _finish(_hf("BertForMaskedLM", "BertConfig", seed, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, **cfg), train, dtype)
    vocab = cfg["vocab_size"]

    def make_inputs(s: int):
        g = _gen(s)
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[1:, seq - seq // 4:] = 0  # the later rows are padded: a padding mask, not all ones
        kw = {"input_ids": ids, "attention_mask": mask}
        if train:
            picked = torch.rand(batch, seq, generator=g) < 0.3
            picked[:, 0] = True  # at least one target per row
            kw["labels"] = torch.where(picked & (mask == 1), ids, torch.full_like(ids, -100))
        return (), kw

    return Example(model, *make_inputs(seed + 1), make_inputs)


def bert(train=False, dtype=torch.float32, seed=0):
    """BertForMaskedLM: padding attention mask, token types, LayerNorm, GELU, -100 ignored labels."""
    return _bert(True, train, dtype, seed)


def bert_realistic(train=False, dtype=torch.bfloat16, seed=0):
    return _bert(False, train, dtype, seed)


# ---------------------------------------------------------------- vision

def _images(batch: int, size: int, n_labels: int, train: bool, dtype, channels_last: bool = False):
    def make_inputs(s: int):
        g = _gen(s)
        x = torch.randn(batch, 3, size, size, generator=g).to(dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        kw = {"pixel_values": x}
        if train:
            kw["labels"] = torch.randint(0, n_labels, (batch,), generator=g)
        return (), kw
    return make_inputs


def _vit(tiny: bool, train, dtype, seed):
    if tiny:
        cfg = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=128, num_labels=10)
        batch = 2
    else:
        cfg = dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                   intermediate_size=3072, num_labels=1000)
        batch = 64
    model = _finish(_hf("ViTForImageClassification", "ViTConfig", seed, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, **cfg), train, dtype)
    make = _images(batch, cfg["image_size"], cfg["num_labels"], train, dtype)
    return Example(model, *make(seed + 1), make)


def vit(train=False, dtype=torch.float32, seed=0):
    """ViTForImageClassification: patch conv, CLS token, learned positions, LayerNorm, GELU."""
    return _vit(True, train, dtype, seed)


def vit_realistic(train=False, dtype=torch.bfloat16, seed=0):
    return _vit(False, train, dtype, seed)


def _hf_resnet(tiny: bool, train, dtype, seed):
    if tiny:
        cfg = dict(embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], layer_type="basic",
                   num_labels=10)
        batch, size = 2, 32
    else:
        cfg = dict(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3],
                   layer_type="bottleneck", num_labels=1000)
        batch, size = 64, 224
    model = _finish(_hf("ResNetForImageClassification", "ResNetConfig", seed, attn=None, **cfg), train, dtype)
    make = _images(batch, size, cfg["num_labels"], train, dtype, channels_last=not tiny)
    if not tiny:
        model = model.to(memory_format=torch.channels_last)
    return Example(model, *make(seed + 1), make)


def hf_resnet(train=False, dtype=torch.float32, seed=0):
    """transformers' ResNetForImageClassification (basic blocks): padded max-pool stem, BatchNorm."""
    return _hf_resnet(True, train, dtype, seed)


def hf_resnet_realistic(train=False, dtype=torch.bfloat16, seed=0):
    return _hf_resnet(False, train, dtype, seed)


def _tv_resnet18(tiny: bool, train, dtype, seed):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if tiny:  # 36 px: the ceil-mode stem pool gives 10x10 where floor mode gives 9x9
            net = ResNet18(num_classes=10, widths=(8, 16, 32, 64), ceil_mode=True, avg_down=True)
        else:
            net = ResNet18(num_classes=1000)
    batch, size, classes = (2, 36, 10) if tiny else (64, 224, 1000)
    model = _finish(WithCrossEntropy(net), train, dtype)
    if not tiny:
        model = model.to(memory_format=torch.channels_last)
    make = _images(batch, size, classes, train, dtype, channels_last=not tiny)
    return Example(model, *make(seed + 1), make)


def tv_resnet18(train=False, dtype=torch.float32, seed=0):
    """torchvision-style ResNet-18 (aotfuse/testing/tv_resnet.py): padded ceil-mode max-pool stem,
    ceil-mode avg-pool shortcuts, adaptive avg pool, BatchNorm (batch statistics in train mode)."""
    return _tv_resnet18(True, train, dtype, seed)


def tv_resnet18_realistic(train=False, dtype=torch.bfloat16, seed=0):
    return _tv_resnet18(False, train, dtype, seed)


# ---------------------------------------------------------------- more architectures (a survey of 59, 2026-11-26)

def _mistral(tiny: bool, train, dtype, seed):
    cfg = dict(_llama_cfg(tiny), sliding_window=8 if tiny else 1024)
    batch, seq = (2, 16) if tiny else (2, 2048)
    return _causal_lm("MistralForCausalLM", "MistralConfig", cfg, batch, seq, train, dtype, seed)


def mistral(train=False, dtype=torch.float32, seed=0):
    """MistralForCausalLM: Llama-like with a sliding-window causal mask (8 of 16 tokens here)."""
    return _mistral(True, train, dtype, seed)


def mistral_realistic(train=False, dtype=torch.bfloat16, seed=0):
    return _mistral(False, train, dtype, seed)


def _seq2seq_inputs(vocab: int, batch: int, src: int, tgt: int, train: bool, features=None, dtype=torch.float32):
    def make_inputs(s: int):
        g = _gen(s)
        kw = {}
        if features is None:
            ids = torch.randint(2, vocab, (batch, src), generator=g)
            mask = torch.ones(batch, src, dtype=torch.int64)
            mask[1:, src - src // 4:] = 0  # padded sources
            kw = {"input_ids": ids, "attention_mask": mask}
        else:
            kw = {"input_features": torch.randn(batch, *features, generator=g).to(dtype)}
        out = torch.randint(3, vocab, (batch, tgt), generator=g)
        if train:
            out[1:, tgt - tgt // 4:] = -100  # ignored label positions
            kw["labels"] = out  # the model shifts them right into its decoder inputs
        else:
            kw["decoder_input_ids"] = out
        return (), kw
    return make_inputs


def _t5(tiny: bool, train, dtype, seed):
    if tiny:
        cfg = dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16)
        batch, src, tgt = 2, 16, 8
    else:  # t5-small
        cfg = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8)
        batch, src, tgt = 16, 512, 128
    model = _finish(_hf("T5ForConditionalGeneration", "T5Config", seed, dropout_rate=0.0, decoder_start_token_id=0,
                        pad_token_id=0, eos_token_id=1, use_cache=False, **cfg), train, dtype)
    make = _seq2seq_inputs(cfg["vocab_size"], batch, src, tgt, train)
    return Example(model, *make(seed + 1), make)


def t5(train=False, dtype=torch.float32, seed=0):
    """T5ForConditionalGeneration: encoder-decoder, relative position buckets, RMS-style LayerNorm, padded
    sources, labels shifted right by the model (a value written into a tensor in forward)."""
    return _t5(True, train, dtype, seed)


def t5_realistic(train=False, dtype=torch.bfloat16, seed=0):
    return _t5(False, train, dtype, seed)


def _whisper(tiny: bool, train, dtype, seed):
    if tiny:
        cfg = dict(vocab_size=128, num_mel_bins=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                   decoder_attention_heads=4, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128,
                   max_source_positions=8, max_target_positions=16)
        batch, frames, tgt = 2, 16, 8
    else:  # whisper-base
        cfg = dict(vocab_size=51865, num_mel_bins=80, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                   decoder_attention_heads=8, d_model=512, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
                   max_source_positions=1500, max_target_positions=448)
        batch, frames, tgt = 8, 3000, 128
    model = _finish(_hf("WhisperForConditionalGeneration", "WhisperConfig", seed, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None, use_cache=False,
                        **cfg), train, dtype)
    make = _seq2seq_inputs(cfg["vocab_size"], batch, 0, tgt, train, features=(cfg["num_mel_bins"], frames), dtype=dtype)
    return Example(model, *make(seed + 1), make)


def whisper(train=False, dtype=torch.float32, seed=0):
    """WhisperForConditionalGeneration: conv1d + GELU audio stem, encoder-decoder, cross attention."""
    return _whisper(True, train, dtype, seed)


def whisper_realistic(train=False, dtype=torch.bfloat16, seed=0):
    return _whisper(False, train, dtype, seed)


def _unet(tiny: bool, train, dtype, seed):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = UNet(16, (1, 2), 4) if tiny else UNet(128, (1, 2, 2), 32)
    model = _finish(NoiseLoss(net), train, dtype)
    batch, size = (2, 16) if tiny else (16, 64)

    def make_inputs(s: int):
        g = _gen(s)
        x = torch.randn(batch, 3, size, size, generator=g).to(dtype)
        t = torch.randint(0, 1000, (batch,), generator=g)
        if train:
            return (x, t, torch.randn(batch, 3, size, size, generator=g).to(dtype)), {}
        return (x, t), {}

    return Example(model, *make_inputs(seed + 1), make_inputs)


def unet(train=False, dtype=torch.float32, seed=0):
    """A diffusion-style UNet (aotfuse/testing/unet.py): GroupNorm + SiLU residual blocks, a timestep embedding,
    strided-conv downsampling, nearest x2 upsampling with skip concatenation, MSE loss on the noise."""
    return _unet(True, train, dtype, seed)


def unet_realistic(train=False, dtype=torch.bfloat16, seed=0):
    return _unet(False, train, dtype, seed)


# ---------------------------------------------------------------- the list

_TF = ("transformers",)
ZOO: tuple[ZooEntry, ...] = (
    ZooEntry("llama", llama, llama_realistic, _TF, (torch.float32, torch.bfloat16)),
    ZooEntry("qwen2", qwen2, qwen2_realistic, _TF),
    ZooEntry("gpt2", gpt2, gpt2_realistic, _TF, (torch.float32, torch.bfloat16)),
    ZooEntry("bert", bert, bert_realistic, _TF),
    ZooEntry("vit", vit, vit_realistic, _TF, (torch.float32, torch.bfloat16)),
    ZooEntry("hf_resnet", hf_resnet, hf_resnet_realistic, _TF),
    ZooEntry("tv_resnet18", tv_resnet18, tv_resnet18_realistic, (), (torch.float32, torch.bfloat16)),
    ZooEntry("mistral", mistral, mistral_realistic, _TF),
    ZooEntry("t5", t5, t5_realistic, _TF),
    ZooEntry("whisper", whisper, whisper_realistic, _TF),
    ZooEntry("unet", unet, unet_realistic, (), (torch.float32, torch.bfloat16)),
)


# (entry, mode) -> (error class name, message fragment, why): what still stops a case today. The test
# tier marks these xfail(strict=True) on exactly that error, and docs/models.md prints them.
KNOWN_FAILURES: dict[tuple[str, str], tuple[str, str, str]] = {}


def entry(name: str) -> ZooEntry:
    for e in ZOO:
        if e.name == name:
            return e
    raise KeyError(f"no zoo entry {name!r}; entries: {', '.join(e.name for e in ZOO)}")


# ---------------------------------------------------------------- calling a built archive

def flat_inputs(inputs: tuple[tuple, dict], call: dict) -> list[torch.Tensor]:
    """The program's flat inputs for a call `(args, kwargs)`: what the manifest's `call["inputs"]` says
    (positional tensors, then keyword tensors in the recorded order)."""
    args, kwargs = inputs
    if len(args) != call["positional"]:
        raise ValueError(f"expected {call['positional']} positional inputs, got {len(args)}")
    return list(args) + [kwargs[k] for k in call["keywords"]]


def output_leaves(out) -> list:
    """An eager output's tensors in the order a program returns them (pytree leaves)."""
    import torch.utils._pytree as pytree

    return pytree.tree_leaves(out)


def loss_of(out) -> torch.Tensor:
    """The loss of an eager training call: `out.loss`, `out["loss"]` or the output itself."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "keys"):
        return out["loss"]
    return out[0]
