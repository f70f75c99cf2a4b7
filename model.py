"""The GPT model: a decoder-only transformer in the minGPT / nanoGPT lineage.

This module owns the network and nothing else: no process groups, no DDP/FSDP
wrapping, no data loading. A model built here runs the same in one process, under
DDP, FSDP or cut into pipeline stages, because all distributed wrapping happens in the
strategies of mingpt_ddp/parallel/ (a stage is a copy with some parts set to None: see run()).

Shape notes use B = batch, T = time (sequence length), C = channels (n_embd),
nh = number of heads, hs = head size (C // nh), V = vocabulary size.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.nn import functional as F

from mingpt_ddp.config.model import MODEL_SIZES, GPTConfig  # noqa: F401 - the model's config, for learners
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.moe import MoE

# Named sizes (layers, heads, width): the options of the `model` config group
# (mingpt_ddp/config/schema.py), e.g. python main.py model=gpt-mini. Most are minGPT's; gpt-micro is
# the default (nanoGPT's CPU recipe), baby-gpt nanoGPT's shakespeare_char GPU model, gpt2 the 124M
# GPT-2 small.
ACTIVATIONS = {
    "gelu": F.gelu,  # exact: x * Phi(x)
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's (transformers' gelu_new)
    "relu2": lambda x: F.relu(x).square(),
}


class Rotary:
    """Rotary position embedding (RoPE, Su et al. 2021): each pair of channels of a query or key is
    rotated by an angle proportional to its position, so q.k depends on the distance between two
    positions, not on where they are. No parameters; the rotations are computed once per device."""

    def __init__(self, head_size: int, block_size: int, base: float = 10000.0):
        self.freqs = base ** (
            -torch.arange(0, head_size, 2, dtype=torch.float32) / head_size
        )  # (hs/2,)
        self.block_size = block_size
        self.tables: dict[torch.device, torch.Tensor] = {}

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """e^(i * position * frequency) for each of the positions (T,) and each channel pair:
        (T, 1, 1, hs/2) complex."""
        device = positions.device
        if device not in self.tables:
            angles = torch.outer(
                torch.arange(self.block_size, dtype=torch.float32), self.freqs
            )  # (block, hs/2)
            self.tables[device] = torch.polar(torch.ones_like(angles), angles)[:, None, None].to(
                device
            )
        return self.tables[device][positions]


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate fp32 (B, T, 2, nh, hs) queries and keys: channels (2i, 2i+1) are one complex number,
    multiplied by e^(i * position * frequency_i). One complex multiply instead of the six real ops
    of the split-halves form: on a CPU that is 2.4x faster, forward + backward. (Under torch.compile
    inductor leaves it to eager mode, with a warning: it generates no code for complex numbers.)"""
    pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))  # (B, T, 2, nh, hs/2) complex
    return torch.view_as_real(pairs * rope).flatten(-2)  # (B, T, 2, nh, hs)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float):
    """Each position attends to itself and the positions before it: (B, nh, T, hs) -> same."""
    # is_causal=True masks future positions inside the fused kernel. (A float 0/1 tril matrix
    # passed as attn_mask would be *added* to the scores and mask nothing; a boolean mask or
    # is_causal is what hides the future.)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.attn_dropout = cfg.attn_dropout
        self.qk_norm = cfg.qk_norm
        # Under autocast, run attention itself in fp32: on some CPUs the bf16 attention kernels are
        # slower than fp32 ones. mingpt_ddp/parallel/plan.py decides, by timing both at start
        # (autocast_attention_fp32).
        self.fp32_under_autocast = False
        # One matmul produces queries, keys and values for all heads at once.
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        # The attention kernel, (q, k, v, dropout_p) -> y. Context parallelism swaps in ring
        # attention over sequence shards (mingpt_ddp/parallel/ring.py); the model stays the same.
        self.attend = causal_attention

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        # One matmul gives queries, keys and values, split into heads: (B, T, 3C) -> (B, T, 3, nh,
        # hs).
        # -1 heads: all n_head here, or a tensor-parallel rank's share of them (its rows of qkv).
        qkv = self.qkv(x).view(B, T, 3, -1, C // self.n_head)
        qk, v = qkv[:, :, :2], qkv[:, :, 2]  # (B, T, 2, nh, hs): queries and keys, treated alike
        if self.qk_norm or rope is not None:
            qk = (
                qk.float()
            )  # in fp32: the complex rotation needs it, and CPUs' bf16 elementwise ops are slow
            if (
                self.qk_norm
            ):  # unit RMS per head: a logit q.k/sqrt(hs) can then not grow without bound
                qk = F.rms_norm(qk, (qk.size(-1),))
            if rope is not None:
                qk = rotate(qk, rope)
        # Attention in fp32 inside autocast where that times faster
        # (parallel.autocast_attention_fp32), else in v's precision (bf16 under autocast or FSDP's
        # bf16 parameters, fp32 otherwise).
        fp32 = self.fp32_under_autocast and torch.is_autocast_enabled(x.device.type)
        dtype = torch.float32 if fp32 else v.dtype
        q, k = qk.unbind(2)
        q, k, v = (t.to(dtype).transpose(1, 2) for t in (q, k, v))  # 3 x (B, nh, T, hs)
        dropout_p = self.attn_dropout if self.training else 0.0
        with (
            torch.autocast(x.device.type, enabled=False) if fp32 else nullcontext()
        ):  # the matmuls stay in autocast
            y = self.attend(q, k, v, dropout_p)  # (B, nh, T, hs)
        y = y.transpose(1, 2).flatten(2)  # re-assemble heads: (B, T, C) (this rank's, under TP)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.activation = ACTIVATIONS[cfg.activation]
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(
            self.proj(self.activation(self.fc(x)))
        )  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        # A mixture of experts in place of the MLP where gpt_config.n_experts > 0 (moe.py).
        self.mlp = MoE(cfg, ACTIVATIONS[cfg.activation]) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.vocab_size <= 0 or cfg.block_size <= 0:
            raise ConfigError(
                "GPTConfig.vocab_size and block_size must be set (from the dataset) "
                "before building GPT"
            )
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)  # token embedding
        # Where a token is: a learned vector per position added to the input, or (rotary) a rotation
        # of the queries and keys inside attention.
        self.wpe = None if cfg.rotary else nn.Embedding(cfg.block_size, cfg.n_embd)
        self.rotary = Rotary(cfg.n_embd // cfg.n_head, cfg.block_size) if cfg.rotary else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Weight tying (GPT-2, nanoGPT): the output projection reuses the token
        # embedding matrix, saving V*C parameters and helping small-data training.
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

        # GPT-2 initialisation: N(0, 0.02) everywhere, and the projections that
        # write into the residual stream scaled by 1/sqrt(2 * n_layer), so the
        # stream's variance does not grow with depth (two residual adds per block).
        self.apply(self._init_weights)
        # zero_init_proj (modded-nanogpt): those projections, and an untied head, start at zero
        # instead: every block starts as the identity and the first prediction is uniform.
        for name, p in self.named_parameters():
            if cfg.zero_init_proj and (name.endswith("proj.weight") or name == "lm_head.weight"):
                nn.init.zeros_(
                    p
                )  # a tied head is wte, which named_parameters() lists only under that name
            elif name.endswith("proj.weight"):
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
        return n - self.wpe.weight.numel() if non_embedding and self.wpe is not None else n

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward): 6N for the matmuls plus attention (PaLM
        appendix B)."""
        cfg = self.config
        return 6 * self.active_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size

    def active_params(self) -> int:
        """num_params() less the experts a token skips: it goes through top_k of n_experts."""
        cfg = self.config
        idle = (cfg.n_experts - cfg.top_k) * 2 * cfg.n_embd * cfg.hidden if cfg.n_experts else 0
        return self.num_params() - cfg.n_layer * idle

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(
                f"sequence of length {T} is longer than block_size {self.config.block_size}"
            )
        logits = self.run(idx, positions)  # (B, T, V)
        return logits, None if targets is None else self.loss(logits, targets)

    def run(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The parts of the network this module holds, in order: token ids (B, T) -> logits
        (B, T, V). A model cut into pipeline stages (mingpt_ddp/parallel/stages.py) holds some of
        them: without the token embedding x is the (B, T, C) output of the blocks before, and
        without the head the result is its own blocks' (B, T, C) output. positions (T,): where
        each of the T tokens sits in its window (default 0..T-1; context parallelism hands a rank
        chunks from the middle and the end)."""
        T = x.size(1)
        if positions is None:
            positions = torch.arange(T, device=x.device)
        if self.wte is not None:
            x = self.wte(x)  # (B, T, C)
            if self.wpe is not None:  # (B, T, C) + (T, C) broadcast
                x = x + self.wpe(positions)
            x = self.drop(x)
        rope = self.rotary(positions) if self.rotary is not None else None  # (T, 1, 1, hs/2)
        for block in self.blocks.children():  # children(): a stage's blocks are a ModuleDict
            x = block(x, rope)  # (B, T, C)
        if self.lm_head is None:
            return x
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if self.config.logit_softcap:  # in fp32: tanh of bf16 logits would round them coarsely
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits.float() / cap)
        return logits

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-character cross-entropy of logits (B, T, V) against targets (B, T)."""
        # Flatten batch and time: every position is one next-character prediction. The loss in
        # fp32 whatever the logits' dtype: under FSDP's bf16 parameters (no autocast) a bf16 loss
        # near 1.5 could only move in steps of 2^-7 = 0.008.
        B, T, V = logits.shape
        return F.cross_entropy(logits.view(B * T, V).float(), targets.reshape(B * T).long())

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
            context = idx[
                :, -self.config.block_size :
            ]  # (B, <=block_size): the model sees at most block_size tokens
            logits, _ = self(context)
            logits = (
                logits[:, -1, :].float() / temperature
            )  # (B, V): only the last position predicts the next token
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            next_token = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, next_token), dim=1)
        self.train(was_training)
        return idx
