"""parallel=none | ddp | fsdp with any tensor, context and pipeline degrees: the layouts torch
composes on one mesh.

The grid is built once (mesh.py); the model goes through the ladder (parallelize.py), or is cut
into pipeline stages that each go through it (pipeline.py). The Trainer's step then runs over
what came out (trainer.py: step, micro_steps, update). This module holds what the step and the
rest of the run ask of that layout: the optimizers, the contexts around forward, the global-norm
clip, evaluation and sampling, and the state as plain dicts keyed by the whole model's names, so
any layout resumes any other's snapshot.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.optim import build_optimizers, check_muon_supported, state_tensors
from mingpt_ddp.parallel import state
from mingpt_ddp.parallel.clip import clip_grad_norm
from mingpt_ddp.parallel.context import local_part
from mingpt_ddp.parallel.expert import ExpertStep, check_ep
from mingpt_ddp.parallel.parallelize import parallelize
from mingpt_ddp.parallel.pipeline import Pipeline
from mingpt_ddp.parallel.plan import AMP_DTYPES, autocast_attention_fp32, grad_scaler, local_bytes
from mingpt_ddp.parallel.stages import check_microbatches
from mingpt_ddp.parallel.strategy import (
    CPU_OFFLOAD_NEEDS_FSDP,
    Batch,
    Strategy,
    StrategyArgs,
    assemble,
)
from mingpt_ddp.parallel.tensor import check_tp, heads_first, standard_order


class GridStrategy(Strategy):
    """The model spread over the grid by the ladder; the step is the Trainer's."""

    def __init__(self, model: nn.Module, args: StrategyArgs):
        super().__init__(model, args)
        self.check(args)
        self.dims = dims = args.plan.dims(self.ctx.world_size)
        check_tp(model.config, dims.tp)  # before the mesh: a one-line error, no group made
        check_ep(model.config, dims, self.plan.tensor.sequence_parallel)
        self.mesh = dims.build(self.device) if self.ctx.distributed else None
        self.order = heads_first(model.config.n_embd, dims.tp)  # QKV rows, each rank its heads'
        if dims.pp > 1:
            self.pipeline = Pipeline(model, self.mesh, dims, self.plan, self.ctx)
            self.parts, modules = self.pipeline.parts, self.pipeline.stages
            self.model = modules[0]  # its config and blocks (strategy.model's contract)
        else:
            self.parts = [parallelize(model, self.mesh, dims, self.plan, self.ctx, whole=True)]
            modules = [model]
        self.modules, self.train_model = modules, self.parts[0].module
        self.checkpointed = sum(part.checkpointed for part in self.parts)
        self.moe = ExpertStep(modules, dims, self.mesh.views if self.mesh is not None else {})
        # After the ladder: under FSDP the optimizers must hold the sharded parameters. One set
        # per module: a state dict maps each optimizer to one module's names.
        self.part_optimizers = [build_optimizers(m, args.optim, self.device.type) for m in modules]
        self.optimizers = [opt for opts in self.part_optimizers for opt in opts]
        self.scaler = grad_scaler(self.plan, self.device)
        self.last_norm = torch.zeros(())
        how = self.parts[0].data_parallel
        params = [p for m in modules for p in m.parameters()]
        self.sharded = dims.pp > 1 or any(isinstance(p, DTensor) for p in params)
        self.files = "sharded" if self.sharded else None  # DCP: every rank writes its part
        self.forward_on_all_ranks = self.sharded or how in ("fsdp", "hsdp")
        if not self.autocasts():
            self.amp_words = "{dtype} parameters (FSDP mixed precision)"
        self.attention_fp32: bool | None = None  # None: attention is not under bf16 autocast
        self.attention_choice = self.choose_attention_precision(model, args.batch_size)

    @classmethod
    def check(cls, args: StrategyArgs) -> None:
        """Refuse settings the grid does not run, naming the one to change."""
        plan, ctx = args.plan, args.ctx
        dims = plan.dims(ctx.world_size)  # refuses degrees that do not fit the world
        if plan.parallel == "none" and ctx.world_size > 1:
            raise ConfigError(
                "trainer_config.parallel=none with several ranks would train diverging "
                "copies; use ddp or fsdp"
            )
        if plan.parallel == "fsdp" and not ctx.distributed:
            raise ConfigError(
                "trainer_config.parallel=fsdp needs a process group: launch with torchrun "
                "(--nproc_per_node=1 for one process) or use parallel=ddp"
            )
        if plan.cpu_offload and (plan.parallel != "fsdp" or ctx.device.type != "cuda"):
            raise ConfigError(CPU_OFFLOAD_NEEDS_FSDP)
        if plan.grad_reduce == "via_rank0" and (
            plan.parallel != "ddp" or dims.dp < dims.world_size
        ):
            raise ConfigError(
                "trainer_config.grad_reduce=via_rank0 is a DDP communication hook over the whole "
                "world: use parallel=ddp with no tp, cp or pp"
            )
        check_layout(args, dims)

    # -------------------------------------------------------------- the step
    def begin_step(self, step: int, n_micro: int) -> int | None:
        """The MoE blocks' balance loss is scaled as the step's loss is (moe.AuxGradient): by
        1 / micro-steps (and fp16's loss scale); a pipeline's schedule divides the gradients by
        its microbatches itself, the balance loss's with them."""
        fp16 = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        self.moe.scale_balance_loss(1.0 if self.pipeline is not None else fp16 / n_micro)
        return super().begin_step(step, n_micro)

    def reduce_gradients(self) -> bool:
        self.moe.after_backward()  # mixture of experts: experts averaged, biases moved
        return True

    def step_record(self, record: dict) -> str:
        return self.moe.record(record, self.control)

    def local(self, batch: Batch) -> tuple:
        """Context parallelism: this rank's chunks of each window."""
        ring = self.parts[0].ring
        return batch if ring is None else local_part(batch, ring)

    def forward_context(self) -> AbstractContextManager:
        """autocast (where FSDP does not cast the parameters itself), and the rings sharding."""
        stack = ExitStack()
        if self.autocasts():
            dtype = AMP_DTYPES[self.plan.amp_dtype]
            stack.enter_context(torch.autocast(device_type=self.device.type, dtype=dtype))
        for part in self.parts:
            if part.ring is not None:
                stack.enter_context(part.ring.sharding())
        return stack

    def autocasts(self) -> bool:
        """autocast runs each op in the precision it assigns (matmuls in bf16/fp16) while the
        parameters stay fp32; FSDP's MixedPrecisionPolicy casts the parameters instead."""
        return self.plan.use_amp and self.parts[0].data_parallel not in ("fsdp", "hsdp")

    def gradient_sync(self, sync: bool) -> AbstractContextManager:
        """Before the last micro-step gradients only accumulate locally (DDP's no_sync, FSDP's
        set_requires_gradient_sync)."""
        module = self.train_model
        if isinstance(module, DDP):
            return nullcontext() if sync else module.no_sync()
        if self.parts[0].data_parallel in ("fsdp", "hsdp"):
            module.set_requires_gradient_sync(sync)
        return nullcontext()

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over the whole model (clip.py): local where every rank holds the
        whole gradients alike, else summed over the grid, each value counted once."""
        twice = self.pipeline.tie_gradients() if self.pipeline is not None else None
        params = [p for module in self.modules for p in module.parameters()]
        copies = self.ctx.world_size // self.dims.pp if self.sharded else 0
        return clip_grad_norm(params, max_norm, copies, twice)

    def grad_norm(self) -> float:
        norm = self.last_norm
        return float((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        if self.pipeline is None:
            return super().evaluate(batches)
        for stage in self.modules:
            stage.eval()  # no dropout
        total = torch.zeros(2, device=self.device)  # (summed loss, batches)
        with self.forward_context():
            for batch in batches:
                loss = self.pipeline.loss_of(*self.local(batch))
                if loss is not None:
                    total += torch.stack([loss, torch.ones((), device=self.device)])
        for stage in self.modules:
            stage.train()
        loss_sum, count = self.control.sum(total).tolist()
        return loss_sum / count

    def sampling_model(self) -> nn.Module | None:
        """Split layouts (tensor parallel, pipeline): collective, the whole model put together on
        rank 0 (a moment's copy of all parameters), None elsewhere. Sampling runs windows of every
        length from 1 token, which sequence parallelism cannot cut evenly."""
        if self.dims.tp == 1 and self.dims.ep == 1 and self.pipeline is None:
            return self.model  # whole, or FSDP's shards that every rank's forward gathers
        if self.pipeline is not None:
            whole = self.pipeline.whole_state(self.standard)
        else:
            whole = state.whole_model(self.train_model, self.standard, self.ctx.is_main)
        return assemble(self.model, whole, self.device) if self.ctx.is_main else None

    # ------------------------------------------------------------- in words
    def describe(self) -> tuple[str, str]:
        dims, how = self.dims, self.parts[0].data_parallel
        dp_words = self.plan.parallel
        if self.plan.grad_reduce == "via_rank0":
            dp_words += " (gradients via rank 0)"
        if how == "hsdp" and self.plan.parallel == "fsdp":
            dp_words = f"hsdp: {dims.dp_replicate} replica groups x {dims.dp_shard} shards"
        elif how == "hsdp":  # DTensor parameters: the replicas go through fully_shard
            dp_words = "ddp: replicas through fully_shard"
        split = []
        if self.pipeline is not None:
            split.append(self.pipeline.describe())
        if dims.tp > 1:
            sp = " + sequence parallel" if self.plan.tensor.sequence_parallel else ""
            split.append(f"tensor parallel {dims.tp}{sp}")
        if dims.cp > 1:
            split.append(f"context parallel {dims.cp} (ring attention)")
        if split or dims.ep > 1:
            replicas = f"{dims.dp} replica{'s' * (dims.dp > 1)} ({dp_words})"
            dp_words = " x ".join([*split, replicas])
        dp_words += self.moe.words(self.model, whole=self.pipeline is None)
        return dp_words + self.checkpointing_words(), self.precision()

    def checkpointing_words(self) -> str:
        words = super().checkpointing_words()
        if self.pipeline is None:
            return words
        blocks = sum(len(stage.blocks) for stage in self.modules)
        words = words.replace(f" of {len(self.model.blocks)} blocks)", f" of {blocks} blocks)")
        return words.replace(" blocks)", " blocks here)")

    def attention_words(self) -> str:
        return f", {self.attention_choice}" if self.attention_choice else ""

    def optimizer_state_bytes(self) -> int:
        return local_bytes(state_tensors(self.optimizers))

    # -------------------------------------------------- attention precision
    def choose_attention_precision(self, model: nn.Module, batch_size: int) -> str:
        """Under bf16 autocast attention runs in whichever precision is faster on this device:
        timed once at start by rank 0 (a few ms), so that every rank computes alike."""
        if not self.autocasts():
            return ""
        g = model.config
        shape = (batch_size, g.n_head, g.block_size, g.n_embd // g.n_head)  # (B, nh, T, hs)
        mine = autocast_attention_fp32(self.plan, self.device, shape) if self.ctx.is_main else None
        fp32, choice = self.control.gather(mine)[0]
        self.set_attention_fp32(fp32)
        return choice

    def set_attention_fp32(self, fp32: bool) -> None:
        self.attention_fp32 = fp32
        for module in self.modules:
            for block in module.blocks.children():
                block.attn.fp32_under_autocast = fp32

    # ----------------------------------------------------------- snapshots
    def standard(self, sd: dict) -> dict:
        """With tensor parallelism, the QKV rows whole and back in the standard order (a
        gather); otherwise sd as it is."""
        return standard_order(sd, self.order) if self.dims.tp > 1 else sd

    def snapshot_meta(self) -> dict:
        # fp16's loss scale, and attention's precision under bf16 autocast (timed at the start)
        return {
            **super().snapshot_meta(),
            "scaler": self.scaler.state_dict(),
            "attention_fp32": self.attention_fp32 if self.attention_choice else None,
        }

    def load_snapshot_meta(self, meta: dict) -> None:
        if meta.get("scaler"):
            self.scaler.load_state_dict(meta["scaler"])
        # The precision the run computed attention in, not this start's timing (which can come
        # out the other way on a busier or different machine): a resumed run computes as before.
        kept = meta.get("attention_fp32")
        if kept is not None and self.attention_choice:
            self.set_attention_fp32(kept)
            precision = "fp32" if kept else "bf16"
            self.attention_choice = f"attention {precision} (as the snapshot's run)"

    def tensor_state(self) -> dict:
        """Model and optimizer state keyed by the whole model's parameter names, whatever the
        layout (state.py): whole tensors, or DTensor shards that DCP writes once each."""
        return state.whole_names(self.modules, self.part_optimizers, self.standard, self.sharded)

    def read_tensors(self, snapshot) -> dict:
        if not snapshot.reshardable:
            return snapshot.tensors()  # whole tensors (one file): cut to this layout on load
        tied = self.model.config.tie_embeddings  # the head is the embedding
        return snapshot.tensors(into=state.load_target(self.tensor_state(), tied))

    def load_tensor_state(self, tensors: dict) -> None:
        state.load(self.modules, self.part_optimizers, tensors, self.order)

    def write_files(self, stage: str) -> str:
        return state.write_dcp(self.tensor_state(), stage)


def check_layout(args: StrategyArgs, dims) -> None:
    """Combinations the grid refuses, naming the key to change."""
    plan = args.plan
    if dims.pp > 1:
        check_microbatches(args.batch_size * args.accum_steps, plan.pipeline.microbatches)
        if plan.tensor.sequence_parallel:
            raise ConfigError(
                "tensor_config.sequence_parallel=true is not built with a pipeline (its stages "
                "would hand on sequence shards): set it to false, or mesh_config.pp=1"
            )
    split = dims.tp > 1 or dims.pp > 1
    if plan.use_amp and plan.amp_dtype == "fp16" and split:
        raise ConfigError(
            "fp16's GradScaler cannot unscale a mix of DTensor and whole gradients, nor run "
            "inside a pipeline's schedule: use trainer_config.amp_dtype=bf16"
        )
    if plan.compile and (dims.tp > 1 or dims.cp > 1):
        raise ConfigError(
            "trainer_config.compile=true is not built with mesh_config.tp or cp > 1 (the ring's "
            "send/recv and DTensor's collectives would break the graph): set compile=false"
        )
    if plan.parallel == "fsdp" or dims.tp > 1:
        check_muon_supported(args.optim, "fsdp" if dims.tp == 1 else f"mesh_config.tp={dims.tp}")
