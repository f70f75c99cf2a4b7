"""parallel=none: one process, the model as it is. Also the step DDP and FSDP share.

The step every local mode takes: forward under autocast (AMP), backward with the loss scaled
for fp16 (GradScaler; a no-op otherwise), gradients unscaled before they are clipped (so the
threshold applies to the true gradients), then the optimizer step, which GradScaler skips if
fp16 gradients overflowed. DDP (ddp.py) adds the gradient all-reduce and FSDP (fsdp.py) the
sharding, each by changing how the model is wrapped and how gradient sync is switched off
between micro-steps; the rest of the step is this one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.optim import build_optimizers, own_kernels, state_tensors
from mingpt_ddp.parallel.checkpointing import apply_activation_checkpointing
from mingpt_ddp.parallel.plan import (
    AMP_DTYPES,
    autocast_attention_fp32,
    grad_scaler,
    local_bytes,
)
from mingpt_ddp.parallel.strategy import Batch, Strategy, StrategyArgs


class Single(Strategy):
    """One process: no wrapping, no communication."""

    def __init__(self, model: nn.Module, args: StrategyArgs):
        super().__init__(model, args)
        self.check(args)
        self.train_model = self.wrap(model)  # what training calls
        # Built after wrapping: under FSDP the optimizers must hold the sharded parameters.
        self.optimizers = build_optimizers(model, args.optim, self.device.type)  # [AdamW] (+ Muon)
        self.init_step_state(model, args.batch_size)

    def init_step_state(self, model: nn.Module, batch_size: int) -> None:
        """What the step keeps besides the optimizers: fp16's loss scaler, the last gradient norm,
        and attention's precision under bf16 autocast (timed here)."""
        self.scaler = grad_scaler(self.plan, self.device)
        self.last_norm = torch.zeros(())
        self.attention_fp32: bool | None = None  # None: attention is not under bf16 autocast
        self.attention_choice = self.choose_attention_precision(model, batch_size)

    @classmethod
    def check(cls, args: StrategyArgs) -> None:
        """Refuse settings this mode does not run, naming the one to change."""
        if args.ctx.world_size > 1:
            raise ConfigError(
                "trainer_config.parallel=none with several ranks would train diverging "
                "copies; use ddp or fsdp"
            )
        check_no_foreign_options(args.plan)

    def wrap(self, model: nn.Module) -> nn.Module:
        # Activation checkpointing first, then compile (torchtitan's order: AC, compile, FSDP or
        # DDP): compile then traces each checkpointed block as a region it recomputes in backward.
        self.checkpointed = apply_activation_checkpointing(
            model, self.plan.activation_checkpointing
        )
        if self.plan.compile:
            # In place (Module.compile), so parameter names do not change: no "_orig_mod." prefixes
            # in snapshots. The whole model, embeddings to loss, as one graph: inductor then fuses
            # the casts, LayerNorms and the loss between the blocks too (on a 2-core CPU 17.2 ->
            # 15.3 ms/step, blocks vs whole, gpt-micro).
            model.compile()
        return model

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
        for block in self.model.blocks.children():
            block.attn.fp32_under_autocast = fp32

    def autocasts(self) -> bool:
        """Whether forward runs under torch.autocast (modes that cast the parameters themselves do
        not)."""
        return self.plan.use_amp

    def precision_context(self) -> AbstractContextManager:
        """The forward pass's precision: autocast runs each op in the precision it assigns
        (matmuls in bf16/fp16) while parameters and optimizer state stay fp32."""
        if not self.autocasts():
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=AMP_DTYPES[self.plan.amp_dtype])

    def gradient_sync(self, sync: bool) -> AbstractContextManager:
        """Gradient accumulation: whether this micro-step's backward communicates gradients."""
        return nullcontext()

    def train_step(self, batches: Iterator[Batch], n_micro: int) -> tuple[torch.Tensor, bool]:
        loss_sum = torch.zeros((), device=self.device)
        for micro, batch in enumerate(batches):  # (x, y), or with positions (context parallel)
            with self.gradient_sync(micro == n_micro - 1), self.precision_context():
                _, loss = self.train_model(*batch)
            self.scaler.scale(loss / n_micro).backward()  # scale: a no-op unless fp16
            loss_sum += loss.detach()
        self.last_norm = self.clip_and_step()
        return loss_sum / n_micro, True

    def clip_and_step(self) -> torch.Tensor:
        """Clip the gradients and update the parameters; returns the gradient norm before
        clipping."""
        # Unscale before clipping, so the clip threshold applies to the true gradients.
        for optimizer in self.optimizers:
            self.scaler.unscale_(optimizer)
        norm = self.clip(self.args.optim.grad_clip or math.inf)  # inf: measure, do not clip
        for optimizer in self.optimizers:
            self.scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
            optimizer.zero_grad(set_to_none=True)  # free gradient memory instead of writing zeros
        self.scaler.update()
        return norm

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to max_norm by their norm over all parameters (all shards, under
        FSDP); returns that norm."""
        return torch.nn.utils.clip_grad_norm_(self.train_model.parameters(), max_norm)

    def grad_norm(self) -> float:
        norm = self.last_norm
        return float((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())

    def attention_words(self) -> str:
        return f", {self.attention_choice}" if self.attention_choice else ""

    def scales_loss(self) -> bool:
        return self.scaler.is_enabled()

    def optimizer_state_bytes(self) -> int:
        return local_bytes(state_tensors(self.optimizers))

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
        """Model and optimizer state keyed by parameter name (the same names with DDP, FSDP or
        neither, so any kind of run can load any kind of snapshot); DTensor shards under FSDP."""
        model_sd, optim_sd = get_state_dict(self.train_model, self.optimizers)  # one dict for all
        return {"model": model_sd, "optimizer": optim_sd}

    def load_tensor_state(self, state: dict) -> None:
        options = StateDictOptions(full_state_dict=self.loads_full_tensors(state))
        with own_kernels(self.optimizers):  # not the snapshot's: a tp run's may differ
            set_state_dict(
                self.train_model,
                self.optimizers,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=options,
            )

    def loads_full_tensors(self, state: dict) -> bool:
        """Whether state holds whole tensors that set_state_dict must shard (never, unsharded)."""
        return False


# The refusals of one mode's option set under another mode (shared by the modes that refuse them).
CPU_OFFLOAD_NEEDS_FSDP = (
    "trainer_config.fsdp_cpu_offload=true keeps FSDP's shards in CPU memory instead "
    "of GPU memory: it needs parallel=fsdp on GPUs; set fsdp_cpu_offload=false"
)
VIA_RANK0_NEEDS_DDP = (
    "trainer_config.grad_reduce=via_rank0 is a DDP communication hook; use parallel=ddp"
)


def check_no_foreign_options(plan) -> None:
    """Options of another mode, set where they would do nothing: refused, naming the mode."""
    if plan.cpu_offload:
        raise ConfigError(CPU_OFFLOAD_NEEDS_FSDP)
    if plan.grad_reduce == "via_rank0":
        raise ConfigError(VIA_RANK0_NEEDS_DDP)
