"""More of the zoo: architectures (transformers', and a plain-torch LSTM) that each exercise something the main
zoo does not.

A second list, `MORE`, read by tests/test_zoo_more.py (CPU path, tiny configs) and
`scripts/zoo_probe.py --more`, which also runs `SPARE` (entries that pass but that the test tier leaves
out for time). Same conventions as aotfuse/testing/zoo.py (its `Example`, its helpers):
each `tiny(train=False, dtype=torch.float32, seed=0)` returns an `Example` whose model is in eval()
mode for inference and train() mode for training, every dropout probability 0, built under a fixed
seed without disturbing the caller's RNG; `labels=` (or CLIP's `return_loss=True`) for training so the
model returns its own loss; `make_inputs(seed)` gives fresh inputs of the same shapes.

`realistic` is set for the entries in REALISTIC (full width, fewer layers: `scripts/zoo_gpu.py NAME --more`),
None for the rest. Attention is
`attn_implementation="sdpa"` where the model accepts it, "eager" where transformers refuses sdpa
(Gemma 2, DeBERTa-v2, BLOOM), none for the CNNs. The set came from a probe of 41 architectures
(2026-11-27); each entry's docstring says what it covers.

`needs` names importable packages ("transformers") and the classes the entry builds
("transformers.Phi3Config"): `unmet(entry)` says which is missing (an older transformers lacks a
config class), and the test tier skips that entry.
"""
from __future__ import annotations

import importlib

import torch

from .zoo import Example, ZooEntry, _finish, _gen, _hf, _images, _llama_cfg, _seq2seq_inputs

__all__ = ["MORE", "SPARE", "entry", "unmet"]


def unmet(e: ZooEntry) -> str | None:
    """The first of the entry's needs that is not met ("pkg" not importable, "pkg.Attr" absent), or None."""
    for need in e.needs:
        mod, _, attr = need.partition(".")
        try:
            m = importlib.import_module(mod)
        except ImportError:
            return f"needs {mod} (test extra)"
        if attr:
            try:
                getattr(m, attr)  # transformers imports the class's module here (lazily)
            except Exception as exc:  # noqa: BLE001 - absent (AttributeError) or its module fails to import
                return f"needs {need} ({mod} {getattr(m, '__version__', '?')}: {type(exc).__name__})"
    return None


# ---------------------------------------------------------------- helpers

def _causal(cls_name: str, cfg_name: str, cfg: dict, train: bool, dtype, seed: int, attn: str = "sdpa",
            batch: int = 2, seq: int = 16) -> Example:
    """A causal LM called with input_ids (and labels=input_ids for training: the model shifts them)."""
    model = _finish(_hf(cls_name, cfg_name, seed, attn=attn, use_cache=False, **cfg), train, dtype)
    vocab = cfg["vocab_size"]

    def make_inputs(s: int):
        ids = torch.randint(3, vocab, (batch, seq), generator=_gen(s))  # above the special tokens
        kw = {"input_ids": ids}
        if train:
            kw["labels"] = ids.clone()
        return (), kw

    return Example(model, *make_inputs(seed + 1), make_inputs)


