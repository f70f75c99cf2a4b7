"""Exercise 6, a reference solution: Megatron's f and g as autograd Functions."""

import torch
import torch.distributed as dist
import torch.nn.functional as F


class CopyToRanks(torch.autograd.Function):  # f
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)  # each rank's share of the input's gradient, summed
        return grad


class SumOverRanks(torch.autograd.Function):  # g
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous().clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def column_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.linear(CopyToRanks.apply(x), weight, bias)


def row_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return SumOverRanks.apply(F.linear(x, weight)) + bias
