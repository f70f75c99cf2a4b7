"""parallel=horovod: Horovod's DistributedOptimizer, a whole replica of the model on every rank.

The same replicas as DDP, with the gradients averaged by Horovod instead of DDP's reducer (run
under horovodrun: mingpt_ddp/runtime/horovodrun.py turns its ranks into torchrun's variables, and
the project's control plane runs on a gloo process group as under torchrun). DistributedOptimizer
hooks every parameter's gradient accumulator: once backward has been through it
backward_passes_per_step times (the micro-steps of gradient accumulation), the hook hands the
gradient to Horovod's background thread, which fuses ready tensors into one buffer (up to
HOROVOD_FUSION_THRESHOLD bytes, every HOROVOD_CYCLE_TIME ms) and all-reduces it, here over gloo;
docs/horovod.md. The step: synchronize() waits for the averages, clipping sees them, and step()
runs inside skip_synchronize() so that it does not wait again. Rank 0's weights are broadcast at
the start, and its weights and optimizer state after a resume.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack

import torch
import torch.nn as nn

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.parallel.grid import GridStrategy
from mingpt_ddp.parallel.strategy import StrategyArgs, check_no_foreign_options
from mingpt_ddp.runtime.horovodrun import import_horovod


def check_gpu_build(hvd, device: torch.device) -> None:
    """CUDA gradients only with a Horovod that all-reduces them on the GPU (NCCL). Without it
    DistributedOptimizer hands them to DoAllreduceCudaOnCPU (horovod/torch/mpi_ops_v2.cc), which
    copies each to host memory asynchronously and waits for that copy only in a GPU build (its
    ready event is under #if HAVE_GPU); a CPU-only build, what tools/build_horovod.sh makes, then
    reduces bytes the copy may not have written yet, and its callback, copying the sum back to
    the GPU, throws ("not compiled with CUDA"), which ends Horovod's background thread. (A CUDA
    build without NCCL would wait for the copy and be right, only slower: refused all the same,
    for one build to ask for.)"""
    if device.type == "cuda" and not hvd.nccl_built():
        raise ConfigError(
            f"parallel=horovod on {device} needs a Horovod built with NCCL, and this one is not "
            "(tools/build_horovod.sh builds for CPUs): build it with "
            "HOROVOD_GPU_OPERATIONS=NCCL, or set trainer_config.device=cpu"
        )


class HorovodStrategy(GridStrategy):
    """The Trainer's step on a whole model, with Horovod averaging the gradients."""

    def __init__(self, model: nn.Module, args: StrategyArgs):
        self.hvd = import_horovod()
        super().__init__(model, args)  # checked, wrapped (checkpointing, compile), optimizers
        self.optimizers = [self.distributed(opt, args.accum_steps) for opt in self.optimizers]
        # Every rank built the same weights from the same seed; the broadcast makes sure of it,
        # as DDP's constructor does. Not the optimizer state: a fresh one has none, and Horovod's
        # broadcast_optimizer_state would first create it with a step on zero gradients (at the
        # configured lr: AdamW's weight decay moves the weights, and Adam counts the step).
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    @classmethod
    def check(cls, args: StrategyArgs) -> None:
        check_no_foreign_options(args.plan)  # FSDP's CPU offload, DDP's via_rank0 hook
        if any(degree > 1 for degree in args.plan.degrees().values()):
            raise ConfigError(
                "parallel=horovod averages whole gradients over every rank: set mesh_config.tp, "
                "cp and pp to 1 (or use parallel=ddp or fsdp for a split model)"
            )
        hvd = import_horovod()
        check_gpu_build(hvd, args.ctx.device)
        hvd.init()  # started already under horovodrun; a plain `python main.py`: a world of one
        if hvd.size() != args.ctx.world_size:
            raise ConfigError(
                f"parallel=horovod: Horovod sees {hvd.size()} rank(s), the launcher started "
                f"{args.ctx.world_size}; launch with horovodrun -np N -H localhost:N python "
                "main.py trainer_config.parallel=horovod"
            )

    def distributed(self, optimizer: torch.optim.Optimizer, passes: int):
        """optimizer as Horovod's DistributedOptimizer: gradients averaged over the ranks once
        backward has run `passes` times, each tensor named by its parameter (the names must agree
        on every rank: Horovod matches tensors across ranks by name)."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        named = [(names[id(p)], p) for group in optimizer.param_groups for p in group["params"]]
        wrapped = self.hvd.DistributedOptimizer(
            optimizer, named_parameters=named, backward_passes_per_step=passes
        )
        # Horovod 0.28.1's zero_grad takes no set_to_none (torch's callers pass it: trainer.update,
        # and torch.distributed.checkpoint when it creates optimizer state); it sets to None anyway.
        horovod_zero_grad = wrapped.zero_grad
        wrapped.zero_grad = lambda set_to_none=True: horovod_zero_grad()
        # Its step after synchronize() (reduce_gradients) must not synchronize again.
        horovod_step = wrapped.step

        def step(*args, **kwargs):
            with wrapped.skip_synchronize():
                return horovod_step(*args, **kwargs)

        wrapped.step = step
        return wrapped

    def begin_step(self, step: int, n_micro: int) -> int | None:
        for optimizer in self.optimizers:  # a resume at another world size changes accumulation
            if optimizer.backward_passes_per_step != n_micro:
                optimizer.set_backward_passes_per_step(n_micro)
        return None

    def reduce_gradients(self) -> bool:
        """The all-reduces started during the last backward; clipping needs their results."""
        for optimizer in self.optimizers:
            optimizer.synchronize()
        return True

    def without_synchronizing(self) -> AbstractContextManager:
        """step() without Horovod's all-reduce: after synchronize(), and for the optimizer state
        torch.distributed.checkpoint creates with a step at lr 0 (rank 0 alone, when saving)."""
        stack = ExitStack()
        for optimizer in self.optimizers:
            stack.enter_context(optimizer.skip_synchronize())
        return stack

    def tensor_state(self) -> dict:
        with self.without_synchronizing():
            return super().tensor_state()

    def load_tensor_state(self, state: dict) -> None:
        with self.without_synchronizing():
            super().load_tensor_state(state)
        # Every rank loaded the same snapshot; rank 0's copy is broadcast all the same, as
        # Horovod's examples do after a resume.
        self.hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        for optimizer in self.optimizers:
            self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)
