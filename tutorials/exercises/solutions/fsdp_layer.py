"""Exercise 4, a reference solution: an autograd Function that all-gathers the shards forward
and reduce-scatters the gradient backward."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# torch 2.13 renamed them (the old names warn); earlier versions have only the old ones.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Gather(torch.autograd.Function):
    """shard (out / N, in) -> whole weight (out, in); backward: reduce-scatter, then / N."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor) -> torch.Tensor:
        whole = shard.new_empty(shard.size(0) * dist.get_world_size(), shard.size(1))
        all_gather(whole, shard.contiguous())
        return whole

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        mine = grad.new_empty(grad.size(0) // dist.get_world_size(), grad.size(1))
        reduce_scatter(mine, grad.contiguous())  # summed over the ranks
        return mine / dist.get_world_size()  # each rank's loss a mean: the average


class ShardedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        rows = weight.chunk(dist.get_world_size())[dist.get_rank()]
        self.shard = nn.Parameter(rows.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, Gather.apply(self.shard))