def _encoder(cls_name: str, cfg_name: str, cfg: dict, train: bool, dtype, seed: int, attn: str = "sdpa",
             labels: str = "mlm", batch: int = 2, seq: int = 16) -> Example:
    """An encoder with a padding mask (the later rows padded); labels: "mlm" (-100 where not picked or
    padded, as zoo.bert) or "cls" (one class of 3 per row)."""
    model = _finish(_hf(cls_name, cfg_name, seed, attn=attn, **cfg), train, dtype)
    vocab = cfg["vocab_size"]

    def make_inputs(s: int):
        g = _gen(s)
        ids = torch.randint(3, vocab, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[1:, seq - seq // 4:] = 0
        kw = {"input_ids": ids, "attention_mask": mask}
        if train:
            if labels == "mlm":
                picked = torch.rand(batch, seq, generator=g) < 0.3
                picked[:, 0] = True  # at least one target per row
                kw["labels"] = torch.where(picked & (mask == 1), ids, torch.full_like(ids, -100))
            else:
                kw["labels"] = torch.randint(0, cfg["num_labels"], (batch,), generator=g)
        return (), kw

    return Example(model, *make_inputs(seed + 1), make_inputs)


def _vision(cls_name: str, cfg_name: str, cfg: dict, train: bool, dtype, seed: int, attn: str | None = "sdpa",
            size: int = 32, batch: int = 2) -> Example:
    model = _finish(_hf(cls_name, cfg_name, seed, attn=attn, **cfg), train, dtype)
    make = _images(batch, size, cfg["num_labels"], train, dtype)
    return Example(model, *make(seed + 1), make)


# ---------------------------------------------------------------- decoders

def phi3(train=False, dtype=torch.float32, seed=0):
    """Phi3ForCausalLM: fused qkv / gate-up projections; full rotary, so the pass-through slice of the
    rotary embedding (`q[..., rotary_dim:]`) is empty and concatenated back."""
    cfg = dict(_llama_cfg(True), original_max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0,
               attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _causal("Phi3ForCausalLM", "Phi3Config", cfg, train, dtype, seed)


def falcon(train=False, dtype=torch.float32, seed=0):
    """FalconForCausalLM, falcon-7b style (config defaults): multi-query attention, one key/value head
    broadcast over 4 query heads inside sdpa; parallel attention + MLP; ALiBi off, rotary on."""
    cfg = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, hidden_dropout=0.0,
               attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    return _causal("FalconForCausalLM", "FalconConfig", cfg, train, dtype, seed)


def gemma2(train=False, dtype=torch.float32, seed=0):
    """Gemma2ForCausalLM (eager attention: transformers refuses sdpa): tanh soft-capping of the attention
    logits and the final logits, alternating sliding-window (8) and full layers, sandwich RMSNorms."""
    cfg = dict(_llama_cfg(True), head_dim=16, pad_token_id=0, bos_token_id=2, eos_token_id=1, sliding_window=8,
               query_pre_attn_scalar=16, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    return _causal("Gemma2ForCausalLM", "Gemma2Config", cfg, train, dtype, seed, attn="eager")


def gemma3(train=False, dtype=torch.float32, seed=0):
    """Gemma3ForCausalLM (text): both layers sliding-window (the pattern puts a full layer every 6th), so the
    full causal mask transformers still builds is dead code; q/k RMSNorms, local/global rotary."""
    cfg = dict(_llama_cfg(True), head_dim=16, pad_token_id=0, bos_token_id=2, eos_token_id=1, sliding_window=8,
               query_pre_attn_scalar=16)
    return _causal("Gemma3ForCausalLM", "Gemma3TextConfig", cfg, train, dtype, seed)


def gpt_neox(train=False, dtype=torch.float32, seed=0):
    """GPTNeoXForCausalLM: partial rotary (a quarter of each head), parallel residual, fused qkv."""
    cfg = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               max_position_embeddings=64, rotary_pct=0.25, hidden_dropout=0.0, attention_dropout=0.0,
               use_parallel_residual=True, bos_token_id=0, eos_token_id=0)
    return _causal("GPTNeoXForCausalLM", "GPTNeoXConfig", cfg, train, dtype, seed)


def opt(train=False, dtype=torch.float32, seed=0):
    """OPTForCausalLM: learned positions offset by 2 (from the attention mask's cumsum), ReLU MLP."""
    cfg = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
               max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, layerdrop=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    return _causal("OPTForCausalLM", "OPTConfig", cfg, train, dtype, seed)


def bloom(train=False, dtype=torch.float32, seed=0):
    """BloomForCausalLM (eager attention: transformers refuses sdpa): ALiBi position bias added to the
    scores (baddbmm), embedding LayerNorm, tanh-GELU."""
    cfg = dict(vocab_size=128, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0,
               bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return _causal("BloomForCausalLM", "BloomConfig", cfg, train, dtype, seed, attn="eager")


def mixtral(train=False, dtype=torch.float32, seed=0, experts="grouped_mm"):
    """MixtralForCausalLM with transformers' default experts ("grouped_mm"): top-2 of 4 experts routed per token
    (softmax, topk: its backward scatters 2 values per row into [tokens, experts]), the routed tokens sorted by
    expert, counted per expert (aten.histc) and run as grouped matmuls by the counts' offsets (aten._grouped_mm in
    bf16; transformers' fallback op in float32, rewritten to it: export/experts.py)."""
    cfg = dict(_llama_cfg(True), num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
               experts_implementation=experts)
    return _causal("MixtralForCausalLM", "MixtralConfig", cfg, train, dtype, seed)


def llama4_text(train=False, dtype=torch.float32, seed=0):
    """Llama4ForCausalLM (text): its rotary embedding as complex rotations (view_as_complex and a complex product,
    computed as real pairs: export/complex.py), chunked attention, a routed expert (top-1) beside a shared one."""
    cfg = dict(_llama_cfg(True), intermediate_size_mlp=128, head_dim=16, num_local_experts=4,
               interleave_moe_layer_step=1, attention_chunk_size=8, num_experts_per_tok=1)
    return _causal("Llama4ForCausalLM", "Llama4TextConfig", cfg, train, dtype, seed)


def qwen3_moe(train=False, dtype=torch.float32, seed=0):
    """Qwen3MoeForCausalLM: 4 small experts, top-2 with normalized weights, query/key RMSNorm, default grouped
    experts."""
    cfg = dict(_llama_cfg(True), head_dim=16, num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2,
               decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    return _causal("Qwen3MoeForCausalLM", "Qwen3MoeConfig", cfg, train, dtype, seed)


def mixtral_batched(train=False, dtype=torch.float32, seed=0):
    """Mixtral with experts_implementation="batched_mm": the experts as batched matmuls on weights gathered per
    (token, expert) pair (static shapes, no grouping; memory grows with tokens x hidden x ffn)."""
    return mixtral(train, dtype, seed, experts="batched_mm")


# ---------------------------------------------------------------- encoders

_BERTISH = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def deberta_v2(train=False, dtype=torch.float32, seed=0):
    """DebertaV2ForMaskedLM (eager attention): disentangled relative-position attention (c2p and p2c,
    log-bucketed positions gathered from a shared relative embedding), no absolute positions."""
    cfg = dict(_BERTISH, relative_attention=True, position_biased_input=False, pos_att_type=["p2c", "c2p"],
               norm_rel_ebd="layer_norm", share_att_key=True, max_relative_positions=-1, position_buckets=8)
    return _encoder("DebertaV2ForMaskedLM", "DebertaV2Config", cfg, train, dtype, seed, attn="eager")


def distilbert(train=False, dtype=torch.float32, seed=0):
    """DistilBertForSequenceClassification: no token types, a pre-classifier on the first token, a
    classification loss over 3 labels."""
    cfg = dict(vocab_size=128, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=32,
               dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=3)
    return _encoder("DistilBertForSequenceClassification", "DistilBertConfig", cfg, train, dtype, seed,
                    labels="cls")


def roberta(train=False, dtype=torch.float32, seed=0):
    """RobertaForMaskedLM: positions from the input ids (cumsum of the non-padding mask, offset by pad id)."""
    return _encoder("RobertaForMaskedLM", "RobertaConfig", dict(_BERTISH, pad_token_id=1), train, dtype, seed)


# ---------------------------------------------------------------- seq2seq

def bart(train=False, dtype=torch.float32, seed=0):
    """BartForConditionalGeneration: encoder-decoder with learned positions (offset 2), padded sources,
    labels shifted right into the decoder inputs by the model, the final-logits bias buffer."""
    return _bart(dict(vocab_size=128, d_model=64, layers=2, heads=4, ffn=128, positions=32), train, dtype, seed,
                 batch=2, src=16, tgt=8)


def _bart(size: dict, train: bool, dtype, seed: int, batch: int, src: int, tgt: int) -> Example:
    n, h, f = size["layers"], size["heads"], size["ffn"]
    cfg = dict(vocab_size=size["vocab_size"], d_model=size["d_model"], encoder_layers=n, decoder_layers=n,
               encoder_attention_heads=h, decoder_attention_heads=h, encoder_ffn_dim=f, decoder_ffn_dim=f,
               max_position_embeddings=size["positions"], dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0, pad_token_id=1, bos_token_id=0,
               eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2)
    model = _finish(_hf("BartForConditionalGeneration", "BartConfig", seed, use_cache=False, **cfg), train, dtype)
    make = _seq2seq_inputs(cfg["vocab_size"], batch, src, tgt, train)
    return Example(model, *make(seed + 1), make)


# ---------------------------------------------------------------- multimodal

def _contrastive(cls_name: str, cfg_name: str, train: bool, dtype, seed: int, realistic: bool = False) -> Example:
    if realistic and cls_name == "CLIPModel":  # CLIP ViT-B/32's towers, batch 64
        text = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                    num_attention_heads=8, max_position_embeddings=77, dropout=0.0, attention_dropout=0.0,
                    pad_token_id=0, bos_token_id=1, eos_token_id=49407)
        vision = dict(image_size=224, patch_size=32, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                      num_attention_heads=12, dropout=0.0, attention_dropout=0.0)
        batch, seq, size, proj = 64, 77, 224, 512
    elif realistic:  # SigLIP-B/16's towers (no projections: both 768 wide), 64 tokens, batch 64
        text = dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                    num_attention_heads=12, max_position_embeddings=64, attention_dropout=0.0, pad_token_id=1,
                    bos_token_id=2, eos_token_id=1)
        vision = dict(image_size=224, patch_size=16, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                      num_attention_heads=12, attention_dropout=0.0)
        batch, seq, size, proj = 64, 64, 224, 768
    else:
        text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                    pad_token_id=0, bos_token_id=1, eos_token_id=127)
        vision = dict(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, dropout=0.0, attention_dropout=0.0)
        batch, seq, size, proj = 2, 16, 32, 32
    clip = cls_name == "CLIPModel"
    extra = dict(projection_dim=proj) if clip else {}
    model = _finish(_hf(cls_name, cfg_name, seed, text_config=text, vision_config=vision, **extra), train, dtype)
    eos = text["eos_token_id"]

    def make_inputs(s: int):
        g = _gen(s)
        ids = torch.randint(3, text["vocab_size"] - 1, (batch, seq), generator=g)
        ids[:, -1] = eos  # eos last: CLIP pools the text at the first eos
        kw = {"input_ids": ids}
        if clip:
            kw["attention_mask"] = torch.ones(batch, seq, dtype=torch.int64)
        kw["pixel_values"] = torch.randn(batch, 3, size, size, generator=g).to(dtype)
        if train:
            kw["return_loss"] = True  # a constant: baked into the archive, which then takes only the tensors
        return (), kw

    return Example(model, *make_inputs(seed + 1), make_inputs)


def clip(train=False, dtype=torch.float32, seed=0):
    """CLIPModel: text and vision towers, projections, a learned logit scale (exp), the symmetric
    contrastive loss (cross entropy over the image-text similarity matrix both ways; return_loss=True)."""
    return _contrastive("CLIPModel", "CLIPConfig", train, dtype, seed)


def siglip(train=False, dtype=torch.float32, seed=0):
    """SiglipModel: the patch embedding is a Conv2d with padding="valid" (recorded as padding [0]), attention
    pooling head in the vision tower, sigmoid pairwise loss (return_loss=True)."""
    return _contrastive("SiglipModel", "SiglipConfig", train, dtype, seed)


# ---------------------------------------------------------------- vision

_VIT = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def swin(train=False, dtype=torch.float32, seed=0):
    """SwinForImageClassification: window attention over 8x8 patches in 4x4 windows, the stage's second layer
    shifted (roll by 2 and back, the shifted windows' mask), a relative position bias table, patch merging
    into a 4x4 stage (one window, no shift)."""
    cfg = dict(image_size=32, patch_size=4, embed_dim=16, depths=[2, 1], num_heads=[2, 4], window_size=4,
               num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    return _vision("SwinForImageClassification", "SwinConfig", cfg, train, dtype, seed)


def convnext(train=False, dtype=torch.float32, seed=0):
    """ConvNextForImageClassification: 7x7 depthwise convolutions, channels-last LayerNorm (permutes),
    layer scale parameters, patchify stem."""
    cfg = dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], num_labels=10, drop_path_rate=0.0)
    return _vision("ConvNextForImageClassification", "ConvNextConfig", cfg, train, dtype, seed, attn=None)


def _segformer(cfg: dict, train: bool, dtype, seed: int, batch: int = 2, size: int = 32) -> Example:
    model = _finish(_hf("SegformerForSemanticSegmentation", "SegformerConfig", seed, **cfg), train, dtype)

    def make_inputs(s: int):
        g = _gen(s)
        kw = {"pixel_values": torch.randn(batch, 3, size, size, generator=g).to(dtype)}
        if train:
            kw["labels"] = torch.randint(0, cfg["num_labels"], (batch, size, size), generator=g)
        return (), kw

    return Example(model, *make_inputs(seed + 1), make_inputs)


_SEG_DROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
                 drop_path_rate=0.0)


