"""A mixture-of-experts MLP (gpt_config.n_experts > 0): the model's side, no distribution.

The dense block sends every token through one MLP of hidden width 4C. Here a router scores each
token against E experts (small MLPs of hidden width H), and the token goes through its top_k
best; their outputs, weighted by the scores, are summed. With H = 4C / top_k a token meets as
many weights as in the dense block (the same FLOPs), while the block holds E / top_k times more.

    scores  (N, E)   router(x): softmax (Switch, Mixtral) or sigmoid (DeepSeek-V3), in fp32
    chosen  (N, k)   the top_k experts of each token (ties: the lower index, so every layout
                     that computes the same scores chooses alike)
    rows    (M, C)   the token rows, grouped by expert (M = N x k, fewer under a capacity)
    out     (M, C)   each group through its expert; then weighted and summed back per token

Who holds which expert is not this module's business: `exchange` takes the grouped rows and the
count per expert and returns their outputs. In one process it computes them here; expert
parallelism (mingpt_ddp/parallel/expert.py) swaps in an all-to-all that sends each group to the
rank holding its expert and brings the outputs back.

Balance: a router left alone sends most tokens to a few experts. Two remedies, both here:
- aux_loss_coef: Switch's loss E x sum_e f_e P_e (f_e the share of the sequence's choices that
  went to expert e, P_e its mean score), per sequence as DeepSeek-V3's, so that every layout
  computes it from tokens it holds. It reaches the router through backward only (aux_gradient):
  the printed loss stays the language model's, and a pipeline stage without the loss still
  trains its routers (Megatron's MoEAuxLossAutoScaler).
- bias_update_rate: DeepSeek-V3's loss-free balance. A bias per expert, added to the scores only
  to choose, moves after each step towards balance; it costs no gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.nn import functional as F

PAD_ROWS = 32  # each expert's rows padded to a multiple of this (MoE.compute)


class AuxGradient(torch.autograd.Function):
    """Returns x; in backward, also sends a gradient of `scale` into aux (a loss computed beside
    the model's), as if aux had been added to the loss. scale: what the step's loss is multiplied
    by before backward (1 / micro-batches)."""

    @staticmethod
    def forward(ctx, x, aux, scale: float):
        ctx.scale, ctx.dtype = scale, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.tensor(ctx.scale, dtype=ctx.dtype, device=grad.device), None


def recomputing() -> bool:
    """Whether this forward runs inside backward: activation checkpointing recomputing a block,
    whose tokens were counted the first time (torch's graph-task id is -1 outside backward; a
    private call: no public one says so)."""
    return torch._C._current_graph_task_id() != -1


def local_exchange(rows: torch.Tensor, counts: torch.Tensor, compute) -> torch.Tensor:
    """One process holds every expert: the grouped rows go straight through them."""
    return compute(rows, counts)


def local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight (expert parallelism makes it a DTensor cut by expert)."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class MoE(nn.Module):
    def __init__(self, cfg, activation):
        super().__init__()
        E, C, H = cfg.n_experts, cfg.n_embd, cfg.hidden
        self.top_k, self.sigmoid, self.activation = cfg.top_k, cfg.router == "sigmoid", activation
        self.aux_loss_coef, self.capacity_factor = cfg.aux_loss_coef, cfg.capacity_factor
        self.bias_update_rate = cfg.bias_update_rate
        self.router = nn.Linear(C, E, bias=False)
        # All experts' weights in two tensors, expert first: (E, C, H) and (E, H, C). Expert
        # parallelism cuts them along that first dimension.
        self.w1 = nn.Parameter(torch.randn(E, C, H) * 0.02)
        self.w2 = nn.Parameter(torch.randn(E, H, C) * 0.02 / math.sqrt(2 * cfg.n_layer))
        self.shared = None
        if cfg.shared_expert:
            self.shared = nn.Sequential(nn.Linear(C, H, bias=False), nn.Linear(H, C, bias=False))
        self.dropout = nn.Dropout(cfg.dropout)
        self.register_buffer("expert_bias", torch.zeros(E))  # loss-free balance; in snapshots
        # Tokens routed to each expert since the last optimizer step: (E,), or None. Not a buffer:
        # DDP would overwrite every rank's with rank 0's at each forward (broadcast_buffers).
        self.routed: torch.Tensor | None = None
        self.exchange = local_exchange
        self.aux_scale = 1.0  # the strategy sets 1 / micro-batches (AuxGradient)
        self.routing = True  # False: every token skips the experts (stages.Stage's inference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)  # (N, C): every token alike
        scores = F.linear(flat.float(), self.router.weight.float())  # (N, E), fp32
        scores = torch.sigmoid(scores) if self.sigmoid else torch.softmax(scores, dim=-1)
        weights, chosen = self.choose(scores)  # (N, k) each
        order = torch.argsort(chosen.flatten(), stable=True)  # (N k,) grouped by expert
        counts = torch.bincount(chosen.flatten(), minlength=scores.size(1))  # (E,)
        if self.capacity_factor:
            order, counts = self.cap(order, counts)
        if not self.routing:  # a pipeline's shape inference (stages.py): route no token
            order, counts = order[:0], torch.zeros_like(counts)
        rows = flat[order // self.top_k]  # (M, C): each token once per chosen expert
        out = self.exchange(rows, counts, self.compute)  # (M, C)
        # Back to (token, choice) places; a dropped choice stays 0.
        placed = out.new_zeros(B * T * self.top_k, C).index_copy(0, order, out)
        y = (placed.view(B * T, self.top_k, C) * weights.unsqueeze(-1).to(out.dtype)).sum(1)
        if self.shared is not None:
            y = y + self.shared[1](self.activation(self.shared[0](flat)))
        if self.training and not recomputing():  # a recomputed block's tokens counted once
            counts = counts.detach().float()
            self.routed = counts if self.routed is None else self.routed + counts
        if self.training and self.aux_loss_coef and B * T:
            y = AuxGradient.apply(y, self.aux_loss(scores, chosen, B), self.aux_scale)
        return self.dropout(y.view(B, T, C))

    def choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, chosen): each token's top_k experts by score + bias (the bias only chooses),
        and the weights of their outputs (the scores; sigmoid's normalised to sum to 1)."""
        ranked = torch.sort(scores + self.expert_bias, dim=-1, descending=True, stable=True)
        chosen = ranked.indices[:, : self.top_k]  # (N, k)
        weights = scores.gather(1, chosen)
        if self.sigmoid:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, chosen

    def cap(self, order: torch.Tensor, counts: torch.Tensor):
        """Keep each expert's first `capacity` rows (in token order); drop the rest."""
        capacity = math.ceil(self.capacity_factor * order.numel() / counts.numel())
        starts = torch.cumsum(counts, 0) - counts  # (E,) where each group starts
        place = torch.arange(order.numel(), device=order.device) - starts.repeat_interleave(counts)
        return order[place < capacity], counts.clamp(max=capacity)

    def compute(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (M, C) grouped by expert, counts (E_here,): each group through its expert, here.
        A loop over experts, to be read: torch's grouped matmul (torch._grouped_mm, private)
        does them in one call, on a CPU too in torch 2.13 (forward and backward; 20% faster on
        one block's shapes, on 2 EPYC cores), not yet a public API."""
        # unbind, not w1[e]: each w1[e]'s backward would write its gradient into a zeroed copy
        # of the whole (E, C, H) tensor (8 experts: 8 such per weight per block, most of a MoE
        # step's time on a CPU); unbind's backward stacks the experts' gradients once.
        w1, w2 = local(self.w1).unbind(0), local(self.w2).unbind(0)  # (C, H), (H, C) each
        # Each group padded with zero rows to a multiple of PAD_ROWS: routing makes new row
        # counts every step, hence new matmul shapes, and the CPU's memory grew with them
        # (docs/experts.md: before this and the unbind above, benchmarks/experts.py's run took
        # 1,174 MiB at 6.4k tokens/s; now 430 MiB at 9.0k). Zero rows change no real row's
        # output, and add nothing to the weights' gradients.
        counts = counts.tolist()
        padded = [n + -n % PAD_ROWS for n in counts]
        starts = [sum(padded[:e]) for e in range(len(padded))]
        at = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)]).to(rows.device)
        buffer = rows.new_zeros(sum(padded), rows.size(1)).index_copy(0, at, rows)
        outs = [self.activation(g @ a) @ b for g, a, b in zip(buffer.split(padded), w1, w2)]
        return torch.cat(outs)[at] if outs else rows[:0]  # (M, C): the real rows, in order

    def aux_loss(self, scores: torch.Tensor, chosen: torch.Tensor, B: int) -> torch.Tensor:
        """Switch's balance loss per sequence, averaged: E x sum_e f_e P_e, where f_e is the
        share of the sequence's top_k choices that went to e and P_e its mean (normalised)
        score. 1 when balanced; E when every token picks the same expert."""
        E = scores.size(1)
        probs = scores / scores.sum(-1, keepdim=True) if self.sigmoid else scores
        P = probs.view(B, -1, E).mean(1)  # (B, E)
        picks = F.one_hot(chosen.reshape(B, -1), E).float().mean(1)  # (B, E): share of choices
        return self.aux_loss_coef * E * (picks * P).sum(-1).mean()

    @torch.no_grad()
    def rebalance(self, routed: torch.Tensor) -> None:
        """After a step: routed (E,), the step's tokens per expert over every rank. The bias of an
        expert above the mean goes down by the rate, below it up (DeepSeek-V3)."""
        if self.bias_update_rate:
            self.expert_bias += self.bias_update_rate * torch.sign(routed.mean() - routed)
        self.routed = None


def moe_layers(modules: list[nn.Module]) -> list[MoE]:
    """Every MoE block of these modules (a model, or a rank's pipeline stages), in order."""
    return [m for module in modules for m in module.modules() if isinstance(m, MoE)]
