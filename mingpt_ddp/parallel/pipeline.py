"""Pipeline parallelism (mesh_config.pp, alias pipeline_config.degree): torch's pipelining.

The model is cut into stages, consecutive blocks each (stages.py), one per rank of a pipeline
(or several, interleaved). Each stage goes through the same ladder as a whole model would
(parallelize.py: tensor and context parallelism, checkpointing, compile, data parallelism over its
column). Each step's batch is cut into microbatches; a schedule runs them through the stages,
activations passed forward and their gradients backward between neighbours by send/recv, so
several stages compute at once on different microbatches. GPipe runs every forward, then every
backward (it holds all microbatches' activations); 1F1B starts backwards as soon as the last stage
has a microbatch's loss (it holds at most `degree`); interleaved 1F1B puts several smaller stages
on each rank, for a smaller bubble at more hand-offs. The ranks still idle while the pipe fills
and drains, the bubble: (p - 1) / (m + p - 1) of a step for GPipe and 1F1B with p stages and m
microbatches (tutorials/pipeline_by_hand.py, whose grown-up version this is, measures it).

What one process does stays true across the stages, by three steps the engine does not take:
- the tied embedding/head matrix lives on the first and the last stage; its two gradients are
  summed between them every step (one all-reduce per replica), so both copies take the same step;
- clipping uses the global norm: each stage's squared norm, summed over the pipeline (clip.py);
- the loss exists on the last stage only: log lines and evaluation average over the ranks that
  have one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from mingpt_ddp.config.pipeline import V_SHAPED, ZERO_BUBBLE
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.parallel.mesh import ParallelDims
from mingpt_ddp.parallel.parallelize import Parallelized, parallelize
from mingpt_ddp.parallel.stages import (
    Stage,
    block_ranges,
    check_microbatches,
    cut,
    forward_through,
    placement,
    stage_ids,
)

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved1f1b": ScheduleInterleaved1F1B,
    "interleavedzb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
ONE_STAGE = (ScheduleGPipe, Schedule1F1B)  # take one stage; the others a list of a rank's


class Pipeline:
    """This rank's stages of the model, each through the ladder, and the schedule that runs them."""

    def __init__(self, model: nn.Module, mesh, dims: ParallelDims, plan, ctx):
        self.cfg = cfg = plan.pipeline
        check_schedule(plan, dims)
        me = dims.coordinates(ctx.rank)
        pp_rank = me["pp"]
        # Global ranks of this rank's row (one whole pipeline), in stage order.
        self.row = dist.get_process_group_ranks(mesh["pp"].get_group())
        self.first_of_row = all(v == 0 for k, v in me.items() if k != "pp")  # the first row
        ranges = block_ranges(model.config.n_layer, cfg.stages)
        self.rank_of = placement(cfg.degree, cfg.stages, cfg.schedule in V_SHAPED)
        self.pp_rank, self.ids = pp_rank, stage_ids(pp_rank, self.rank_of)
        last = cfg.stages - 1
        self.stages = [cut(model, ranges[i], i == 0, i == last) for i in self.ids]
        if cfg.schedule in ZERO_BUBBLE:  # FSDP keeps each block gathered until the step's end
            plan = dataclasses.replace(plan, reshard_after_forward=False)  # (check_schedule: why)
        self.plan = plan
        self.parts: list[Parallelized] = [
            parallelize(stage, mesh, dims, plan, ctx, whole=False) for stage in self.stages
        ]
        self.schedule = self.build_schedule(pp_rank, mesh["pp"].get_group(), ctx.device, model)
        self.across = dims.world_size // dims.pp  # the ranks of one stage
        self.tie_group, self.tied = self.tie_the_embeddings(model.config.tie_embeddings)

    def build_schedule(self, pp_rank: int, group, device, model):
        """torch's PipelineStage around each of this rank's stages, and the schedule over them."""
        stages = [
            Stage(part.module, i, self.cfg.stages, device, group=group, ring=part.ring)
            for part, i in zip(self.parts, self.ids)
        ]
        kind = SCHEDULES[self.cfg.schedule]
        one = stages[0] if kind in ONE_STAGE else stages
        # scale_grads: each microbatch's loss is its own mean; dividing the summed gradients by
        # the microbatch count makes them the gradient of the whole batch's mean loss.
        return kind(one, n_microbatches=self.cfg.microbatches, loss_fn=model.loss, scale_grads=True)

    def tie_the_embeddings(self, tied: bool) -> tuple[dist.ProcessGroup | None, list]:
        """The group of the first and the last stage of this row, and the copies of the tied
        matrix this rank holds. Every rank creates every row's group (new_group is collective)."""
        copies = [s.wte.weight for s in self.stages if s.wte is not None]
        copies += [s.lm_head.weight for s in self.stages if s.lm_head is not None]
        if not tied or self.rank_of[0] == self.rank_of[self.cfg.stages - 1]:
            return None, copies if tied else []  # a V: both copies here, summed here
        last = self.rank_of[self.cfg.stages - 1] * self.across
        groups = [dist.new_group([r, last + r]) for r in range(self.across)]
        mine = groups[self.row[0]] if self.has_first or self.has_last else None
        return mine, copies

    @property
    def has_first(self) -> bool:
        return self.ids[0] == 0

    @property
    def has_last(self) -> bool:
        return self.ids[-1] == self.cfg.stages - 1

    def step(self, batches: Iterator[tuple]) -> torch.Tensor | None:
        """Every microbatch's forward and backward through the row; the step's mean loss on the
        last stage, None on the others. The micro-batches are put together, then the schedule
        cuts them into its microbatches."""
        x, y = (torch.cat(parts) for parts in zip(*batches))  # (n_micro * B, T) each
        check_microbatches(x.size(0), self.cfg.microbatches)  # a resume may change n_micro
        losses: list[torch.Tensor] = []
        inputs = (x,) if self.has_first else ()  # token ids on the first stage, nothing after
        self.schedule.step(*inputs, target=y if self.has_last else None, losses=losses)
        if not losses:
            return None  # not the last stage: no loss here
        return torch.stack(losses).detach().mean()  # equal microbatches: the batch's mean

    def tie_gradients(self):
        """Sum the tied matrix's two gradients (first and last stage), so both copies take the
        same step; returns the copy the global norm must not count again (the head), or None."""
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.tied]
        if self.tie_group is not None:
            for grad in local:
                dist.all_reduce(grad, group=self.tie_group)
        elif len(local) == 2:  # a V: the embedding's and the head's gradients both here
            local[0].add_(local[1])
            local[1].copy_(local[0])
        return self.stages[-1].lm_head.weight if self.tied and self.has_last else None

    def loss_of(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Collective over the row: the loss of one batch by a plain forward through the stages
        (any batch shape; the schedule's microbatches are fixed at their training shape), on the
        last stage; None elsewhere."""
        logits = forward_through(self.stages, self.ids, self.row, x, self.rank_of)
        return None if logits is None else self.stages[-1].loss(logits, y)

    def whole_state(self, standard) -> dict | None:
        """Collective: the whole model's state dict on rank 0 (every stage of the first row, whole
        tensors; standard: puts the QKV rows in their order), None elsewhere."""
        pieces = {}
        for stage in self.stages:  # full tensors are gathered over dp and tp: all take part
            full = get_model_state_dict(stage, options=StateDictOptions(full_state_dict=True))
            full = standard(full)
            pieces.update({k: v.cpu() for k, v in full.items()} if self.first_of_row else {})
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(pieces, gathered, dst=0)
        return {k: v for part in gathered for k, v in part.items()} if gathered else None

    def describe(self) -> str:
        cfg = self.cfg
        return f"pipeline {cfg.stages} stages ({cfg.schedule}, {cfg.microbatches} microbatches)"


def check_schedule(plan, dims: ParallelDims) -> None:
    """Refuse what the zero-bubble schedules cannot run, naming the key to change.

    Their split backward (stage_backward_input, then _weight: plain autograd.grad) never reaches
    DDP's reducer (pytorch issue 144530): DDP replicas would not average. FSDP's reduction is
    one of the schedule's own actions (REDUCE_GRAD, after a stage's last weight gradient) and
    works, provided FSDP keeps each block gathered from forward to that reduction: the input
    half finds the weights by the parameters registered at that moment, which a block resharded
    after forward has swapped for its shards, so its weight gradients were never computed
    (measured: the last stage's block reduced no gradient, replicas 2e-3 off one process in 6
    steps). Pipeline.__init__ therefore turns reshard_after_forward off for these schedules
    (torchtitan's default under any pipeline), at the memory of one stage's gathered blocks."""
    schedule = plan.pipeline.schedule
    if schedule not in ZERO_BUBBLE:
        return
    if dims.dp * dims.cp > 1 and plan.parallel != "fsdp":
        raise ConfigError(
            f"pipeline_config.schedule={schedule} splits backward past DDP's gradient "
            "reduction: replicas would not average; set trainer_config.parallel=fsdp, or use "
            "schedule=1f1b or interleaved1f1b with DDP replicas"
        )
    if plan.compile:
        raise ConfigError(
            f"pipeline_config.schedule={schedule} splits backward, which torch.compile does not "
            "support: set trainer_config.compile=false"
        )