def segformer(train=False, dtype=torch.float32, seed=0):
    """SegformerForSemanticSegmentation: overlapping patch embeddings, spatial-reduction attention, Mix-FFN
    (depthwise conv), an all-MLP decode head that upsamples (bilinear) each stage and fuses them, BatchNorm
    in the head, per-pixel cross entropy on labels upsampled logits."""
    cfg = dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3],
               strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=5,
               **_SEG_DROP)
    return _segformer(cfg, train, dtype, seed)


def dinov2(train=False, dtype=torch.float32, seed=0):
    """Dinov2Model for inference (its hidden states and pooled output); Dinov2ForImageClassification for
    training (a head on the CLS token and the mean patch token; the bare model has no loss). Layer
    scale on both residual branches."""
    cfg = dict(_VIT, mlp_ratio=2, drop_path_rate=0.0, num_labels=10)
    return _vision("Dinov2ForImageClassification" if train else "Dinov2Model", "Dinov2Config", cfg, train, dtype,
                   seed)


def mobilenet_v2(train=False, dtype=torch.float32, seed=0):
    """MobileNetV2ForImageClassification: inverted residuals (1x1 expand, 3x3 depthwise, 1x1 project), ReLU6,
    TF-style padding, BatchNorm (momentum 0.997) in train mode: batch statistics and running buffers."""
    cfg = dict(image_size=32, depth_multiplier=0.25, min_depth=8, num_labels=10, classifier_dropout_prob=0.0)
    return _vision("MobileNetV2ForImageClassification", "MobileNetV2Config", cfg, train, dtype, seed, attn=None)


