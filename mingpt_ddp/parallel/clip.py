"""Gradient clipping by the global norm: the norm of the whole model's gradient, whatever the
grid holds where.

One process computes ||g|| over its parameters. Spread over a grid, each rank holds part of it:
a pipeline stage's parameters, a tensor-parallel or FSDP shard (a DTensor), or a whole tensor
that other ranks hold too (a replica, or the embeddings beside tensor parallelism). The global
norm adds each rank's squares, each value counted once: a tensor held alike by k ranks adds its
squares / k on each, and one all-reduce of a single number sums them over the world.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def global_norm(params: list, plain_copies: int) -> torch.Tensor:
    """The gradient norm over the whole model, from any mix of DTensor shards and whole tensors.
    Partial gradients (sequence parallelism's LayerNorms: each rank's positions only) are summed
    first. plain_copies: the ranks that hold each whole tensor alike (a pipeline stage's ranks);
    a DTensor cut in k pieces has plain_copies / k copies of each piece. Collective."""
    total = torch.zeros((), device=params[0].device if params else None)
    for p in params:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(placements=p.placements)  # Partial: sum over tp
        grad, copies = p.grad, plain_copies
        if isinstance(grad, DTensor):  # its pieces: the product of its sharded dimensions
            mesh, placements = grad.device_mesh, grad.placements
            pieces = math.prod(
                mesh.size(i) for i, s in enumerate(placements) if not s.is_replicate()
            )
            copies, grad = plain_copies // pieces, grad.to_local()
        total += grad.float().square().sum() / copies
    dist.all_reduce(total)
    return total.sqrt()


def clip_grad_norm(params: list, max_norm: float, plain_copies: int, twice=None) -> torch.Tensor:
    """Clip the gradients to max_norm by their global norm; returns that norm (before clipping).
    plain_copies 0: every rank holds the whole model's gradients alike (one process, DDP), so the
    norm is local, torch's own clip_grad_norm_ with no communication. twice: a parameter that is
    another's copy (a pipeline's tied head): clipped, but not counted in the norm again."""
    params = [p for p in params if p.grad is not None]
    if not plain_copies:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = global_norm([p for p in params if p is not twice], plain_copies)
    # torch's clip_grads_with_norm_, once per kind of gradient: whole tensors, and DTensors per
    # mesh (its foreach kernels take no mix: FSDP x TP holds 2-D and 1-D DTensors).
    groups: dict = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm
