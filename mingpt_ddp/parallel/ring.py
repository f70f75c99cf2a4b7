"""Causal ring attention over sequence shards: context parallelism's attention kernel.

Each of the N ranks of a context-parallel group holds 2 of a window's 2N chunks of T / 2N tokens:
chunk r and chunk 2N - 1 - r (load balancing: under a causal mask a late chunk attends to more
keys than an early one, so an early and a late chunk give every rank the same work). Its queries
need every earlier key, so the keys and values travel around the ring: N steps, at each one a rank
attends its queries to the (K, V) it holds and passes them to the next rank while it computes
(send/recv). The partial results are combined with the online-softmax rule: each block's output
weighted by exp(its log-sum-exp - the running one), the same sum full attention computes in one
go. Backward goes around the ring again: the keys and values once more, with their gradients
travelling beside them and a last hop taking each gradient home. Bytes each rank sends per
attention call, S = B * nh * (T / N) * hs * 4 (one of K or V): forward (N - 1) 2S, backward
(N - 1) 2S + N 2S.

torch's own context_parallel (torch.distributed.tensor.experimental) dispatches only the CUDA
attention kernels (flash, efficient, cuDNN); this one is plain matmuls in fp32, so it runs on
CPU and on any backend with send/recv. Attention dropout is not built here.
tutorials/ring_attention_by_hand.py builds the forward step by step.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist

MASKED = -1e30  # not -inf: a row with no visible key in one block must not give exp(-inf + inf)


def balanced_positions(T: int, degree: int, index: int) -> torch.Tensor:
    """The positions of the tokens rank `index` of `degree` holds: chunks index and
    2 * degree - 1 - index of a window of T cut into 2 * degree. (T / degree,)"""
    chunk = T // (2 * degree)
    first, last = index * chunk, (2 * degree - 1 - index) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(last, last + chunk)])


class RingAttention:
    """The attention kernel a context-parallel model calls (model.CausalSelfAttention.attend):
    ring attention while sharding() is on, the model's own kernel `whole` otherwise (sampling)."""

    def __init__(self, group: dist.ProcessGroup, whole):
        self.group, self.whole = group, whole
        self.ranks = dist.get_process_group_ranks(group)  # global ranks, in ring order
        self.index = dist.get_rank(group)
        self.active = False

    @contextmanager
    def sharding(self):
        """Forward passes inside see this rank's chunks of each window (the strategy cut them)."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def __call__(self, q, k, v, dropout_p: float):
        if not self.active:
            return self.whole(q, k, v, dropout_p)
        return _Ring.apply(q, k, v, self)

    def positions(self, T_local: int, index: int, device) -> torch.Tensor:
        return balanced_positions(T_local * len(self.ranks), len(self.ranks), index).to(device)

    def visible(self, T_local: int, source: int, device) -> torch.Tensor:
        """(T/N, T/N) bool: which of source's keys each of this rank's queries may see."""
        mine = self.positions(T_local, self.index, device)
        theirs = self.positions(T_local, source, device)
        return mine[:, None] >= theirs[None, :]

    def pass_on(self, tensor: torch.Tensor) -> torch.Tensor:
        """Send tensor to the next rank of the ring and receive the previous rank's."""
        n = len(self.ranks)
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.ranks[(self.index + 1) % n], self.group),
            dist.P2POp(dist.irecv, received, self.ranks[(self.index - 1) % n], self.group),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return received


def _scores(q, k, visible) -> torch.Tensor:
    """(B, nh, Tq, Tk) scaled scores, the invisible ones MASKED."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    return scores.masked_fill(~visible, MASKED)


class _Ring(torch.autograd.Function):
    """Forward and backward in fp32 whatever autocast says: the running log-sum-exp must be exact
    enough for backward to rebuild the probabilities from it, and MASKED fits no 16-bit type."""

    @staticmethod
    def forward(ctx, q, k, v, ring: RingAttention):
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _ring_forward(q.float(), torch.stack([k, v]).float(), ring)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            d_q, d_kv = _ring_backward(q.float(), k, v, out, lse, d_out.float(), ctx.ring)
        return d_q.to(q.dtype), d_kv[0].to(k.dtype), d_kv[1].to(v.dtype), None


def _ring_forward(q, kv, ring: RingAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, nh, T/N, hs) and this rank's kv (2, B, nh, T/N, hs), fp32 -> the attention output
    (B, nh, T/N, hs) and each query's log-sum-exp over every visible key (B, nh, T/N)."""
    n, T_local = len(ring.ranks), q.size(2)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], -math.inf, device=q.device)  # (B, nh, T/N)
    for step in range(n):
        source = (ring.index - step) % n  # whose keys and values this rank holds now
        scores = _scores(q, kv[0], ring.visible(T_local, source, q.device))  # (B, nh, T/N, T/N)
        block_lse = scores.logsumexp(-1)  # (B, nh, T/N)
        new_lse = torch.logaddexp(lse, block_lse)
        block_out = torch.exp(scores - block_lse[..., None]) @ kv[1]  # (B, nh, T/N, hs)
        out = out * torch.exp(lse - new_lse)[..., None]  # rescale what came before
        out = out + block_out * torch.exp(block_lse - new_lse)[..., None]
        lse = new_lse
        if step < n - 1:
            kv = ring.pass_on(kv)
    return out, lse


def _ring_backward(q, k, v, out, lse, d_out, ring: RingAttention):
    """The gradients of q (B, nh, T/N, hs) and of this rank's K and V (2, B, nh, T/N, hs): the
    probabilities rebuilt per block from the saved log-sum-exp (flash attention's backward)."""
    n, T_local = len(ring.ranks), q.size(2)
    delta = (d_out * out).sum(-1, keepdim=True)  # (B, nh, T/N, 1): rowsum(dO * O)
    kv = torch.stack([k, v]).float()  # (2, B, nh, T/N, hs)
    d_kv = torch.zeros_like(kv)  # their gradients, (2, B, nh, T/N, hs)
    d_q = torch.zeros_like(q)
    scale = 1 / math.sqrt(q.size(-1))
    for step in range(n):
        source = (ring.index - step) % n
        visible = ring.visible(T_local, source, q.device)
        probs = torch.exp(_scores(q, kv[0], visible) - lse[..., None])  # (B, nh, T/N, T/N)
        d_scores = probs * (d_out @ kv[1].transpose(-2, -1) - delta)
        d_q += d_scores @ kv[0] * scale
        d_kv[0] += d_scores.transpose(-2, -1) @ q * scale  # source's keys
        d_kv[1] += probs.transpose(-2, -1) @ d_out  # source's values
        if step < n - 1:  # the gradients travel with the keys and values they belong to
            both = ring.pass_on(torch.cat([kv, d_kv]))  # (4, B, nh, T/N, hs)
            kv, d_kv = both[:2], both[2:]
    d_kv = ring.pass_on(d_kv) if n > 1 else d_kv  # home: the next rank owns them
    return d_q, d_kv
