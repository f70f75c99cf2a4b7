"""Exercise 6: column- and row-parallel Linears, Megatron's MLP. (README section 9; hint:
hints/tensor_parallel.md)

    python tutorials/exercises/grade.py tensor_parallel

Graded on 2 gloo ranks: an MLP (column-parallel, GELU, row-parallel) on the same input on every
rank must give one process's output, input gradient and weight gradients (each rank's slice);
the bytes: one all-reduce forward and one backward, of the MLP's (batch, features) output.
"""

import torch
import torch.distributed as dist  # noqa: F401 - what you will need


def column_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x (B, in), whole on every rank; weight (out / N, in) and bias (out / N,): this rank's rows.
    Returns this rank's out / N output features, x @ weight^T + bias. Forward sends nothing; in
    backward each rank's gradient for x is only its rows' share, so it must be all-reduced: an
    autograd Function "f" (identity forward, all-reduce backward) applied to x first."""
    raise NotImplementedError("write column_parallel: f, then the matmul")


def row_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x (B, in / N): this rank's input features; weight (out, in / N): this rank's columns;
    bias (out,): whole. Returns the whole (B, out) output on every rank: the partial products
    x @ weight^T summed over the ranks by "g" (all-reduce forward, identity backward), then
    + bias."""
    raise NotImplementedError("write row_parallel: the matmul, g, then the bias")
