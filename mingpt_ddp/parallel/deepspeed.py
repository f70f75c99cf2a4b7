"""DeepSpeed ZeRO as a parallel mode: trainer_config.parallel=deepspeed (pip install -e ".[deepspeed]").

DDP keeps a whole copy of everything on every rank: parameters, gradients and the optimizer
state (AdamW: two fp32 numbers per parameter, plus an fp32 master copy under bf16). ZeRO, the
Zero Redundancy Optimizer, removes that redundancy in stages:

    stage 1  the optimizer state is split over the ranks: each updates 1/N of the parameters,
             then the updated parameters are all-gathered
    stage 2  + the gradients: reduce-scattered (each rank keeps the 1/N it updates), not all-reduced
    stage 3  + the parameters themselves, gathered module by module for forward and backward:
             what FSDP (parallel=fsdp) does inside PyTorch

Optimizer state per rank shrinks as 1/N from stage 1 on (tests/test_deepspeed.py measures it).
DeepSpeed's engine does what the Trainer does by hand for DDP: the backward pass (scaled for
gradient accumulation), gradient reduction, clipping and the optimizer step. Everything else
(data cursor, schedule, evaluation, metrics, signals, snapshots) is the Trainer's, unchanged.

Snapshots: the engine's save_checkpoint writes each rank's partition into a local staging
directory, and SnapshotStore.save_sharded stores and commits those files like DCP shards
(manifest with checksums, atomic commit, keep-last-N, any storage). DeepSpeed's files are
partitioned by rank, so a snapshot resumes at the world size and ZeRO stage that wrote it;
`python -m mingpt_ddp.snapshots consolidate` turns one into a single fp32 file (for sample.py, or to
start a run of another shape).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from mingpt_ddp.config.deepspeed import DeepSpeedConfig
from mingpt_ddp.errors import ConfigError

TAG = "zero"  # DeepSpeed's checkpoint tag: the sub-directory of the staging directory its files go in


def import_deepspeed(device: torch.device):
    """DeepSpeed, told which accelerator to use (it would otherwise guess from what is installed,
    and pick the GPU for a trainer_config.device=cpu run), with its INFO logging on every rank off."""
    os.environ.setdefault("DS_ACCELERATOR", device.type)
    try:
        import deepspeed
    except ImportError:
        raise ConfigError("trainer_config.parallel=deepspeed needs DeepSpeed: pip install -e \".[deepspeed]\" "
                          "(or use parallel=ddp or fsdp)") from None
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    # DeepSpeed calls all_gather_into_tensor and reduce_scatter_tensor, which torch now warns about every call.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    return deepspeed


def engine_config(ds: DeepSpeedConfig, batch_size: int, accum_steps: int, world_size: int, grad_clip: float,
                  amp_dtype: str | None) -> dict[str, Any]:
    """The JSON-like dict DeepSpeed reads: what this project's config says, in DeepSpeed's words."""
    offload = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": batch_size,  # "per gpu" means per rank
        "gradient_accumulation_steps": accum_steps,
        "train_batch_size": batch_size * accum_steps * world_size,
        "gradient_clipping": grad_clip,  # 0: off
        "zero_optimization": {"stage": ds.zero_stage,
                              **({"offload_optimizer": offload} if ds.offload_optimizer else {}),
                              **({"offload_param": offload} if ds.offload_params else {})},
        "bf16": {"enabled": amp_dtype == "bf16"},
        "fp16": {"enabled": amp_dtype == "fp16"},  # DeepSpeed's own dynamic loss scaling
        # The Trainer's torch AdamW, not DeepSpeed's fused or CPU Adam (those are compiled on first use).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # the Trainer logs
        "wall_clock_breakdown": False,
    }


class ZeroEngine:
    """The DeepSpeed engine and the few things the Trainer asks of it."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ds: DeepSpeedConfig,
                 config: dict[str, Any], device: torch.device):
        deepspeed = import_deepspeed(device)
        self.cfg = ds
        t0 = time.perf_counter()
        # The process group is already up (mingpt_ddp/runtime/distributed.py); DeepSpeed uses it. The optimizer's
        # param_groups stay the Trainer's: setting group["lr"] each step still sets the schedule.
        # On its first use on a machine DeepSpeed compiles a small shared-memory op (cached after),
        # and every rank prints that it did: its prints are kept out of the job's log.
        with contextlib.redirect_stdout(io.StringIO()):
            self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                                     dist_init_required=False)
        self.startup_seconds = time.perf_counter() - t0

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-step's backward. The engine divides the loss by the accumulation steps and
        counts micro-steps: its step() reduces gradients, clips and updates only on the last."""
        self.engine.backward(loss)
        self.engine.step()

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm of the last update (before clipping)."""
        norm = self.engine.get_global_grad_norm()
        return torch.as_tensor(0.0 if norm is None else float(norm))

    def save(self, stage: str) -> str:
        """Collective: every rank writes its partition's files into stage/TAG/ (its own local
        directory), which it returns: SnapshotStore.save_sharded's writer."""
        os.makedirs(os.path.join(stage, TAG), exist_ok=True)
        self.engine.save_checkpoint(stage, tag=TAG, save_latest=False)
        return os.path.join(stage, TAG)

    def load(self, stage: str) -> None:
        """Collective: every rank loads its partition from stage/TAG/ (all the snapshot's files, checked
        against the manifest and by check_weights_only when SnapshotStore staged them)."""
        path, _ = self.engine.load_checkpoint(stage, tag=TAG, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the snapshot staged in {stage}")


def safe_globals() -> list:
    """The classes DeepSpeed pickles into its checkpoint files besides tensors and builtins."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, fragment_address]


def check_weights_only(directory: str) -> None:
    """DeepSpeed reads its files with torch.load(weights_only=False), which runs any code a crafted
    file carries. Before it does, each file must load with weights_only=True, allowing only the few
    DeepSpeed classes it is known to hold (their sha256 already matched the manifest)."""
    with torch.serialization.safe_globals(safe_globals()):
        for name in sorted(os.listdir(directory)):
            try:
                torch.load(os.path.join(directory, name), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - reported as one line
                raise RuntimeError(f"{name} holds more than DeepSpeed's checkpoint data "
                                   f"({type(e).__name__}: {str(e).splitlines()[0]}); not loading it") from None


def consolidated_model(stage: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights, keyed like the model's own state_dict, from a staged (and checked) DeepSpeed snapshot
    (its fp32 optimizer partitions, put back together on the CPU; no process group needed)."""
    import_deepspeed(torch.device("cpu"))
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress lines
        state = get_fp32_state_dict_from_zero_checkpoint(stage, tag=TAG)
    return {k: v.contiguous() for k, v in state.items()}
