"""pipeline_config.degree > 1: pipeline parallelism (torch.distributed.pipelining) x data parallel.

The model is cut into stages, consecutive blocks each (stages.py), one per rank of a pipeline
(or several, interleaved). Each step's batch is cut into microbatches; a schedule runs them
through the stages, activations passed forward and their gradients backward between neighbours
by send/recv, so several stages compute at once on different microbatches. GPipe runs every
forward, then every backward (it holds all microbatches' activations); 1F1B starts backwards as
soon as the last stage has a microbatch's loss (it holds at most `degree`); interleaved 1F1B puts
several smaller stages on each rank, for a smaller bubble at more hand-offs. The ranks still
idle while the pipe fills and drains, the bubble: (p - 1) / (m + p - 1) of a step for GPipe and
1F1B with p stages and m microbatches (tutorials/pipeline_by_hand.py measures it).

Replicas of the whole pipeline run side by side (the notes' DDP+MP): each stage's column of
ranks averages its gradients over DDP or FSDP (trainer_config.parallel) on the mesh's "dp"
dimension; torch's PipelineStage switches their gradient sync on for the last microbatch only.

What one process does stays true across the stages, by three steps the engine does not take:
- the tied embedding/head matrix lives on the first and the last stage; its two gradients are
  summed between them every step (one all-reduce per replica), so both copies take the same step;
- clipping uses the global norm: each stage's squared norm, summed over the pipeline;
- the loss exists on the last stage only: log lines and evaluation average over the ranks that
  have one.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt_ddp.errors import ConfigError, SnapshotMismatch
from mingpt_ddp.optim import build_optimizers, check_muon_supported, own_kernels
from mingpt_ddp.parallel.checkpointing import apply_activation_checkpointing, checkpointing_words
from mingpt_ddp.parallel.fsdp import shard_model, write_dcp
from mingpt_ddp.parallel.plan import coordinates, mesh_shape
from mingpt_ddp.parallel.single import Single, check_no_foreign_options
from mingpt_ddp.parallel.stages import (
    FLAT,
    PIPELINE_FILES,
    Stage,
    block_ranges,
    check_microbatches,
    cut,
    forward_through,
    stage_ids,
)
from mingpt_ddp.parallel.strategy import Batch, Strategy, StrategyArgs, assemble
from mingpt_ddp.parallel.tensor import (
    TensorParallelStrategy,
    clip_by,
    global_norm,
    heads_first,
    parallelize,
    standard_order,
    to_layout,
)

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved1f1b": ScheduleInterleaved1F1B,
}


class PipelineStrategy(Single):
    """This rank's stages of the model, run by a torch.distributed.pipelining schedule."""

    layout = PIPELINE_FILES
    forward_on_all_ranks = True  # every stage takes part in every forward

    def __init__(self, model: nn.Module, args: StrategyArgs):
        Strategy.__init__(self, model, args)
        self.check(args)
        self.cfg = cfg = args.plan.pipeline
        shape = mesh_shape(self.ctx.world_size, args.plan)
        me = coordinates(self.ctx.rank, shape)
        self.pp_rank, self.dp_rank, self.tp_rank = me["pp"], me["dp"], me["tp"]
        dp, tp = shape["dp"], shape["tp"]
        self.mesh = init_device_mesh(
            self.device.type, (cfg.degree, dp, tp), mesh_dim_names=("pp", "dp", "tp")
        )
        self.order = heads_first(model.config.n_embd, tp)
        # Global ranks of this rank's row (one whole pipeline: its replica, its tp index), in
        # stage order.
        self.row = [(q * dp + self.dp_rank) * tp + self.tp_rank for q in range(cfg.degree)]
        ranges = block_ranges(model.config.n_layer, cfg.stages)
        self.ids = stage_ids(self.pp_rank, cfg.degree, cfg.stages)
        last = cfg.stages - 1
        self.stages = [cut(model, ranges[i], i == 0, i == last) for i in self.ids]
        self.model = self.stages[0]  # its config and blocks (strategy.model's contract)
        wrapped = [self.wrap(stage) for stage in self.stages]
        self.schedule = self.build_schedule(wrapped, model.loss)
        # One optimizer per stage: a state dict maps each optimizer to one module's names.
        self.stage_optimizers = [
            build_optimizers(s, args.optim, self.device.type) for s in self.stages
        ]
        self.optimizers = [opt for opts in self.stage_optimizers for opt in opts]
        self.tie_group, self.tied = self.tie_the_embeddings(model.config.tie_embeddings)
        self.init_step_state(model, args.batch_size)  # its scaler is off: fp16 is refused

    @classmethod
    def check(cls, args: StrategyArgs) -> None:
        plan = args.plan
        check_microbatches(args.batch_size * args.accum_steps, plan.pipeline.microbatches)
        if plan.parallel not in ("ddp", "fsdp"):
            raise ConfigError(
                f"pipeline_config.degree > 1 runs its replicas over ddp or fsdp, not "
                f"parallel={plan.parallel} (ZeRO's partitions would have to follow the stages); "
                "set trainer_config.parallel=ddp or fsdp"
            )
        check_no_foreign_options(plan)
        if plan.use_amp and plan.amp_dtype == "fp16":
            raise ConfigError(
                "fp16 under a pipeline would need its loss scale inside the schedule; use "
                "trainer_config.amp_dtype=bf16 (no scaling needed) or use_amp=false"
            )
        if plan.parallel == "fsdp":
            check_muon_supported(args.optim, "fsdp")  # with ddp, Muon sees whole matrices
        if plan.tensor.degree > 1:
            TensorParallelStrategy.check(args)
        if plan.tensor.sequence_parallel:
            raise ConfigError(
                "tensor_config.sequence_parallel=true is not built with a pipeline (its stages "
                "would hand on sequence shards): set it to false, or pipeline_config.degree=1"
            )

    # ---------------------------------------------------------------- building
    def wrap(self, stage: nn.Module) -> nn.Module:
        """Tensor parallelism, activation checkpointing, compile, then the data-parallel wrapper
        over this stage's column (torchtitan's order)."""
        if self.mesh["tp"].size() > 1:
            parallelize(stage, self.mesh["tp"], sequence_parallel=False)
        self.checkpointed += apply_activation_checkpointing(
            stage, self.plan.activation_checkpointing
        )
        if self.plan.compile:  # block by block: a stage's ends differ (ids in, logits out)
            for block in stage.blocks.children():
                block.compile()
        if self.plan.parallel == "fsdp":
            shard_model(stage, self.mesh["dp"], self.plan)
            return stage
        if self.mesh["dp"].size() == 1:
            return stage  # one replica: nothing to average
        ids = [self.ctx.local_rank] if self.device.type == "cuda" else None
        return DDP(stage, device_ids=ids, process_group=self.mesh.get_group("dp"))

    def build_schedule(self, wrapped: list[nn.Module], loss_fn):
        """torch's PipelineStage around each of this rank's stages, and the schedule over them."""
        pp_group = self.mesh.get_group("pp")
        stages = [
            Stage(module, i, self.cfg.stages, self.device, group=pp_group)
            for module, i in zip(wrapped, self.ids)
        ]
        kind = SCHEDULES[self.cfg.schedule]
        one = stages if kind is ScheduleInterleaved1F1B else stages[0]
        # scale_grads: each microbatch's loss is its own mean; dividing the summed gradients by
        # the microbatch count makes them the gradient of the whole batch's mean loss.
        return kind(one, n_microbatches=self.cfg.microbatches, loss_fn=loss_fn, scale_grads=True)

    def tie_the_embeddings(self, tied: bool) -> tuple[dist.ProcessGroup | None, list]:
        """The group of the first and the last stage of this row, and the copies of the tied
        matrix this rank holds. Every rank creates every row's group (new_group is collective)."""
        if not tied:
            return None, []
        across = self.mesh["dp"].size() * self.mesh["tp"].size()  # ranks of one stage
        last = (self.cfg.degree - 1) * across
        groups = [dist.new_group([r, last + r]) for r in range(across)]
        mine = groups[self.row[0]] if self.has_first or self.has_last else None
        copies = [s.wte.weight for s in self.stages if s.wte is not None]
        copies += [s.lm_head.weight for s in self.stages if s.lm_head is not None]
        return mine, copies

    @property
    def has_first(self) -> bool:
        return self.ids[0] == 0

    @property
    def has_last(self) -> bool:
        return self.ids[-1] == self.cfg.stages - 1

    # ---------------------------------------------------------------- the step
    def train_step(
        self, batches: Iterator[Batch], n_micro: int
    ) -> tuple[torch.Tensor | None, bool]:
        x, y = (torch.cat(parts) for parts in zip(*batches))  # (n_micro * B, T) each
        check_microbatches(x.size(0), self.cfg.microbatches)  # again: a resume may change n_micro
        losses: list[torch.Tensor] = []
        with self.precision_context():
            self.schedule.step(*self.inputs(x), target=y if self.has_last else None, losses=losses)
        self.last_norm = self.clip_and_step()
        if not losses:
            return None, True  # not the last stage: no loss here
        return torch.stack(losses).detach().mean(), True  # equal microbatches: the batch's mean

    def inputs(self, x: torch.Tensor) -> tuple:
        """What this rank hands the schedule: the token ids on the first stage, nothing after."""
        return (x,) if self.has_first else ()

    def clip(self, max_norm: float) -> torch.Tensor:
        """Sum the tied matrix's two gradients, then clip by the norm over the whole pipeline
        (Single.clip_and_step steps the optimizers after)."""
        if self.tie_group is not None:
            for p in self.tied:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(grad, group=self.tie_group)
        params = [p for stage in self.stages for p in stage.parameters() if p.grad is not None]
        # The tied matrix counts once in the norm (on the first stage), as in the whole model.
        twice = self.stages[-1].lm_head.weight if self.tied and self.has_last else None
        across = self.mesh["dp"].size() * self.mesh["tp"].size()  # the ranks of one stage
        norm = global_norm([p for p in params if p is not twice], plain_copies=across)
        clip_by(params, max_norm, norm)
        return norm

    # -------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, batches: Iterator[Batch]) -> float:
        """The mean loss over the batches: a plain forward through the row's stages (any batch
        shape; the schedule's microbatches are fixed at their training shape), the last stage's
        loss averaged over the replicas."""
        for stage in self.stages:
            stage.eval()  # no dropout
        total = torch.zeros(2, device=self.device)  # (summed loss, batches)
        for x, y in batches:
            with self.precision_context():
                logits = forward_through(self.stages, self.ids, self.row, x, self.cfg.stages)
            if logits is not None:
                total += torch.stack(
                    [self.model.loss(logits, y), torch.ones((), device=self.device)]
                )
        for stage in self.stages:
            stage.train()
        loss_sum, count = self.control.sum(total).tolist()
        return loss_sum / count

    def sampling_model(self) -> nn.Module | None:
        """Collective: the whole model put together on rank 0 from every stage of replica 0
        (a moment's copy of all parameters, for the eval line's sample); None on other ranks."""
        pieces, first = {}, self.dp_rank == 0 and self.tp_rank == 0
        for stage in self.stages:  # full tensors are gathered over dp and tp: all take part
            full = get_model_state_dict(stage, options=StateDictOptions(full_state_dict=True))
            full = self.standard(full)
            pieces.update({k: v.cpu() for k, v in full.items()} if first else {})
        gathered = [None] * self.ctx.world_size if self.ctx.is_main else None
        dist.gather_object(pieces, gathered, dst=0)
        if not self.ctx.is_main:
            return None
        return assemble(
            self.model, {k: v for part in gathered for k, v in part.items()}, self.device
        )

    # ------------------------------------------------------------- in words
    def describe(self) -> tuple[str, str]:
        cfg, dp, tp = self.cfg, self.mesh["dp"].size(), self.mesh["tp"].size()
        mode = (
            f"pipeline {cfg.stages} stages ({cfg.schedule}, {cfg.microbatches} microbatches)"
            f"{f' x tensor parallel {tp}' if tp > 1 else ''} x "
            f"{dp} replica{'s' if dp > 1 else ''} ({self.plan.parallel})"
        )
        return mode + self.checkpointing_words(), self.precision()

    def checkpointing_words(self) -> str:
        blocks = sum(len(stage.blocks) for stage in self.stages)
        return checkpointing_words(self.checkpointed, blocks).replace(" blocks)", " blocks here)")

    def set_attention_fp32(self, fp32: bool) -> None:
        self.attention_fp32 = fp32
        for stage in self.stages:
            for block in stage.blocks.children():
                block.attn.fp32_under_autocast = fp32

    def autocasts(self) -> bool:
        return self.plan.use_amp and self.plan.parallel != "fsdp"  # FSDP casts the parameters

    # ----------------------------------------------------------- snapshots
    def snapshot_meta(self) -> dict:
        cfg = self.cfg
        pipeline = {"degree": cfg.degree, "stages": cfg.stages, "schedule": cfg.schedule}
        return {**super().snapshot_meta(), "pipeline": pipeline}

    def check_snapshot(self, snapshot, where: str) -> None:
        if snapshot.layout is not PIPELINE_FILES:
            raise SnapshotMismatch(
                f"{where} was written without a pipeline; a pipeline resumes only a pipeline's "
                "snapshots: launch it without pipeline_config.degree, or start a new "
                "trainer_config.run_dir"
            )

    def tensor_state(self) -> dict:
        """Every stage's model and optimizer state, keyed by the whole model's names."""
        model, optim = {}, {}
        for stage, optimizers in zip(self.stages, self.stage_optimizers):
            stage_model, stage_optim = get_state_dict(stage, optimizers, options=FLAT)
            model.update(self.standard(stage_model))
            optim.update(self.standard(stage_optim))
        return {"model": model, "optimizer": optim}

    def standard(self, state: dict) -> dict:
        """With tensor-parallel stages, the QKV rows whole and back in the standard order
        (tensor.standard_order: a gather); without, state as it is."""
        return standard_order(state, self.order) if self.mesh["tp"].size() > 1 else state

    def read_tensors(self, snapshot) -> dict:
        return snapshot.tensors(into=self.tensor_state())  # DCP reads the keys this rank holds

    def load_tensor_state(self, state: dict) -> None:
        for stage, optimizers in zip(self.stages, self.stage_optimizers):
            model, optim = get_state_dict(stage, optimizers, options=FLAT)
            wholes = (state["model"], state["optimizer"])
            mine = [{k: whole[k] for k in d} for whole, d in zip(wholes, (model, optim))]
            with own_kernels(optimizers):
                set_state_dict(
                    stage,
                    optimizers,
                    model_state_dict=to_layout(mine[0], model, self.order),
                    optim_state_dict=to_layout(mine[1], optim, self.order),
                    options=FLAT,
                )

    def write_files(self, stage: str) -> str:
        return write_dcp(self.tensor_state(), stage)