def efficientnet(train=False, dtype=torch.float32, seed=0):
    """EfficientNetForImageClassification: MBConv blocks (depthwise convs, squeeze-excitation), swish, train-mode
    BatchNorm, and a head that pools with nn.AvgPool2d(hidden_dim, ceil_mode=True): a kernel of 320 over a 1 x 1
    map (lower/pool.py visits only the taps on the input). transformers' initialization makes the logits exactly 0,
    so every parameter is moved off it (0.05 N(0, 1)): otherwise the comparison would hold no numbers."""
    cfg = dict(image_size=32, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320, dropout_rate=0.0,
               drop_connect_rate=0.0, num_labels=10)
    return _off_zero(_vision("EfficientNetForImageClassification", "EfficientNetConfig", cfg, train, dtype, seed,
                             attn=None), seed)


def _fan_out_init(ex: Example, seed: int) -> Example:
    """Initialized as torchvision's EfficientNet is (convolutions Kaiming normal, fan out; BatchNorm weight 1, bias 0;
    the classifier uniform in +-1/sqrt(classes)): transformers' N(0, 0.02) BatchNorm weights shrink the activations of
    B0's 16 blocks to 1e-30 (the logits exactly 0 at 224 x 224), and a perturbation of every parameter makes a bf16 network whose gradients
    differ from fp32 eager's by more than their size. Either way a comparison would hold no numbers."""
    g = torch.Generator().manual_seed(seed + 1234)
    with torch.no_grad():
        for m in ex.model.modules():
            if isinstance(m, torch.nn.Conv2d):
                fan_out = m.out_channels * m.kernel_size[0] * m.kernel_size[1] // m.groups
                m.weight.copy_((torch.randn(m.weight.shape, generator=g) * (2.0 / fan_out) ** 0.5).to(m.weight.dtype))
            elif isinstance(m, torch.nn.Linear):
                r = 1.0 / m.out_features ** 0.5
                m.weight.copy_(((torch.rand(m.weight.shape, generator=g) * 2 - 1) * r).to(m.weight.dtype))
            elif isinstance(m, torch.nn.BatchNorm2d):
                m.weight.fill_(1.0)
                m.bias.zero_()
        if not ex.model.training:  # inference: running statistics of a batch, as a trained model has some
            ex.model.train()
            args, kwargs = ex.make_inputs(seed + 99)
            ex.model(*args, **kwargs)
            ex.model.eval()
    return ex


