"""parallel=fsdp: FSDP2 (`fully_shard`), every rank holding 1/N of each parameter.

Every rank holds 1/N of each parameter, gradient and optimizer state (DTensor shards). Before a
block runs forward or backward its parameters are all-gathered, and afterwards freed again;
gradients are reduce-scattered, so each rank keeps only its shard. Memory per rank falls
roughly as 1/N, for more communication. Mixed precision is a MixedPrecisionPolicy: whole blocks
compute on bf16/fp16 copies of the parameters over fp32 shards, so there is no autocast.

Snapshots are DCP shards (torch.distributed.checkpoint): every rank writes its own, in
parallel, and DCP reshards on load, so a snapshot resumes at any world size and under any mode.
"""

from __future__ import annotations

import os
import re
import tempfile
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.optim import check_muon_supported
from mingpt_ddp.parallel.checkpointing import apply_activation_checkpointing
from mingpt_ddp.parallel.plan import AMP_DTYPES
from mingpt_ddp.parallel.single import CPU_OFFLOAD_NEEDS_FSDP, VIA_RANK0_NEEDS_DDP, Single
from mingpt_ddp.parallel.strategy import StrategyArgs
from mingpt_ddp.snapshots.layout import FileLayout


def _full_tensors(folder: str) -> dict:
    """The shards put back together on the CPU, without a process group (DCP's own converter).
    The whole file goes to a folder of this process's: the staged one may be a node's, shared."""
    with tempfile.TemporaryDirectory(prefix="dcp-full-") as scratch:
        full = os.path.join(scratch, "full.pt")
        dcp_to_torch_save(folder, full)
        return torch.load(full, map_location="cpu", weights_only=True)


def _load_into(folder: str, state: dict) -> dict:
    """Collective: DCP reads the shards each rank needs for its own layout (resharding)."""
    dcp.load(state, storage_reader=dcp.FileSystemReader(folder))
    return state


DCP_FILES = FileLayout(
    kind="sharded",
    extension="dcp",
    file_names=re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$"),
    full_tensors=_full_tensors,
    load_into=_load_into,
)


def shard(module: nn.Module, mesh, plan, root: bool = False) -> None:
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
    )


def shard_model(model: nn.Module, mesh, plan) -> None:
    """Shard in place, block by block, then the root (embeddings, final norm, head: what remains):
    each block's parameters are gathered just before it runs and freed after."""
    for block in model.blocks.children():
        shard(block, mesh, plan)
    shard(model, mesh, plan, root=True)


def write_dcp(state: dict, folder: str) -> str:
    """Collective: every rank writes its shards (its own keys, or its part of a DTensor) of
    state into folder; a tensor several ranks hold alike is written once."""
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder))
    return folder


class FSDPStrategy(Single):
    """The local step of single.py over sharded parameters, with FSDP's gathers and reductions."""

    layout = DCP_FILES
    forward_on_all_ranks = True  # every forward all-gathers parameters: every rank takes part
    amp_words = "{dtype} parameters (FSDP mixed precision)"

    @classmethod
    def check(cls, args: StrategyArgs) -> None:
        if not args.ctx.distributed:
            raise ConfigError(
                "trainer_config.parallel=fsdp needs a process group: launch with torchrun "
                "(--nproc_per_node=1 for one process) or use parallel=ddp"
            )
        if args.plan.cpu_offload and args.ctx.device.type != "cuda":
            raise ConfigError(CPU_OFFLOAD_NEEDS_FSDP)
        if args.plan.grad_reduce == "via_rank0":
            raise ConfigError(VIA_RANK0_NEEDS_DDP)
        check_muon_supported(args.optim, "fsdp")

    def wrap(self, model: nn.Module) -> nn.Module:
        """Checkpointing and compile as asked, then sharded in place (shard_model)."""
        plan = self.plan
        # Activation checkpointing, then compile, then sharding (torchtitan's order): FSDP's hooks
        # sit on each block's __call__, outside the checkpointed forward, so the parameters are
        # gathered before backward recomputes the block.
        self.checkpointed = apply_activation_checkpointing(model, plan.activation_checkpointing)
        if plan.compile:  # block by block (torchtitan's way): each block is a unit FSDP gathers
            for block in model.blocks:
                block.compile()
        # The mesh on this rank's own device: left out, fully_shard builds one on whatever
        # accelerator torch finds, so trainer_config.device=cpu on a GPU host would put the shards
        # on cuda:LOCAL_RANK behind a gloo-only group.
        shard_model(model, init_device_mesh(self.device.type, (self.ctx.world_size,)), plan)
        return model

    def autocasts(self) -> bool:
        return False  # the MixedPrecisionPolicy casts the parameters

    def gradient_sync(self, sync: bool) -> AbstractContextManager:
        """Before the last micro-step gradients only accumulate (FSDP's
        set_requires_gradient_sync)."""
        self.train_model.set_requires_gradient_sync(sync)
        return nullcontext()

    def loads_full_tensors(self, state: dict) -> bool:
        # A single-file snapshot holds full tensors; a DCP one was loaded into our own layout.
        return not isinstance(next(iter(state["model"].values())), DTensor)

    def read_tensors(self, snapshot) -> dict:
        return snapshot.tensors(into=self.tensor_state() if snapshot.reshardable else None)

    def write_files(self, stage: str) -> str:
        return write_dcp(self.tensor_state(), stage)
