"""Hugging Face ``transformers`` models built from small configs (no download), as users
bring them: a corpus of families, each two layers (one per stack for encoder-decoders), dropout
off, trained on its own loss (``model(**batch).loss``).

The families cover what the library's tracer and sharding rules meet in the wild: tied heads
and Conv1D layers (GPT-2), grouped-query attention, RMSNorm and rotary embeddings (Llama,
Mistral, Qwen2/3, Gemma/2, Phi-3), partial rotary and parallel blocks (Phi, GPT-NeoX, GPT-J,
Falcon), ALiBi (Bloom), learned positions (OPT), encoders with masked-LM heads (BERT, RoBERTa,
DistilBERT), encoder-decoders with relative position buckets (T5) or learned positions (BART),
a vision transformer on images (ViT), and frozen parameters (``requires_grad=False``): the
sinusoidal position tables of Pegasus and of Whisper's audio encoder.
"""

from typing import Callable

import torch

import fsg

VOCAB, SEQ = 256, 32
_D, _FF, _HEADS, _POS = 64, 128, 4, 64


def _families() -> dict[str, tuple[Callable[[], torch.nn.Module], str]]:
    """name -> (a builder, the batch it takes: ``"lm"`` token ids as inputs and labels,
    ``"seq2seq"`` inputs and other labels, ``"image"`` pixels and class labels)."""
    import transformers as T

    decoder = dict(vocab_size=VOCAB, hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS,
                   intermediate_size=_FF, max_position_embeddings=_POS, bos_token_id=0, eos_token_id=0)  # fmt: skip
    gqa = dict(decoder, num_key_value_heads=2)
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return {
        "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(
            n_layer=2, n_head=_HEADS, n_embd=_D, vocab_size=VOCAB, n_positions=_POS, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), "lm"),  # fmt: skip
        "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**gqa)), "lm"),
        "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(**gqa, sliding_window=None)), "lm"),
        "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**gqa)), "lm"),
        "qwen3": (lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**gqa, head_dim=16)), "lm"),
        "gemma": (lambda: T.GemmaForCausalLM(T.GemmaConfig(**gqa, head_dim=16)), "lm"),
        "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**gqa, head_dim=16)), "lm"),
        "phi": (lambda: T.PhiForCausalLM(T.PhiConfig(**decoder, resid_pdrop=0.0, embd_pdrop=0.0)), "lm"),
        "phi3": (lambda: T.Phi3ForCausalLM(T.Phi3Config(**decoder, pad_token_id=0)), "lm"),
        "gpt_neox": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**decoder)), "lm"),
        "gptj": (lambda: T.GPTJForCausalLM(T.GPTJConfig(
            vocab_size=VOCAB, n_embd=_D, n_layer=2, n_head=_HEADS, rotary_dim=8, n_positions=_POS, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), "lm"),  # fmt: skip
        "falcon": (lambda: T.FalconForCausalLM(T.FalconConfig(
            vocab_size=VOCAB, hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, bos_token_id=0,
            eos_token_id=0)), "lm"),  # fmt: skip
        "bloom": (lambda: T.BloomForCausalLM(T.BloomConfig(
            vocab_size=VOCAB, hidden_size=_D, n_layer=2, n_head=_HEADS, bos_token_id=0, eos_token_id=0)), "lm"),  # fmt: skip
        "opt": (lambda: T.OPTForCausalLM(T.OPTConfig(
            vocab_size=VOCAB, hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, ffn_dim=_FF,
            max_position_embeddings=_POS, word_embed_proj_dim=_D, dropout=0.0, bos_token_id=0, eos_token_id=0,
            pad_token_id=1)), "lm"),  # fmt: skip
        "bert": (lambda: T.BertForMaskedLM(T.BertConfig(**decoder, **no_dropout)), "lm"),
        "roberta": (lambda: T.RobertaForMaskedLM(T.RobertaConfig(**decoder, **no_dropout, pad_token_id=1)), "lm"),
        "distilbert": (lambda: T.DistilBertForMaskedLM(T.DistilBertConfig(
            vocab_size=VOCAB, dim=_D, n_layers=2, n_heads=_HEADS, hidden_dim=_FF, max_position_embeddings=_POS,
            dropout=0.0, attention_dropout=0.0)), "lm"),  # fmt: skip
        "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=VOCAB, d_model=_D, d_kv=16, d_ff=_FF, num_layers=2, num_heads=_HEADS, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)), "seq2seq"),  # fmt: skip
        "bart": (lambda: T.BartForConditionalGeneration(T.BartConfig(
            vocab_size=VOCAB, d_model=_D, encoder_layers=1, decoder_layers=1, encoder_attention_heads=_HEADS,
            decoder_attention_heads=_HEADS, encoder_ffn_dim=_FF, decoder_ffn_dim=_FF, max_position_embeddings=_POS,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=2)), "seq2seq"),  # fmt: skip
        "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(
            hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, intermediate_size=_FF, image_size=32,
            patch_size=8, num_labels=10, **no_dropout)), "image"),  # fmt: skip
        # vision transformers and convolution-free hierarchies: relative position biases (BEiT's index is
        # cached by transformers: a trace must leave no fake tensor there), shifted windows, focal modulation
        "beit": (lambda: T.BeitForImageClassification(T.BeitConfig(
            hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, intermediate_size=_FF, image_size=32,
            patch_size=8, num_labels=10, use_relative_position_bias=True, drop_path_rate=0.0, **no_dropout)), "image"),  # fmt: skip
        "deit": (lambda: T.DeiTForImageClassification(T.DeiTConfig(
            hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, intermediate_size=_FF, image_size=32,
            patch_size=8, num_labels=10, **no_dropout)), "image"),  # fmt: skip
        "dinov2": (lambda: T.Dinov2ForImageClassification(T.Dinov2Config(
            hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, mlp_ratio=2, image_size=32, patch_size=8,
            num_labels=10, drop_path_rate=0.0, **no_dropout)), "image"),  # fmt: skip
        "swin": (lambda: T.SwinForImageClassification(T.SwinConfig(
            image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=10,
            drop_path_rate=0.0, **no_dropout)), "image"),  # fmt: skip
        "segformer": (lambda: T.SegformerForImageClassification(T.SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
            num_labels=10, drop_path_rate=0.0, classifier_dropout_prob=0.0, patch_sizes=[3, 3], strides=[2, 2],
            mlp_ratios=[2, 2], **no_dropout)), "image"),  # fmt: skip
        "focalnet": (lambda: T.FocalNetForImageClassification(T.FocalNetConfig(
            image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], focal_levels=[2, 2], num_labels=10,
            drop_path_rate=0.0)), "image"),  # fmt: skip
        "poolformer": (lambda: T.PoolFormerForImageClassification(T.PoolFormerConfig(
            hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_labels=10, drop_path_rate=0.0)), "image"),  # fmt: skip
        # frozen parameters (requires_grad=False): the sinusoidal position tables
        "pegasus": (lambda: T.PegasusForConditionalGeneration(T.PegasusConfig(
            vocab_size=VOCAB, d_model=_D, encoder_layers=1, decoder_layers=1, encoder_attention_heads=_HEADS,
            decoder_attention_heads=_HEADS, encoder_ffn_dim=_FF, decoder_ffn_dim=_FF, max_position_embeddings=_POS,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, eos_token_id=1,
            decoder_start_token_id=0)), "seq2seq"),  # fmt: skip
        # MORE_KINDS: multi-query attention (GPT-BigCode), QK norms (OLMo 2), parallel blocks with a logit
        # scale (Cohere), muP-style multipliers (Granite), a factorized embedding (ELECTRA), disentangled
        # relative attention (DeBERTa-v2), a selective state-space scan instead of attention (Mamba)
        "gpt_bigcode": (lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(
            vocab_size=VOCAB, n_embd=_D, n_layer=2, n_head=_HEADS, n_positions=_POS, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, multi_query=True)), "lm"),  # fmt: skip
        "stablelm": (lambda: T.StableLmForCausalLM(T.StableLmConfig(**gqa)), "lm"),
        "olmo2": (lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**decoder, pad_token_id=1)), "lm"),
        "cohere": (lambda: T.CohereForCausalLM(T.CohereConfig(**decoder, pad_token_id=1)), "lm"),
        "starcoder2": (lambda: T.Starcoder2ForCausalLM(T.Starcoder2Config(
            **gqa, residual_dropout=0.0, embedding_dropout=0.0)), "lm"),  # fmt: skip
        "granite": (lambda: T.GraniteForCausalLM(T.GraniteConfig(**decoder)), "lm"),
        "codegen": (lambda: T.CodeGenForCausalLM(T.CodeGenConfig(
            vocab_size=VOCAB, n_embd=_D, n_layer=2, n_head=_HEADS, n_positions=_POS, rotary_dim=8, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0)), "lm"),  # fmt: skip
        "electra": (lambda: T.ElectraForMaskedLM(T.ElectraConfig(
            vocab_size=VOCAB, embedding_size=32, hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS,
            intermediate_size=_FF, max_position_embeddings=_POS, **no_dropout)), "lm"),  # fmt: skip
        "deberta_v2": (lambda: T.DebertaV2ForMaskedLM(T.DebertaV2Config(
            vocab_size=VOCAB, hidden_size=_D, num_hidden_layers=2, num_attention_heads=_HEADS, intermediate_size=_FF,
            max_position_embeddings=_POS, relative_attention=True, pos_att_type=["p2c", "c2p"], **no_dropout)), "lm"),  # fmt: skip
        "mamba": (lambda: T.MambaForCausalLM(T.MambaConfig(
            vocab_size=VOCAB, hidden_size=_D, num_hidden_layers=2, state_size=8, expand=2)), "lm"),  # fmt: skip
        "whisper": (lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=16, d_model=_D, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=_HEADS, decoder_attention_heads=_HEADS, encoder_ffn_dim=_FF, decoder_ffn_dim=_FF,
            max_source_positions=16, max_target_positions=_POS, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)),
            "audio"),  # fmt: skip
    }