def _off_zero(ex: Example, seed: int) -> Example:
    """Every parameter moved off transformers' initialization by 0.05 N(0, 1) (EfficientNet's makes the logits
    exactly 0, so a comparison with eager would hold no numbers)."""
    g = torch.Generator().manual_seed(seed + 1234)
    with torch.no_grad():
        for p in ex.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.dtype))
    return ex


# ---------------------------------------------------------------- realistic sizes (the GPU benchmark)
# Full width, fewer layers than the released checkpoints where a model is deep (the per-layer work is what the
# benchmark compares; builds stay under a minute on the GPU machine). scripts/zoo_gpu.py NAME --more.

def phi3_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """Phi-3-mini's width (3072, 32 heads, MLP 8192, vocab 32064), 4 layers, batch 2 x 2048."""
    cfg = dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=4,
               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
               original_max_position_embeddings=4096, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _causal("Phi3ForCausalLM", "Phi3Config", cfg, train, dtype, seed, batch=2, seq=2048)


def gemma2_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """Gemma-2-2B's width (2304, 8 heads of 256, 4 key/value heads, MLP 9216, vocab 256000), 4 layers (sliding
    window 4096 and full alternating), eager attention with soft-capping, batch 2 x 1024."""
    cfg = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
               sliding_window=4096, query_pre_attn_scalar=256, final_logit_softcapping=30.0,
               attn_logit_softcapping=50.0, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    return _causal("Gemma2ForCausalLM", "Gemma2Config", cfg, train, dtype, seed, attn="eager", batch=2, seq=1024)


def gpt_neox_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """Pythia-1B's width (2048, 8 heads of 256, MLP 8192, vocab 50304, rotary on a quarter), 4 layers, 4 x 2048."""
    cfg = dict(vocab_size=50304, hidden_size=2048, num_hidden_layers=4, num_attention_heads=8,
               intermediate_size=8192, max_position_embeddings=2048, rotary_pct=0.25, hidden_dropout=0.0,
               attention_dropout=0.0, use_parallel_residual=True, bos_token_id=0, eos_token_id=0)
    return _causal("GPTNeoXForCausalLM", "GPTNeoXConfig", cfg, train, dtype, seed, batch=4, seq=2048)


def deberta_v2_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """DeBERTa-v3-base's width (768, 12 heads, 256 position buckets, vocab 128100), 6 layers, batch 16 x 512."""
    cfg = dict(vocab_size=128100, hidden_size=768, num_hidden_layers=6, num_attention_heads=12,
               intermediate_size=3072, max_position_embeddings=512, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, relative_attention=True, position_biased_input=False,
               pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True,
               max_relative_positions=-1, position_buckets=256)
    return _encoder("DebertaV2ForMaskedLM", "DebertaV2Config", cfg, train, dtype, seed, attn="eager", batch=16,
                    seq=512)


def swin_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """Swin-T (96, depths 2-2-6-2, heads 3-6-12-24, 7 x 7 windows), 224 x 224, batch 64."""
    cfg = dict(image_size=224, patch_size=4, embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
               window_size=7, num_labels=1000, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               drop_path_rate=0.0)
    return _vision("SwinForImageClassification", "SwinConfig", cfg, train, dtype, seed, size=224, batch=64)


