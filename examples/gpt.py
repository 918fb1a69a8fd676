"""A small GPT (nanoGPT-shaped) used by the examples and benchmarks.

Shape legend: B batch, T time (sequence), D model width, H heads, K head dim, V vocabulary.
The model is a plain ``nn.Module``; fsg uses it as a template through ``fsg.apply``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import fsg


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 64
    n_layer: int = 3
    n_head: int = 4
    n_embd: int = 128
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q_BTD, k_BTD, v_BTD = self.qkv(x_BTD).split(D, dim=-1)
        q_BHTK, k_BHTK, v_BHTK = (
            t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q_BTD, k_BTD, v_BTD)
        )
        y_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, is_causal=True)
        return self.proj(y_BHTK.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.fc_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.ln_1(x_BTD))
        return x_BTD + self.fc_proj(F.gelu(self.fc(self.ln_2(x_BTD)), approximate="tanh"))


class GPT(nn.Module):
    """Decoder-only transformer; the output head is tied to the token embedding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * cfg.n_layer) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None) -> torch.Tensor:
        """The logits ``[B, T, V]``; with ``targets`` the mean cross-entropy instead, through
        ``fsg.nn.linear_cross_entropy`` (the head fused with the loss: no ``[B, T, V]``
        logits are ever held)."""
        T = idx_BT.shape[1]
        pos_T = torch.arange(T, device=idx_BT.device)
        x_BTD = self.wte(idx_BT) + self.wpe(pos_T)
        for block in self.blocks:
            x_BTD = block(x_BTD)
        h_BTD = self.ln_f(x_BTD)
        if targets_BT is not None:
            return fsg.nn.linear_cross_entropy(h_BTD, self.lm_head.weight, targets_BT)
        return self.lm_head(h_BTD)  # logits_BTV
