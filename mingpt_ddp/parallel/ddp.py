"""Replicated data parallelism (parallel=ddp): DistributedDataParallel.

Every rank holds all parameters, gradients and optimizer state. DDP registers autograd hooks
that all-reduce the gradients bucket by bucket while backward is still running, overlapping
communication with compute, so every replica takes the same optimizer step and the copies stay
identical. With gradient accumulation, only the last micro-step's backward communicates
(no_sync before it). grad_reduce=via_rank0 swaps the ring all-reduce for a star through rank 0
(reduce_through_rank0), the teaching baseline that shows why DDP does what it does.
DDP takes plain parameters: beside tensor parallelism (DTensors) the replicas go through
fully_shard instead (fsdp.py). Grown-up version of tutorials/single_to_ddp.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_ddp(
    model: nn.Module, group, plan, device: torch.device, local_rank: int, ignored=frozenset()
) -> nn.Module:
    """model wrapped in DDP over group (its data-parallel ranks: dp x cp, a pipeline stage's
    column); grad_reduce=via_rank0 swaps its ring all-reduce for the star through rank 0.
    ignored: parameters DDP leaves out (the experts expert parallelism shared out, expert.py)."""
    ids = [local_rank] if device.type == "cuda" else None
    names = [name for name, p in model.named_parameters() if p in ignored]
    # The model's only buffers are MoE routing biases, which every rank moves alike
    # (expert.rebalance): DDP's broadcast of them before each forward would only cost a message.
    names += [name for name, _ in model.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(model, names)
    ddp = DDP(model, device_ids=ids, process_group=group)
    if plan.grad_reduce == "via_rank0":
        ddp.register_comm_hook(None, reduce_through_rank0)
    return ddp


# No type annotations on the hook: DDP checks them, and `from __future__ import annotations`
# would turn them into strings. process_group: dist.ProcessGroup | None; bucket: dist.GradBucket.
def reduce_through_rank0(process_group, bucket):
    """A DDP communication hook that averages gradients through rank 0: a star all-reduce (the
    parameter-server pattern).

    Every rank sends its gradient bucket to rank 0; rank 0 adds them up, divides, and
    sends the mean back to each rank, one message at a time, while backward waits.
    Rank 0's link carries (N-1) x the gradients in and (N-1) x out, where DDP's ring
    all-reduce moves 2(N-1)/N x through every link and overlaps with backward: the
    teaching baseline that shows why DDP does what it does (benchmarks/bench.py).
    Plain send/recv, not dist.reduce/broadcast, whose backends use rings and trees.
    """
    if process_group is not None:
        raise ValueError("reduce_through_rank0 works on the default process group only")
    grads = bucket.buffer()  # this bucket's gradients, flattened into one tensor
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        incoming = torch.empty_like(grads)
        for src in range(1, world):
            dist.recv(incoming, src=src)
            grads += incoming
        grads /= world
        for dst in range(1, world):
            dist.send(grads, dst=dst)
    else:
        dist.send(grads, dst=0)
        dist.recv(grads, src=0)  # the mean, from rank 0
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(grads)
    return done