def convnext_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """ConvNeXt-T (96-192-384-768, depths 3-3-9-3), 224 x 224, batch 64."""
    cfg = dict(hidden_sizes=[96, 192, 384, 768], depths=[3, 3, 9, 3], num_labels=1000, drop_path_rate=0.0)
    return _vision("ConvNextForImageClassification", "ConvNextConfig", cfg, train, dtype, seed, attn=None,
                   size=224, batch=64)


def segformer_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """SegFormer-B0 (32-64-160-256, reduction 8-4-2-1, decoder 256, 150 classes), 512 x 512, batch 8."""
    cfg = dict(num_encoder_blocks=4, depths=[2, 2, 2, 2], sr_ratios=[8, 4, 2, 1], hidden_sizes=[32, 64, 160, 256],
               patch_sizes=[7, 3, 3, 3], strides=[4, 2, 2, 2], num_attention_heads=[1, 2, 5, 8],
               mlp_ratios=[4, 4, 4, 4], decoder_hidden_size=256, num_labels=150, **_SEG_DROP)
    return _segformer(cfg, train, dtype, seed, batch=8, size=512)


def dinov2_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """DINOv2-B/14 (768, 12 layers, 12 heads), 224 x 224 (256 patches), batch 64."""
    cfg = dict(image_size=224, patch_size=14, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
               mlp_ratio=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
               num_labels=1000)
    return _vision("Dinov2ForImageClassification" if train else "Dinov2Model", "Dinov2Config", cfg, train, dtype,
                   seed, size=224, batch=64)


def mobilenet_v2_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """MobileNetV2 1.0 at 224 x 224, batch 64."""
    cfg = dict(image_size=224, depth_multiplier=1.0, num_labels=1000, classifier_dropout_prob=0.0)
    return _vision("MobileNetV2ForImageClassification", "MobileNetV2Config", cfg, train, dtype, seed, attn=None,
                   size=224, batch=64)


def clip_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """CLIP ViT-B/32 (text 512 x 12 layers, 77 tokens; vision 768 x 12 layers at 224 x 224), batch 64."""
    return _contrastive("CLIPModel", "CLIPConfig", train, dtype, seed, realistic=True)


def falcon_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """Falcon-7B's width (4544, 71 heads of 64, one key/value head, parallel attention + MLP), 4 layers, 2 x 2048."""
    cfg = dict(vocab_size=65024, hidden_size=4544, num_hidden_layers=4, num_attention_heads=71, hidden_dropout=0.0,
               attention_dropout=0.0, bos_token_id=11, eos_token_id=11)
    return _causal("FalconForCausalLM", "FalconConfig", cfg, train, dtype, seed, batch=2, seq=2048)


def bloom_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """BLOOM-560M's width (1024, 16 heads, vocab 250880), 4 layers, ALiBi in eager attention, 4 x 1024."""
    cfg = dict(vocab_size=250880, hidden_size=1024, n_layer=4, n_head=16, hidden_dropout=0.0, attention_dropout=0.0,
               bos_token_id=1, eos_token_id=2, pad_token_id=3)
    return _causal("BloomForCausalLM", "BloomConfig", cfg, train, dtype, seed, attn="eager", batch=4, seq=1024)


class _LSTMLanguageModel(torch.nn.Module):
    """Embedding -> nn.LSTM (stacked, with its default biases) -> tied-size output projection; with `labels`, the
    next-token cross-entropy (the call returns the loss), else the logits."""

    def __init__(self, vocab: int, width: int, layers: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.rnn = torch.nn.LSTM(width, width, num_layers=layers, batch_first=True)
        self.out = torch.nn.Linear(width, vocab)

    def forward(self, input_ids, labels=None):
        h, _ = self.rnn(self.embed(input_ids))
        logits = self.out(h)
        if labels is None:
            return logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def _lstm_lm(vocab: int, width: int, layers: int, batch: int, seq: int, train: bool, dtype, seed: int) -> Example:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _finish(_LSTMLanguageModel(vocab, width, layers), train, dtype)

    def make_inputs(s: int):
        ids = torch.randint(0, vocab, (batch, seq), generator=_gen(s))
        return (), ({"input_ids": ids, "labels": ids.clone()} if train else {"input_ids": ids})

    args, kwargs = make_inputs(seed)
    return Example(model, args, kwargs, make_inputs)


def lstm_lm(train=False, dtype=torch.float32, seed=0):
    """A plain-torch LSTM language model: nn.LSTM with biases, two layers, unrolled over the sequence; training
    routes the LSTM through its per-op form (joint/rnn.py)."""
    return _lstm_lm(64, 16, 2, 2, 6, train, dtype, seed)


def lstm_lm_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """An LSTM language model of PTB/WikiText size: vocab 10000, width 1024, 2 layers, batch 32 x 64 tokens."""
    return _lstm_lm(10000, 1024, 2, 32, 64, train, dtype, seed)


def gemma3_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """Gemma-3-1B's text width (1152, 4 heads of 256, one key/value head, MLP 6912, vocab 262144), 6 layers (five
    sliding-window (512) and one full, the released pattern), batch 2 x 2048."""
    cfg = dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
               sliding_window=512, query_pre_attn_scalar=256, rope_theta=1000000.0, pad_token_id=0,
               bos_token_id=2, eos_token_id=1)
    return _causal("Gemma3ForCausalLM", "Gemma3TextConfig", cfg, train, dtype, seed, batch=2, seq=2048)


