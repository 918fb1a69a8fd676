"""Hugging Face ``transformers`` models built from small configs (no download), as users
bring them: GPT-2 (tied head, Conv1D layers) and Llama (grouped-query attention, RMSNorm,
rotary embeddings)."""

import torch

import fsg

KINDS = ("gpt2", "llama")
VOCAB, SEQ = 256, 32


def make(kind: str) -> torch.nn.Module:
    """A two-layer ``kind`` model, seeded, dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(
            n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    config = LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=128,
        vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def loss_fn(model: torch.nn.Module):
    """The model's own causal-LM loss, as users call it."""

    def loss(params, batch):
        return fsg.apply(model, params, input_ids=batch["ids"], labels=batch["ids"]).loss

    return loss


def batches(n: int, rows: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"ids": torch.randint(0, VOCAB, (rows, SEQ), generator=g)} for _ in range(n)]
