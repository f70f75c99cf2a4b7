"""Tensor parallelism (mesh_config.tp, alias tensor_config.degree): Megatron's layout, on DTensor.

Each block's matrices are split over the tp ranks of a tensor-parallel group, so each rank holds
and computes 1/tp of every block. Attention: the fused QKV matmul column-wise (each rank its
heads' queries, keys and values), the heads attend locally, the output projection row-wise (each
rank its heads' columns), and an all-reduce sums the partial outputs. MLP: the first matmul
column-wise, the activation locally, the second row-wise, an all-reduce. Backward mirrors it: an
all-reduce of the input's gradient before each split matmul. So 4 all-reduces of (B, T, C) per
block per step, and nothing else in the blocks (torch.distributed.tensor.parallel's styles).

The embedding, the final LayerNorm and the head stay whole on every rank: with 65 characters the
head is ~1% of the model's FLOPs, and a vocabulary split would add an all-reduce for the softmax's
sums to save it (GPT-2's 50,257 tokens are where it pays).

sequence_parallel also splits the sequence between the split matmuls: the residual stream,
LayerNorms and dropout hold T / tp positions per rank, an all-gather (of the sequence) replaces
each all-reduce before a split matmul and a reduce-scatter the one after: the same bytes, 1/tp of
the activations there. The LayerNorms' gradients are then partial sums (each rank saw its
positions only) and are summed over the group before clipping (clip.py).

The parameters become DTensors, so the data-parallel ranks beside tp hold them through
fully_shard (FSDP, or replicas as HSDP with one shard), never DDP (parallelize.py). Snapshots hold
the QKV rows in the standard order (standard_order), so any degree, and one process, read them.
Grown-up version of tutorials/tensor_parallel_by_hand.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from mingpt_ddp.errors import ConfigError


def heads_first(n_embd: int, degree: int) -> torch.Tensor:
    """The row order of the fused QKV weight (3C, C) that makes a plain split of its rows give
    each rank its own heads' q, k and v. Its rows are (3, nh, hs): split as they are, rank 0 of 2
    would get all of q and half of k. Reordered as (degree, 3, nh / degree, hs), rank r's
    contiguous rows are q, k and v of heads r * nh / degree onwards."""
    return torch.arange(3 * n_embd).view(3, degree, n_embd // degree).transpose(0, 1).flatten()


def block_plan(sequence_parallel: bool) -> dict:
    """Megatron's split of one block, as parallelize_module styles. With sequence parallelism the
    LayerNorms run on sequence shards, the split matmuls' inputs are gathered along the sequence
    and their outputs reduce-scattered back to it (instead of all-reduced)."""
    if not sequence_parallel:
        return {
            "attn.qkv": ColwiseParallel(),  # (B, T, C) -> this rank's heads: (B, T, 3C / tp)
            "attn.proj": RowwiseParallel(),  # (B, T, C / tp) -> all-reduced (B, T, C)
            "mlp.fc": ColwiseParallel(),  # (B, T, C) -> (B, T, 4C / tp)
            "mlp.proj": RowwiseParallel(),  # (B, T, 4C / tp) -> all-reduced (B, T, C)
        }
    gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "ln_1": SequenceParallel(),  # (B, T / tp, C) per rank
        "attn": PrepareModuleInput(  # all-gather the sequence: (B, T, C); rope passes as it is
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),  # reduce-scatter: (B, T / tp, C)
        "ln_2": SequenceParallel(),
        "mlp": PrepareModuleInput(**gather),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def check_tp(cfg, degree: int) -> None:
    """Refuse a degree the model's heads and MLP cannot be split by, naming the key."""
    for n, what in ((cfg.n_head, "gpt_config.n_head"), (4 * cfg.n_embd, "4 x n_embd")):
        if n % degree:
            raise ConfigError(
                f"mesh_config.tp={degree} must divide {what} ({n}): each rank holds whole heads "
                "and an equal share of the MLP; pick a degree that divides it"
            )


def apply_tp(model: nn.Module, mesh, sequence_parallel: bool) -> None:
    """Split every block of model (the whole model, or a pipeline stage) over the 1-D mesh "tp" in
    place (block_plan); with sequence parallelism, the embedding's output is cut along the sequence
    and gathered back before the (whole) head."""
    cfg, degree = model.config, mesh.size()
    check_tp(cfg, degree)
    order = heads_first(cfg.n_embd, degree)
    for block in model.blocks.children():
        qkv = block.attn.qkv
        with torch.no_grad():  # before the split: each rank's rows become its heads'
            qkv.weight.copy_(qkv.weight[order])
            if qkv.bias is not None:
                qkv.bias.copy_(qkv.bias[order])
        plan = block_plan(sequence_parallel)
        if not hasattr(block.mlp, "fc"):  # a mixture of experts: its experts stay whole, and
            # every tp rank routes the same tokens through them (expert.py splits experts instead)
            plan = {key: style for key, style in plan.items() if not key.startswith("mlp")}
        parallelize_module(block, mesh, plan)
    if sequence_parallel and model.wte is not None:  # a pipeline refuses sequence parallelism
        cut = dict(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),))
        parallelize_module(
            model,
            mesh,
            {
                "drop": PrepareModuleInput(**cut, use_local_output=True),  # (B, T / tp, C)
                "ln_f": SequenceParallel(),
                "lm_head": PrepareModuleInput(  # all-gather: the head sees every position
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_output=True,
                ),
            },
        )


def is_qkv(name: str) -> bool:
    """Whether a state-dict key is (or belongs to) a fused QKV weight or bias."""
    return ".attn.qkv." in f".{name}"


def tensors_in(state: dict, path: tuple = ()):
    """(path, tensor) for every tensor of a state dict, nested (optimizer state) or flat."""
    for key, value in state.items():
        if isinstance(value, dict):
            yield from tensors_in(value, (*path, key))
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            yield (*path, key), value


def _get(state: dict, path: tuple):
    return state[path[0]] if len(path) == 1 else _get(state[path[0]], path[1:])


def _put(state: dict, path: tuple, value) -> None:
    """Set a value, copying the dicts on its way (get_state_dict hands out the optimizer's own)."""
    if len(path) == 1:
        state[path[0]] = value
    else:
        state[path[0]] = dict(state[path[0]])
        _put(state[path[0]], path[1:], value)


def standard_order(state: dict, order: torch.Tensor) -> dict:
    """state with its QKV rows (and their optimizer state) gathered whole and put back in the
    standard (3, nh, hs) order: a rank's rows are its heads', not a contiguous piece of that
    layout, so DCP could not write them as one; whole, any degree and one process read them.
    Collective."""
    for path, value in list(tensors_in(state)):
        if is_qkv(".".join(map(str, path))):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            _put(state, path, full.index_select(0, torch.argsort(order).to(full.device)))
    return state


def to_layout(state: dict, like: dict, order: torch.Tensor) -> dict:
    """state's whole tensors (one file, or the gathered QKV rows) cut to this rank's layout, as
    `like` (this run's state dict) holds it: QKV rows in heads-first order, then each rank's
    piece (distribute_tensor without communication: every rank holds the whole tensor)."""
    for path, mine in tensors_in(like):
        value = _get(state, path)
        if isinstance(mine, DTensor) and not isinstance(value, DTensor):
            value = value.to(mine.device)
            if is_qkv(".".join(map(str, path))):
                value = value.index_select(0, order.to(value.device))
            value = distribute_tensor(value, mine.device_mesh, mine.placements, src_data_rank=None)
            _put(state, path, value)
    return state