KINDS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi", "phi3", "gpt_neox", "gptj",
         "falcon", "bloom", "opt", "bert", "roberta", "distilbert", "t5", "bart", "vit", "pegasus", "whisper",
         "beit", "deit", "dinov2", "swin", "segformer", "focalnet", "poolformer")  # fmt: skip
# more families, checked against eager PyTorch (tests/models/test_hf.py's five AdamW steps) but
# not through every other corpus test (accumulation, FP8, batched casts, the fused loss, meshes)
MORE_KINDS = ("gpt_bigcode", "stablelm", "olmo2", "cohere", "starcoder2", "granite", "codegen", "electra",
              "deberta_v2", "mamba")  # fmt: skip


def make(kind: str) -> torch.nn.Module:
    """A small ``kind`` model, seeded, dropout off."""
    torch.manual_seed(0)
    return _families()[kind][0]()


def loss_fn(model: torch.nn.Module):
    """The model's own loss, as users call it: ``model(**batch).loss``."""

    def loss(params, batch):
        return fsg.apply(model, params, **batch).loss

    return loss


def batches(n: int, rows: int = 4, kind: str = "gpt2") -> list[dict]:
    """``n`` batches of ``rows`` examples in the form ``kind``'s model takes."""
    form = _families()[kind][1]
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        if form == "audio":  # log-mel frames (16 bins x 32 frames: the encoder's 16 positions after its stride-2 conv)
            out.append({"input_features": torch.randn(rows, 16, 32, generator=g),
                        "labels": torch.randint(3, VOCAB, (rows, 8), generator=g)})  # fmt: skip
            continue
        if form == "image":
            out.append({"pixel_values": torch.randn(rows, 3, 32, 32, generator=g),
                        "labels": torch.randint(0, 10, (rows,), generator=g)})  # fmt: skip
            continue
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (rows, SEQ), generator=g) if form == "seq2seq" else ids
        out.append({"input_ids": ids, "labels": labels})
    return out
