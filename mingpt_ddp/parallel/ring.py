"""Causal ring attention over sequence shards: context parallelism's attention kernel.

Each of the N ranks of a context-parallel group holds 2 of a window's 2N chunks of T / 2N tokens:
chunk r and chunk 2N - 1 - r (load balancing: under a causal mask a late chunk attends to more
keys than an early one, so an early and a late chunk give every rank the same work). Its queries
need every earlier key, so the keys and values travel around the ring: N steps, at each one a rank
attends its queries to the (K, V) it holds while they already travel on: the send to the next rank
and the receive from the previous one are posted (batch_isend_irecv) before the step's block is
computed, and waited for only after it, so communication overlaps compute (on CPU gloo's I/O
thread moves the bytes; on GPUs NCCL runs on a stream of its own). The partial results are
combined with the online-softmax rule: each block's output weighted by exp(its log-sum-exp - the
running one), the same sum full attention computes in one go. Backward goes around the ring
again: the keys and values once more, posted ahead the same way, and their gradients one hop
behind them: the gradient a rank adds to a block travels on while the next block is computed, and
the receiver adds its own share to it when it arrives; a last hop takes each gradient home. Bytes
each rank sends per attention call, S = B * nh * (T / N) * hs * 4 (one of K or V): forward
(N - 1) 2S, backward (N - 1) 2S + N 2S. Positions and masks are built on the tensors' device
(once per window length and source, then reused by every layer): no host copy, no wait for it.

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


def balanced_positions(T: int, degree: int, index: int, device=None) -> torch.Tensor:
    """The positions of the tokens rank `index` of `degree` holds: chunks index and
    2 * degree - 1 - index of a window of T cut into 2 * degree. (T / degree,), on device."""
    chunk = T // (2 * degree)
    first, last = index * chunk, (2 * degree - 1 - index) * chunk
    return torch.cat(
        [
            torch.arange(first, first + chunk, device=device),
            torch.arange(last, last + chunk, device=device),
        ]
    )


class RingAttention:
    """The attention kernel a context-parallel model calls (model.CausalSelfAttention.attend):
    ring attention while sharding() is on, the model's own kernel `whole` otherwise (sampling)."""

    def __init__(self, group: dist.ProcessGroup, whole):
        self.group, self.whole = group, whole
        self.ranks = dist.get_process_group_ranks(group)  # global ranks, in ring order
        self.index = dist.get_rank(group)
        self.active = False
        self._visible: dict[tuple, torch.Tensor] = {}  # (T/N, source, device) -> mask

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
        """The positions rank `index` holds, made on device (no host copy)."""
        return balanced_positions(T_local * len(self.ranks), len(self.ranks), index, device)

    def visible(self, T_local: int, source: int, device) -> torch.Tensor:
        """(T/N, T/N) bool: which of source's keys each of this rank's queries may see. Made on
        device once per (T/N, source, device) and kept: every layer, forward and backward, asks."""
        key = (T_local, source, torch.device(device))
        if key not in self._visible:
            mine = self.positions(T_local, self.index, device)
            theirs = self.positions(T_local, source, device)
            self._visible[key] = mine[:, None] >= theirs[None, :]
        return self._visible[key]

    def post(self, tensor: torch.Tensor, tag: int = 0) -> _InFlight:
        """Start sending tensor to the next rank of the ring and receiving the previous rank's
        (tag: which stream of the ring, K and V or their gradients); .wait() returns it."""
        n = len(self.ranks)
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.ranks[(self.index + 1) % n], self.group, tag),
            dist.P2POp(dist.irecv, received, self.ranks[(self.index - 1) % n], self.group, tag),
        ]
        return _InFlight(dist.batch_isend_irecv(ops), tensor, received)


class _InFlight:
    """A posted send/recv pair: the tensor sent is held (it must not change nor be freed before
    the send is done) until wait(), which returns the tensor received."""

    def __init__(self, requests, sent: torch.Tensor, received: torch.Tensor):
        self.requests, self.sent, self.received = requests, sent, received

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        self.sent = None
        return self.received


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
        coming = ring.post(kv) if step < n - 1 else None  # they travel on while this step runs
        scores = _scores(q, kv[0], ring.visible(T_local, source, q.device))  # (B, nh, T/N, T/N)
        block_lse = scores.logsumexp(-1)  # (B, nh, T/N)
        new_lse = torch.logaddexp(lse, block_lse)
        block_out = torch.exp(scores - block_lse[..., None]) @ kv[1]  # (B, nh, T/N, hs)
        out = out * torch.exp(lse - new_lse)[..., None]  # rescale what came before
        out = out + block_out * torch.exp(block_lse - new_lse)[..., None]
        lse = new_lse
        if coming is not None:
            kv = coming.wait()  # the previous rank's, for the next step
    return out, lse


def _ring_backward(q, k, v, out, lse, d_out, ring: RingAttention):
    """The gradients of q (B, nh, T/N, hs) and of this rank's K and V (2, B, nh, T/N, hs): the
    probabilities rebuilt per block from the saved log-sum-exp (flash attention's backward). The
    keys and values go ahead (tag 0); the gradients of a block follow one step behind (tag 1),
    travelling while the next block is computed, and each rank adds its share when they arrive."""
    n, T_local = len(ring.ranks), q.size(2)
    delta = (d_out * out).sum(-1, keepdim=True)  # (B, nh, T/N, 1): rowsum(dO * O)
    kv = torch.stack([k, v]).float()  # (2, B, nh, T/N, hs)
    d_q = torch.zeros_like(q)
    scale = 1 / math.sqrt(q.size(-1))
    grads = None  # the gradients of the block this rank holds, on their way from the previous
    for step in range(n):
        source = (ring.index - step) % n
        coming = ring.post(kv) if step < n - 1 else None
        visible = ring.visible(T_local, source, q.device)
        probs = torch.exp(_scores(q, kv[0], visible) - lse[..., None])  # (B, nh, T/N, T/N)
        d_scores = probs * (d_out @ kv[1].transpose(-2, -1) - delta)
        d_q += d_scores @ kv[0] * scale
        # this rank's share of source's key and value gradients, (2, B, nh, T/N, hs)
        mine = torch.stack(
            [d_scores.transpose(-2, -1) @ q * scale, probs.transpose(-2, -1) @ d_out]
        )
        d_kv = mine if grads is None else grads.wait() + mine
        if n == 1:
            return d_q, d_kv
        grads = ring.post(d_kv, tag=1)  # to the next rank, which holds source's K, V next step
        if coming is not None:
            kv = coming.wait()
    return d_q, grads.wait()  # the last hop brought this rank's own K and V gradients home