def opt_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """OPT-1.3B's width (2048, 32 heads, ReLU MLP 8192, vocab 50272), 4 layers, batch 2 x 2048."""
    cfg = dict(vocab_size=50272, hidden_size=2048, num_hidden_layers=4, ffn_dim=8192, num_attention_heads=32,
               max_position_embeddings=2048, word_embed_proj_dim=2048, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, layerdrop=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    return _causal("OPTForCausalLM", "OPTConfig", cfg, train, dtype, seed, batch=2, seq=2048)


def roberta_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """RoBERTa-base (768, 12 layers, 12 heads, vocab 50265), masked LM, batch 32 x 512 with padded rows."""
    cfg = dict(vocab_size=50265, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
               intermediate_size=3072, max_position_embeddings=514, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, pad_token_id=1)
    return _encoder("RobertaForMaskedLM", "RobertaConfig", cfg, train, dtype, seed, batch=32, seq=512)


def distilbert_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """DistilBERT-base (768, 6 layers, 12 heads, vocab 30522), sequence classification, batch 32 x 512."""
    cfg = dict(vocab_size=30522, dim=768, n_layers=6, n_heads=12, hidden_dim=3072, max_position_embeddings=512,
               dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=3)
    return _encoder("DistilBertForSequenceClassification", "DistilBertConfig", cfg, train, dtype, seed,
                    labels="cls", batch=32, seq=512)


def bart_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """BART-base (768, 6 + 6 layers, 12 heads, vocab 50265), batch 16, sources of 512, targets of 128."""
    return _bart(dict(vocab_size=50265, d_model=768, layers=6, heads=12, ffn=3072, positions=1024), train, dtype,
                 seed, batch=16, src=512, tgt=128)


def siglip_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """SigLIP-B/16's towers (text 512 x 12, vision 768 x 12 at 224 x 224, patch 16), batch 64."""
    return _contrastive("SiglipModel", "SiglipConfig", train, dtype, seed, realistic=True)


def efficientnet_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """EfficientNet-B0 (width and depth 1.0, head 1280) at 224 x 224, batch 64."""
    cfg = dict(image_size=224, width_coefficient=1.0, depth_coefficient=1.0, hidden_dim=1280, dropout_rate=0.0,
               drop_connect_rate=0.0, num_labels=1000)
    return _fan_out_init(_vision("EfficientNetForImageClassification", "EfficientNetConfig", cfg, train, dtype, seed,
                                 attn=None, size=224, batch=64), seed)


def qwen3_moe_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """Qwen3-30B-A3B's routing (top-8 of many small experts, normalized weights) at half its width: hidden 1024,
    64 experts of 384, 16/4 heads of 128, vocab 32000, 4 layers, batch 2 x 2048 (32768 routed rows a layer, about
    512 an expert)."""
    cfg = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
               num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096,
               num_experts=64, moe_intermediate_size=384, num_experts_per_tok=8, decoder_sparse_step=1,
               mlp_only_layers=[], norm_topk_prob=True, router_aux_loss_coef=0.0, rope_theta=1000000.0)
    return _causal("Qwen3MoeForCausalLM", "Qwen3MoeConfig", cfg, train, dtype, seed, batch=2, seq=2048)


def mixtral_realistic(train=False, dtype=torch.bfloat16, seed=0):
    """Mixtral-8x7B's routing (8 experts, top-2, SwiGLU experts, GQA 4:1, heads of 128) at a quarter of its width (1024,
    experts of 3584, vocab 32000), 4 layers, batch 2 x 2048, transformers' default grouped experts. (The batched_mm
    experts gather each routed token's expert weights: tokens x top-k x hidden x ffn elements, terabytes at this
    width: no realistic size.)"""
    cfg = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
               num_local_experts=8, num_experts_per_tok=2, sliding_window=None, rope_theta=1000000.0,
               router_aux_loss_coef=0.0, experts_implementation="grouped_mm")
    return _causal("MixtralForCausalLM", "MixtralConfig", cfg, train, dtype, seed, batch=2, seq=2048)


