"""Exercise 4, planted wrong: backward all-reduces the whole gradient and keeps its own rows.
The numbers are right; the bytes are twice the reduce-scatter's (an all-reduce is a
reduce-scatter and an all-gather), which the byte check catches."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# torch 2.13 renamed them (the old names warn); earlier versions have only the old ones.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: torch.Tensor) -> torch.Tensor:
        whole = shard.new_empty(shard.size(0) * dist.get_world_size(), shard.size(1))
        all_gather(whole, shard.contiguous())
        return whole

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)  # the bug: every rank gets every row, then drops most
        return grad.chunk(dist.get_world_size())[dist.get_rank()] / dist.get_world_size()


class ShardedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        rows = weight.chunk(dist.get_world_size())[dist.get_rank()]
        self.shard = nn.Parameter(rows.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, Gather.apply(self.shard))
