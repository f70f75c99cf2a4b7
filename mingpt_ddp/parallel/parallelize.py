"""The ladder: every parallelism applied to a model in one fixed order, each along its dimension
of the one mesh (mesh.py). The whole model goes through it once; a pipeline cuts the model into
stages first and sends each stage through it (pipeline.py).

    1. tensor parallelism   split every block's matrices over "tp"      (tensor.py)
    2. expert parallelism   share out every MoE block's experts over "ep" (expert.py)
    3. context parallelism  attention through the ring over "cp"        (context.py)
    4. activation ckpt      recompute chosen blocks in backward         (checkpointing.py)
    5. compile              inductor kernels (per block where sharded)
    6. data parallelism     FSDP / HSDP over (dp_replicate, dp_shard_cp) (fsdp.py), or
                            DDP over "dp_cp" when every parameter is plain (ddp.py); both
                            leave out the experts that ep shared out (they average their own)

Why this order (torchtitan's): TP, EP and CP change what the blocks compute, so they come first;
checkpointing wraps the block's forward as it now is; compile traces that (a checkpointed block is
a region it recomputes); FSDP's hooks and DDP's reducer go outside everything, so a block's
parameters are gathered before its (recomputed) forward and gradients reduced once they exist.

Adding a parallelism: its module with an apply_... function, its degree in config/mesh.py and
mesh.py's DIMS, and one line here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from mingpt_ddp.parallel.checkpointing import apply_activation_checkpointing
from mingpt_ddp.parallel.context import apply_cp
from mingpt_ddp.parallel.ddp import apply_ddp
from mingpt_ddp.parallel.expert import apply_ep, expert_params
from mingpt_ddp.parallel.fsdp import apply_fsdp
from mingpt_ddp.parallel.mesh import ParallelDims
from mingpt_ddp.parallel.ring import RingAttention
from mingpt_ddp.parallel.tensor import apply_tp


@dataclass
class Parallelized:
    """A model (or a pipeline stage) after the ladder: what it was wrapped in, for the step."""

    module: nn.Module
    """What training calls: the model itself (sharded or split in place), or its DDP wrapper."""
    ring: RingAttention | None
    """Context parallelism's ring (its sharding() on while training and evaluating), or None."""
    checkpointed: int
    """Blocks under activation checkpointing."""
    data_parallel: str
    """How gradients are averaged over the data-parallel ranks: "fsdp", "hsdp", "ddp" or ""."""


def data_parallel(dims: ParallelDims, parallel: str, distributed: bool) -> str:
    """Which wrapper averages the gradients: FSDP where asked or where parameters are DTensors
    (tensor parallelism) with replicas beside them; DDP for plain parameters; nothing alone."""
    if parallel == "fsdp":
        return "hsdp" if dims.dp_replicate > 1 else "fsdp"
    replicas = dims.dp_replicate * dims.dp_shard * dims.cp
    if parallel != "ddp" or replicas == 1 or not distributed:
        return ""  # one replica; or an engine (Horovod, torchft) that averages itself
    return "hsdp" if dims.tp > 1 else "ddp"


def parallelize(model: nn.Module, mesh, dims: ParallelDims, plan, ctx, whole: bool) -> Parallelized:
    """model through the ladder in place (whole: the whole model, not a pipeline stage)."""
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], plan.tensor.sequence_parallel)
    if dims.ep > 1:
        apply_ep(model, mesh["ep"])
    ring = apply_cp(model, mesh["cp"]) if dims.cp > 1 else None
    checkpointed = apply_activation_checkpointing(model, plan.activation_checkpointing)
    how = data_parallel(dims, plan.parallel, ctx.distributed)
    if plan.compile:
        # The whole model as one graph where nothing splits it (inductor fuses the casts,
        # LayerNorms and the loss between blocks: 17.2 -> 15.3 ms/step on a 2-core CPU,
        # gpt-micro); block by block under FSDP (each block a unit it gathers) and in a stage.
        for part in [model] if whole and how in ("", "ddp") else list(model.blocks.children()):
            part.compile()  # in place: parameter names keep no "_orig_mod." prefix
    module, experts = model, set(expert_params([model]))
    if how == "fsdp":
        apply_fsdp(model, mesh["dp_shard_cp"], plan, experts)
    elif how == "hsdp":
        apply_fsdp(model, mesh["dp_replicate", "dp_shard_cp"], plan, experts)
    elif how == "ddp":
        group = mesh["dp_cp"].get_group()
        module = apply_ddp(model, group, plan, ctx.device, ctx.local_rank, experts)
    return Parallelized(module, ring, checkpointed, how)
