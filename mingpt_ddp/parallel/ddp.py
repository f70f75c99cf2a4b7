"""parallel=ddp: DistributedDataParallel, a whole replica of the model on every rank.

Every rank holds all parameters, gradients and optimizer state. DDP registers autograd hooks
that all-reduce the gradients bucket by bucket while backward is still running, overlapping
communication with compute, so every replica takes the same optimizer step and the copies stay
identical. With gradient accumulation, only the last micro-step's backward communicates
(no_sync before it). grad_reduce=via_rank0 swaps the ring all-reduce for a star through rank 0
(reduce_through_rank0), the teaching baseline that shows why DDP does what it does.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.parallel.single import CPU_OFFLOAD_NEEDS_FSDP, Single
from mingpt_ddp.parallel.strategy import StrategyArgs


class DDPStrategy(Single):
    """The local step of single.py, with DDP's gradient all-reduce during backward."""

    @classmethod
    def check(cls, args: StrategyArgs) -> None:
        if args.plan.cpu_offload:
            raise ConfigError(CPU_OFFLOAD_NEEDS_FSDP)

    def wrap(self, model: nn.Module) -> nn.Module:
        model = super().wrap(model)  # checkpointed and compiled in place first, if asked
        if not self.ctx.distributed:
            return model  # `python main.py`: a world of one, nothing to average
        ddp = DDP(model, device_ids=[self.ctx.local_rank] if self.device.type == "cuda" else None)
        if self.plan.grad_reduce == "via_rank0":
            ddp.register_comm_hook(None, reduce_through_rank0)
        return ddp

    def gradient_sync(self, sync: bool) -> AbstractContextManager:
        """Before the last micro-step gradients only accumulate locally (DDP's no_sync)."""
        if sync or not isinstance(self.train_model, DDP):
            return nullcontext()
        return self.train_model.no_sync()

    def describe(self) -> tuple[str, str]:
        star = self.plan.grad_reduce == "via_rank0"
        mode = f"ddp{' (gradients via rank 0)' if star else ''}{self.checkpointing_words()}"
        return mode, self.precision()


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