REALISTIC = {"phi3": phi3_realistic, "gemma2": gemma2_realistic, "gpt_neox": gpt_neox_realistic,
             "deberta_v2": deberta_v2_realistic, "swin": swin_realistic, "convnext": convnext_realistic,
             "segformer": segformer_realistic, "dinov2": dinov2_realistic, "mobilenet_v2": mobilenet_v2_realistic,
             "clip": clip_realistic, "falcon": falcon_realistic, "bloom": bloom_realistic,
             "lstm_lm": lstm_lm_realistic, "gemma3": gemma3_realistic, "opt": opt_realistic,
             "roberta": roberta_realistic, "distilbert": distilbert_realistic, "bart": bart_realistic,
             "siglip": siglip_realistic, "efficientnet": efficientnet_realistic, "mixtral": mixtral_realistic,
             "qwen3_moe": qwen3_moe_realistic}


# ---------------------------------------------------------------- the list

def _more(name: str, tiny, *classes: str, note: str = "") -> ZooEntry:
    return ZooEntry(name, tiny, REALISTIC.get(name), ("transformers",) + tuple(f"transformers.{c}" for c in classes),
                    note=note)


# What tests/test_zoo_more.py runs: every entry, inference and training.
MORE: tuple[ZooEntry, ...] = (
    _more("phi3", phi3, "Phi3Config", "Phi3ForCausalLM", note="empty rotary pass-through slice"),
    _more("falcon", falcon, "FalconConfig", "FalconForCausalLM", note="one key/value head broadcast in sdpa"),
    _more("gemma2", gemma2, "Gemma2Config", "Gemma2ForCausalLM", note="eager attention, logit soft-capping"),
    _more("gemma3", gemma3, "Gemma3TextConfig", "Gemma3ForCausalLM", note="sliding-window layers, dead full mask"),
    _more("deberta_v2", deberta_v2, "DebertaV2Config", "DebertaV2ForMaskedLM", note="relative position attention"),
    _more("gpt_neox", gpt_neox, "GPTNeoXConfig", "GPTNeoXForCausalLM", note="partial rotary"),
    _more("bloom", bloom, "BloomConfig", "BloomForCausalLM", note="ALiBi"),
    _more("roberta", roberta, "RobertaConfig", "RobertaForMaskedLM", note="positions from the ids' padding"),
    _more("clip", clip, "CLIPConfig", "CLIPModel", note="contrastive loss, return_loss=True"),
    _more("swin", swin, "SwinConfig", "SwinForImageClassification", note="shifted window attention"),
    _more("convnext", convnext, "ConvNextConfig", "ConvNextForImageClassification",
          note="depthwise conv, layer scale"),
    _more("segformer", segformer, "SegformerConfig", "SegformerForSemanticSegmentation",
          note="upsampling decode head"),
    _more("dinov2", dinov2, "Dinov2Config", "Dinov2Model", "Dinov2ForImageClassification",
          note="classification head for training"),
    _more("mobilenet_v2", mobilenet_v2, "MobileNetV2Config", "MobileNetV2ForImageClassification",
          note="depthwise, ReLU6, train-mode BatchNorm"),
    _more("siglip", siglip, "SiglipConfig", "SiglipModel", note='padding="valid" conv'),
    _more("mixtral", mixtral, "MixtralConfig", "MixtralForCausalLM",
          note="MoE top-k routing, grouped experts (histc, grouped matmuls)"),
    _more("efficientnet", efficientnet, "EfficientNetConfig", "EfficientNetForImageClassification",
          note="squeeze-excitation, a pooling kernel wider than its map"),
    ZooEntry("lstm_lm", lstm_lm, lstm_lm_realistic, note="nn.LSTM with biases, stacked, unrolled"),
)

# Built and matching eager too (2026-11-27), but left out of the test tier to keep it near 6 minutes on 2
# cores: what they cover is closest to the main zoo (bert, gpt2, t5/whisper). `zoo_probe.py --more` runs them.
SPARE: tuple[ZooEntry, ...] = (
    _more("opt", opt, "OPTConfig", "OPTForCausalLM", note="positions from the mask's cumsum"),
    _more("distilbert", distilbert, "DistilBertConfig", "DistilBertForSequenceClassification",
          note="sequence classification loss"),
    _more("bart", bart, "BartConfig", "BartForConditionalGeneration", note="seq2seq, learned positions"),
    _more("mixtral_batched", mixtral_batched, "MixtralConfig", "MixtralForCausalLM",
          note="MoE experts as batched matmuls on gathered weights"),
    _more("qwen3_moe", qwen3_moe, "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
          note="many small experts, top-8 (grouped), query/key norms"),
    _more("llama4_text", llama4_text, "Llama4TextConfig", "Llama4ForCausalLM",
          note="complex rotary embedding (real pairs), a routed and a shared expert"),
)


def entry(name: str) -> ZooEntry:
    for e in MORE + SPARE:
        if e.name == name:
            return e
    raise KeyError(f"no zoo_more entry {name!r}; entries: {', '.join(e.name for e in MORE + SPARE)}")
