"""Sharded data parallelism (parallel=fsdp; mesh_config.dp_shard): FSDP2's `fully_shard`.

Every rank of the data-parallel shard dimension holds 1/dp_shard of each parameter, gradient and
optimizer state (DTensor shards). Before a block runs forward or backward its parameters are
all-gathered, and afterwards freed again; gradients are reduce-scattered, so each rank keeps only
its shard. Memory per rank falls roughly as 1/dp_shard, for more communication. Mixed precision
is a MixedPrecisionPolicy: whole blocks compute on bf16/fp16 copies of the parameters over fp32
shards, so there is no autocast.

The same call on a 2-D mesh (dp_replicate, dp_shard_cp) is HSDP: shards within a group, whole
copies across groups (gradients reduce-scattered within, all-reduced across). With one shard it
is plain replication of DTensor parameters, which DDP does not take: how data-parallel replicas
sit beside tensor parallelism (torchtitan's way). Context parallelism's ranks are folded into the
shard dimension (dp_shard_cp): they hold the same parameters, so their gradients are summed too.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from mingpt_ddp.parallel.plan import AMP_DTYPES


def shard(module: nn.Module, mesh, plan, root: bool = False, ignored=frozenset()) -> None:
    """fully_shard one module over mesh, with the plan's precision, offload and resharding. The
    root (embeddings, final norm, head) keeps its gathered parameters after forward: the head is
    the first thing backward needs, so freeing them would only gather them again at once (torch's
    own default for the root; counted: one all-gather of the root less per step)."""
    # bf16 compute copies of the parameters, fp32 gradient reduction (summing many small bf16
    # numbers loses precision), fp32 sharded master weights.
    mp = (
        MixedPrecisionPolicy(param_dtype=AMP_DTYPES[plan.amp_dtype], reduce_dtype=torch.float32)
        if plan.use_amp
        else MixedPrecisionPolicy()
    )
    fully_shard(
        module,
        mesh=mesh,
        mp_policy=mp,
        offload_policy=CPUOffloadPolicy() if plan.cpu_offload else OffloadPolicy(),
        reshard_after_forward=plan.reshard_after_forward and not root,
        ignored_params=set(ignored) & set(module.parameters()) or None,
    )


def apply_fsdp(model: nn.Module, mesh, plan, ignored=frozenset()) -> nn.Module:
    """Shard in place over mesh (1-D: FSDP; 2-D (replicate, shard): HSDP), block by block, then
    the root (embeddings, final norm, head: what remains): each block's parameters are gathered
    just before it runs and freed after. ignored: parameters left as they are (the experts that
    expert parallelism shared out, expert.py)."""
    for block in model.blocks.children():
        shard(block, mesh, plan, ignored=ignored)
    shard(model, mesh, plan, root=True, ignored=ignored)
    return model
