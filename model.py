"""The GPT model: a decoder-only transformer in the minGPT / nanoGPT lineage.

This module owns the network and nothing else: no process groups, no DDP/FSDP
wrapping, no data loading. A model built here runs the same in one process, under
DDP or under FSDP, because all distributed wrapping happens in parallel.py.

Shape notes use B = batch, T = time (sequence length), C = channels (n_embd),
nh = number of heads, hs = head size (C // nh), V = vocabulary size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
from torch.nn import functional as F

from config import ConfigError

# Named sizes (layers, heads, width): the options of the `model` config group (config.py),
# e.g. python main.py model=gpt-mini. Most are minGPT's; gpt-micro is the default (nanoGPT's
# CPU recipe), baby-gpt nanoGPT's shakespeare_char GPU model, gpt2 the 124M GPT-2 small.
MODEL_SIZES: dict[str, tuple[int, int, int]] = {
    "gpt-micro": (4, 4, 128),
    "tiny": (2, 2, 32),
    "gpt-nano": (3, 3, 48),
    "gpt-mini": (6, 6, 192),
    "baby-gpt": (6, 6, 384),
    "gopher-44m": (8, 16, 512),
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}


@dataclass
class GPTConfig:
    """Shape and regularisation of the network (config section `gpt_config`; sizes: model=...)."""

    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream (C)."""
    dropout: float = 0.0
    """Dropout on embeddings and on each residual branch (0 for small data and short runs)."""
    attn_dropout: float = 0.0
    """Dropout on the attention probabilities inside scaled_dot_product_attention."""
    bias: bool = True
    """Bias terms in Linear and LayerNorm layers."""
    vocab_size: int = 0
    """Set from the dataset's vocabulary at run time (a value given here is replaced)."""
    block_size: int = 0
    """Context length; set from data_config.block_size at run time (a value given here is replaced)."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"gpt_config.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"gpt_config.n_embd ({self.n_embd}) must be divisible by gpt_config.n_head ({self.n_head})"
            )
        for name in ("dropout", "attn_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"gpt_config.{name} must be in [0, 1), got {getattr(self, name)}")

    # The fields a snapshot must agree on to be loadable into this model.
    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "bias")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.attn_dropout = cfg.attn_dropout
        # Under autocast, run attention itself in fp32: on some CPUs the bf16 attention kernels are
        # slower than fp32 ones. parallel.py decides, by timing both at start (autocast_attention_fp32).
        self.fp32_under_autocast = False
        # One matmul produces queries, keys and values for all heads at once.
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        # Split channels into heads: (B, T, C) -> (B, nh, T, hs).
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        # is_causal=True masks future positions inside the fused kernel. (A float
        # 0/1 tril matrix passed as attn_mask would be *added* to the scores and
        # mask nothing; a boolean mask or is_causal is what hides the future.)
        dropout_p = self.attn_dropout if self.training else 0.0
        if self.fp32_under_autocast and torch.is_autocast_enabled(q.device.type):
            with torch.autocast(q.device.type, enabled=False):  # the matmuls around it stay in autocast
                y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), dropout_p=dropout_p,
                                                   is_causal=True)  # (B, nh, T, hs) fp32
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads: (B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.vocab_size <= 0 or cfg.block_size <= 0:
            raise ConfigError("GPTConfig.vocab_size and block_size must be set (from the dataset) before building GPT")
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)  # token embedding
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)  # learned position embedding
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Weight tying (GPT-2, nanoGPT): the output projection reuses the token
        # embedding matrix, saving V*C parameters and helping small-data training.
        self.lm_head.weight = self.wte.weight

        # GPT-2 initialisation: N(0, 0.02) everywhere, and the projections that
        # write into the residual stream scaled by 1/sqrt(2 * n_layer), so the
        # stream's variance does not grow with depth (two residual adds per block).
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; position embeddings excluded by default, as in GPT-2's paper."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward): 6N for the matmuls plus attention (PaLM appendix B)."""
        cfg = self.config
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C) + (T, C) broadcast -> (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            # Flatten batch and time: every position is one next-character prediction. The loss
            # in fp32 whatever the logits' dtype: under FSDP's bf16 parameters (no autocast) a
            # bf16 loss near 1.5 could only move in steps of 2^-7 = 0.008.
            loss = F.cross_entropy(logits.view(B * T, -1).float(), targets.reshape(B * T).long())
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend idx (B, T) by max_new_tokens sampled tokens; returns (B, T + max_new_tokens).

        Runs in eval mode (no dropout) and restores the previous mode. Pass a seeded
        torch.Generator to make sampling reproducible without touching the global RNG.
        """
        if temperature <= 0:
            raise ValueError("temperature must be > 0")
        was_training = self.training
        self.eval()
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]  # (B, <=block_size): the model sees at most block_size tokens
            logits, _ = self(context)
            logits = logits[:, -1, :].float() / temperature  # (B, V): only the last position predicts the next token
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            next_token = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, next_token), dim=1)
        self.train(was_training)
        return idx

    def configure_optimizer(
        self, learning_rate: float, weight_decay: float, betas: tuple[float, float], device_type: str
    ) -> torch.optim.AdamW:
        """AdamW with weight decay on matrices only (2-D weights and embeddings).

        Biases and LayerNorm gains are 1-D: decaying them towards zero only hurts,
        so they go in a group with weight_decay=0.
        """
        params = [p for p in self.parameters() if p.requires_grad]  # tied weights appear once
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # The fused kernel updates all parameters in one pass instead of a loop of small ops;
        # torch has it for CUDA and CPU tensors.
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type in ("cuda", "cpu"))
