"""DeepSpeed ZeRO as a parallel mode: trainer_config.parallel=deepspeed
(pip install -e ".[deepspeed]").

DDP keeps a whole copy of everything on every rank: parameters, gradients and the optimizer
state (AdamW: two fp32 numbers per parameter, plus an fp32 master copy under bf16). ZeRO, the
Zero Redundancy Optimizer, removes that redundancy in stages:

    stage 1  the optimizer state is split over the ranks: each updates 1/N of the parameters,
             then the updated parameters are all-gathered
    stage 2  + the gradients: reduce-scattered (each rank keeps the 1/N it updates), not all-reduced
    stage 3  + the parameters themselves, gathered module by module for forward and backward:
             what FSDP (parallel=fsdp) does inside PyTorch

Optimizer state per rank shrinks as 1/N from stage 1 on (tests/test_deepspeed.py measures it).
DeepSpeed's engine does what single.py's step does by hand: the backward pass (scaled for
gradient accumulation), gradient reduction, clipping and the optimizer step. Everything else
(data order, schedule, evaluation cadence, metrics, signals, snapshots) is the Trainer's.

Snapshots: one format for every layout (state.py). The engine's state goes in and out by the
whole model's parameter names through deepspeed.utils (zero_state.py), written by rank 0 as one
file, like DDP's: any layout resumes a ZeRO run's snapshot, and a ZeRO run of any stage and world
size resumes any layout's. Snapshots written by DeepSpeed's own save_checkpoint before (the
"deepspeed" layout, per-rank partitions) still resume here at the stage and world size that wrote
them; `python -m mingpt_ddp.snapshots consolidate` turns one into a single fp32 file.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from mingpt_ddp.config.deepspeed import DeepSpeedConfig
from mingpt_ddp.errors import ConfigError, SnapshotMismatch
from mingpt_ddp.optim import build_optimizers, check_muon_supported, state_tensors
from mingpt_ddp.parallel import zero_state
from mingpt_ddp.parallel.checkpointing import apply_activation_checkpointing
from mingpt_ddp.parallel.plan import local_bytes
from mingpt_ddp.parallel.state import load_target
from mingpt_ddp.parallel.strategy import (
    Batch,
    Strategy,
    StrategyArgs,
    check_no_foreign_options,
)
from mingpt_ddp.runtime.distributed import print0

# DeepSpeed's checkpoint tag: the sub-directory of the staging directory its files go in (the
# same name as the snapshot layout's subdir, mingpt_ddp/snapshots/layouts.py's DEEPSPEED_TAG).
TAG = "zero"
# What DeepSpeed's DynamicLossScaler changes as it runs (deepspeed/runtime/fp16/loss_scaler.py).
SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def import_deepspeed(device: torch.device):
    """DeepSpeed, told which accelerator to use (it would otherwise guess from what is installed,
    and pick the GPU for a trainer_config.device=cpu run), with its INFO logging on every rank
    off."""
    os.environ.setdefault("DS_ACCELERATOR", device.type)
    try:
        import deepspeed
    except ImportError:
        raise ConfigError(
            'trainer_config.parallel=deepspeed needs DeepSpeed: pip install -e ".[deepspeed]" '
            "(or use parallel=ddp or fsdp)"
        ) from None
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    # DeepSpeed calls all_gather_into_tensor and reduce_scatter_tensor, which torch now warns about
    # every call.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    return deepspeed


def engine_config(
    ds: DeepSpeedConfig,
    batch_size: int,
    accum_steps: int,
    world_size: int,
    grad_clip: float,
    amp_dtype: str | None,
) -> dict[str, Any]:
    """The JSON-like dict DeepSpeed reads: what this project's config says, in DeepSpeed's words."""
    offload = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": batch_size,  # "per gpu" means per rank
        "gradient_accumulation_steps": accum_steps,
        "train_batch_size": batch_size * accum_steps * world_size,
        "gradient_clipping": grad_clip,  # 0: off
        "zero_optimization": {
            "stage": ds.zero_stage,
            **({"offload_optimizer": offload} if ds.offload_optimizer else {}),
            **({"offload_param": offload} if ds.offload_params else {}),
        },
        "bf16": {"enabled": amp_dtype == "bf16"},
        "fp16": {"enabled": amp_dtype == "fp16"},  # DeepSpeed's own dynamic loss scaling
        # The Trainer's torch AdamW, not DeepSpeed's fused or CPU Adam (those are compiled on first
        # use).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # the Trainer logs
        "wall_clock_breakdown": False,
    }


class DeepSpeedStrategy(Strategy):
    """DeepSpeed's engine as a parallel mode: it wraps the model and owns the whole step."""

    old_files = "deepspeed"  # the engine's own files, as DeepSpeed snapshots were written before
    amp_words = "{dtype} parameters, fp32 master weights (DeepSpeed)"

    def __init__(self, model: nn.Module, args: StrategyArgs):
        super().__init__(model, args)
        self.cfg = ds = args.deepspeed
        self.check(args)
        # Before the engine wraps the model (its hooks then stay outside the checkpointed blocks).
        self.checkpointed = apply_activation_checkpointing(
            model, self.plan.activation_checkpointing
        )
        self.optimizers = build_optimizers(model, args.optim, self.device.type)  # [AdamW]
        # What snapshots need of the model before ZeRO flattens (and under stage 3 partitions) it:
        # each group's parameter names, each parameter's shape.
        names = {id(p): name for name, p in model.named_parameters()}
        self.groups = [[names[id(p)] for p in g["params"]] for g in self.optimizers[0].param_groups]
        self.shapes = {name: p.shape for name, p in model.named_parameters()}
        deepspeed = import_deepspeed(self.device)
        amp = self.plan.amp_dtype if self.plan.use_amp else None
        config = engine_config(
            ds, args.batch_size, args.accum_steps, self.ctx.world_size, args.optim.grad_clip, amp
        )
        t0 = time.perf_counter()
        # The process group is already up (runtime/distributed.py); DeepSpeed uses it. The
        # optimizer's param_groups stay ours: setting group["lr"] each step still sets the schedule.
        # On its first use on a machine DeepSpeed compiles a small shared-memory op (cached after),
        # and every rank prints that it did: its prints are kept out of the job's log.
        with contextlib.redirect_stdout(io.StringIO()):
            self.engine, _, _, _ = deepspeed.initialize(
                model=model, optimizer=self.optimizers[0], config=config, dist_init_required=False
            )
        print0(f"deepspeed | ZeRO-{ds.zero_stage} engine ready in {time.perf_counter() - t0:.1f} s")
        # Every rank must run every forward when each holds only part of the parameters.
        self.forward_on_all_ranks = ds.zero_stage == 3
        self.own_step = self.engine_step  # the Trainer's step hands it the micro-batches

    @classmethod
    def check(cls, args: StrategyArgs) -> None:
        check_no_foreign_options(args.plan)
        check_muon_supported(args.optim, "deepspeed")
        if any(degree > 1 for degree in args.plan.degrees().values()):
            raise ConfigError(
                "parallel=deepspeed runs ZeRO's data parallelism alone: set mesh_config.tp, cp "
                "and pp to 1 (or use parallel=ddp or fsdp for a split model)"
            )
        if not args.ctx.distributed:
            raise ConfigError(
                "trainer_config.parallel=deepspeed needs a process group: launch with torchrun "
                "or the deepspeed launcher (--nproc_per_node=1 for one process)"
            )
        if args.plan.compile:
            raise ConfigError(
                "trainer_config.compile=true is not tried with parallel=deepspeed here; "
                "set compile=false"
            )
        if args.plan.use_amp and args.plan.amp_dtype == "fp16" and args.ctx.device.type != "cuda":
            raise ConfigError(
                "DeepSpeed's fp16 (with its loss scaler) is for GPUs; on CPUs use "
                "trainer_config.amp_dtype=bf16"
            )

    def begin_step(self, step: int, n_micro: int) -> None:
        """A run resumed at another world size keeps its global batch with more or fewer
        micro-steps per step (TrainState): the engine is told, or it would update after each of
        the micro-steps it was built for."""
        if self.engine.gradient_accumulation_steps() != n_micro:
            self.engine.set_train_batch_size(self.args.batch_size * n_micro * self.ctx.world_size)
        return None

    def engine_step(self, batches: Iterator[Batch], n_micro: int) -> tuple[torch.Tensor, bool]:
        """The engine divides each micro-step's loss by the accumulation steps and counts them: its
        step() reduces gradients, clips and updates only after the last."""
        loss_sum = torch.zeros((), device=self.device)
        for x, y in batches:
            _, loss = self.engine(x, y)  # the engine casts to bf16/fp16 itself: no autocast
            self.engine.backward(loss)
            self.engine.step()
            loss_sum += loss.detach()
        return loss_sum / n_micro, True

    def grad_norm(self) -> float:
        """The global gradient norm of the last update (before clipping)."""
        norm = self.engine.get_global_grad_norm()
        return 0.0 if norm is None else float(norm)

    def describe(self) -> tuple[str, str]:
        ds = self.cfg
        mode = (
            f"deepspeed ZeRO-{ds.zero_stage}"
            + (" + optimizer offload" if ds.offload_optimizer else "")
            + (" + parameter offload" if ds.offload_params else "")
            + self.checkpointing_words()
        )
        return mode, self.precision()

    def optimizer_state_bytes(self) -> int:
        return local_bytes(state_tensors([self.engine.optimizer.optimizer]))  # ZeRO's wraps torch's

    def snapshot_meta(self) -> dict:
        """The ZeRO stage (read by the old per-rank files' checks), and fp16's dynamic loss scale:
        DeepSpeed's own scaler, which a resumed run takes up where it was."""
        scaler = self.engine.optimizer.loss_scaler
        kept = {k: getattr(scaler, k) for k in SCALER_STATE} if scaler.dynamic else {}
        return {
            **super().snapshot_meta(),
            "deepspeed": {"zero_stage": self.cfg.zero_stage, "loss_scaler": kept},
        }

    def load_snapshot_meta(self, meta: dict) -> None:
        scaler = self.engine.optimizer.loss_scaler
        for key, value in ((meta.get("deepspeed") or {}).get("loss_scaler") or {}).items():
            if scaler.dynamic:  # a static scale (fp32, bf16) stays 1
                setattr(scaler, key, value)

    def check_snapshot(self, snapshot, where: str) -> None:
        """Any layout's snapshot resumes here; one of DeepSpeed's own files only at the ZeRO stage
        and world size that wrote it (its files are partitioned per rank)."""
        if snapshot.kind != self.old_files:
            return
        meta, stage = snapshot.meta, self.cfg.zero_stage
        if meta["deepspeed"]["zero_stage"] != stage:
            saved = meta["deepspeed"]["zero_stage"]
            raise SnapshotMismatch(
                f"{where} holds DeepSpeed ZeRO-{saved}'s own files; resume with "
                f"deepspeed_config.zero_stage={saved}"
            )
        if meta["world_size"] != self.ctx.world_size:
            raise SnapshotMismatch(
                f"{where} holds DeepSpeed partitions for {meta['world_size']} ranks, "
                f"and this job has {self.ctx.world_size}; resume with {meta['world_size']} ranks "
                "(nnodes x nproc_per_node), "
                "or export its weights with python -m mingpt_ddp.snapshots consolidate"
            )

    def tensor_state(self) -> dict:
        """Collective: the whole model's and optimizer's state by name, on every rank."""
        return zero_state.whole_state(self.engine.optimizer, self.model, self.groups)

    def read_tensors(self, snapshot) -> dict:
        """Whole tensors from any layout's snapshot; DeepSpeed's own files (collective) straight
        into the engine."""
        if snapshot.kind == self.old_files:
            return self.load_engine_files(snapshot.directory)
        if not snapshot.reshardable:
            return snapshot.tensors()  # one file: whole already
        target = zero_state.blank_target(self.shapes)
        return snapshot.tensors(into=load_target(target, self.model.config.tie_embeddings))

    def load_tensor_state(self, state: dict) -> None:
        if "model" in state:  # else the engine read its own files
            zero_state.load_whole_state(self.engine.optimizer, self.model, state)

    def load_engine_files(self, directory: str) -> dict:
        """Collective: every rank loads its partition from DeepSpeed's staged files (checked
        against the manifest, and by the layout's weights-only check, as they were staged)."""
        path, _ = self.engine.load_checkpoint(directory, tag=TAG, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the snapshot staged in {directory}")
        return {}  # the engine holds them now
