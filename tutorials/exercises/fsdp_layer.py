"""Exercise 4: one FSDP unit, a Linear whose weight is sharded. (README section 5; hint:
hints/fsdp_layer.md)

    python tutorials/exercises/grade.py fsdp_layer

Graded on 2 gloo ranks, each with its own batch: the output must equal x @ W^T, the input's
gradient one process's, and each rank's shard.grad its rows of the weight's gradient averaged
over the ranks; each rank must hold 1/N of the weight; the bytes: one all-gather of the shards
in forward and one reduce-scatter of the gradient in backward.
"""

import torch
import torch.distributed as dist  # noqa: F401 - what you will need
import torch.nn as nn


class ShardedLinear(nn.Module):
    """A bias-free Linear whose (out, in) weight is split by rows: rank r keeps rows
    r * out / N .. (r + 1) * out / N - 1 as its parameter `shard`, and nothing else.

    forward(x): all-gather the shards into the whole weight (dist.all_gather_single; before
    torch 2.13 dist.all_gather_into_tensor), then x @ W^T. Backward: the whole
    weight's gradient reduce-scattered (dist.reduce_scatter_single; before torch 2.13
    dist.reduce_scatter_tensor), so that each rank's
    shard.grad is its rows of the gradient, averaged over the ranks (each rank's loss is the
    mean over its own batch). A torch.autograd.Function with both directions does it.
    """

    def __init__(self, weight: torch.Tensor):  # the whole weight, the same on every rank
        super().__init__()
        raise NotImplementedError("write ShardedLinear: keep your rows as self.shard")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("write forward: all-gather, matmul; backward reduce-scatters")
