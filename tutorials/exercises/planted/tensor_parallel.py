"""Exercise 6, planted wrong: no f. The forward is right, but in backward each rank keeps only
its own share of the input's gradient: the equality check on x.grad catches it."""

import torch
import torch.distributed as dist
import torch.nn.functional as F


class SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous().clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def column_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight, bias)  # the bug: f missing, its backward all-reduce with it


def row_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return SumOverRanks.apply(F.linear(x, weight)) + bias
