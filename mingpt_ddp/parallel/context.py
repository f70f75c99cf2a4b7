"""context_config.degree > 1: context parallelism (ring attention over sequence shards) x DDP.

The ranks of a context-parallel group read the same windows and each computes 2 of every
window's 2 x degree chunks of tokens (ring.balanced_positions), with their true positions for
the position embeddings (learned or rotary). Everything in a transformer but attention works on
each token alone, so only attention talks: its keys and values travel around the group's ring
(ring.py). Activations per rank fall as 1/degree, the way to train on windows too long for one
device's memory.

Every rank holds the whole model, so the parameters' gradients are averaged over every rank:
DDP over the whole world (dp x cp). Each rank's loss is the mean over its own tokens, all ranks
hold as many, so the average of their gradients is the gradient of the whole batch's mean loss.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.parallel.ddp import DDPStrategy
from mingpt_ddp.parallel.plan import mesh_shape
from mingpt_ddp.parallel.ring import RingAttention
from mingpt_ddp.parallel.strategy import Batch, StrategyArgs


class ContextParallelStrategy(DDPStrategy):
    """DDP's step on this rank's chunks of every window, attention through the ring."""

    def __init__(self, model: nn.Module, args: StrategyArgs):
        self.check(args)  # before any group is made
        shape = mesh_shape(args.ctx.world_size, args.plan)
        self.mesh = init_device_mesh(
            args.ctx.device.type, (shape["dp"], shape["cp"]), mesh_dim_names=("dp", "cp")
        )
        self.ring = RingAttention(self.mesh.get_group("cp"), model.blocks[0].attn.attend)
        super().__init__(model, args)

    @classmethod
    def check(cls, args: StrategyArgs) -> None:
        super().check(args)
        if args.plan.parallel != "ddp" or args.plan.grad_reduce != "all_reduce":
            raise ConfigError(
                "context_config.degree > 1 averages the gradients with DDP over every rank, not "
                f"parallel={args.plan.parallel} (grad_reduce={args.plan.grad_reduce}): set "
                "trainer_config.parallel=ddp and grad_reduce=all_reduce"
            )
        if args.plan.compile:
            raise ConfigError(
                "trainer_config.compile=true is not built with context_config.degree > 1 (the "
                "ring's send/recv would break the graph at every block): set compile=false"
            )

    def wrap(self, model: nn.Module) -> nn.Module:
        cfg, degree = model.config, self.mesh["cp"].size()
        if cfg.block_size % (2 * degree):
            raise ConfigError(
                f"context_config.degree={degree} cuts each window into {2 * degree} chunks: "
                f"data_config.block_size={cfg.block_size} must be a multiple of {2 * degree}"
            )
        if cfg.attn_dropout:
            raise ConfigError(
                "ring attention has no attention dropout: set gpt_config.attn_dropout=0 with "
                "context_config.degree > 1"
            )
        for block in model.blocks.children():
            block.attn.attend = self.ring
        return super().wrap(model)

    def local_part(self, batch: Batch) -> tuple:
        """This rank's chunks of each window, and their positions: (x, y, positions)."""
        x, y = batch
        positions = self.ring.positions(
            x.size(1) // self.mesh["cp"].size(), self.ring.index, x.device
        )
        return x[:, positions], y[:, positions], positions  # (B, T / cp) each, (T / cp,)

    def train_step(
        self, batches: Iterator[Batch], n_micro: int
    ) -> tuple[torch.Tensor | None, bool]:
        with self.ring.sharding():
            return super().train_step(map(self.local_part, batches), n_micro)

    @torch.no_grad()
    def evaluate(self, batches: Iterator[Batch]) -> float:
        with self.ring.sharding():
            return super().evaluate(map(self.local_part, batches))

    def describe(self) -> tuple[str, str]:
        cp, dp = self.mesh["cp"].size(), self.mesh["dp"].size()
        mode = f"context parallel {cp} (ring attention) x {dp} replica{'s' if dp > 1 else ''} (ddp)"
        return mode + self.checkpointing_words(), self.precision()
