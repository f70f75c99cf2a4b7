"""What a training run does: the trainer's knobs (the optimizers' are in mingpt_ddp/optim.py).

The config section `trainer_config` is a typed dataclass whose fields are the keys
(mingpt_ddp/config/schema.py registers it with Hydra, which checks keys and types; __post_init__
checks ranges and resolves nothing that depends on the machine: "auto" values are decided at start,
in mingpt_ddp/parallel/plan.py). The Trainer in trainer.py is the code it configures.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from mingpt_ddp.errors import ConfigError


def checkpoint_every(spec: str) -> int:
    """trainer_config.activation_checkpointing as a period: 0 for none, 1 for full (every block),
    K for every-K; any other spelling refused, naming the accepted ones. One parser for the config
    check and for mingpt_ddp/parallel/checkpointing.py, which applies it."""
    period = {"none": 0, "full": 1}.get(spec)
    if period is None and re.fullmatch(r"every-[1-9][0-9]*", str(spec)):
        period = int(spec.removeprefix("every-"))
    if period is None:
        raise ConfigError(
            "trainer_config.activation_checkpointing must be none, full or every-K "
            f"(K a whole number from 1, e.g. every-2), got {spec!r}"
        )
    return period


@dataclass
class TrainerConfig:
    """How long and how to train, log and snapshot (config section `trainer_config`)."""

    max_steps: int = 2000
    """Optimizer steps in the whole run; epochs follow from it and the data size."""
    batch_size: int = 8
    """Windows per rank per micro-step. Global batch = batch_size * world_size *
    grad_accum_steps."""
    grad_accum_steps: int = 1
    """Micro-steps whose gradients are summed before each optimizer step."""
    eval_every: int = 250
    """Steps between evaluations (validation loss, a sample); the last step is always evaluated."""
    eval_iters: int = 20
    """Batches per rank in each evaluation."""
    log_every: int = 50
    """Steps between log lines and metrics records (numbers averaged over the steps and the
    ranks)."""
    save_every: int = 250
    """Steps between snapshots; the last step (and a stop signal) always saves."""
    run_dir: str = "runs/shakespeare_char"
    """This run's directory (relative paths: from where you launch): its snapshots, metrics and
    TensorBoard events go under it unless given paths of their own. Each job of a --multirun sweep
    gets its own."""
    snapshot_path: str = ""
    """Directory or URL (s3://, any fsspec URL) for snapshots; empty: <run_dir>/snapshots."""
    keep_last: int = 3
    """How many snapshots to keep; older ones are deleted after a newer one is committed."""
    metrics_path: str = ""
    """Local JSON-lines file, one record per logged step; empty: <run_dir>/metrics.jsonl; none: no
    file."""
    seed: int = 1337
    """One seed for everything: initial weights, each rank's dropout stream (seed + rank; the ranks
    of a tensor-parallel group share seed + rank // degree), data order."""
    sample_chars: int = 200
    """Characters generated at each evaluation (0: none)."""
    parallel: str = "ddp"
    """How the model is spread over ranks: ddp (full replicas), fsdp (FSDP2 shards), deepspeed
    (DeepSpeed ZeRO, stage in deepspeed_config), horovod (full replicas, gradients averaged by
    Horovod; run under horovodrun), none (one process)."""
    grad_reduce: str = "all_reduce"
    """DDP: all_reduce (ring, overlapped with backward) or via_rank0 (a star all-reduce: every rank
    sends to rank 0, which sends the mean back; the parameter-server pattern, kept as a baseline to
    compare against)."""
    fsdp_reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (less memory; gathers again in backward)."""
    fsdp_cpu_offload: bool = False
    """FSDP: keep parameter shards, gradients and optimizer state in CPU memory (for GPU jobs)."""
    device: str = "auto"
    """auto: one GPU per rank (picked by its local rank) if there are GPUs, else the CPU; cpu: the
    CPU and gloo even on a GPU machine; cuda: GPUs, or an error naming what is missing."""
    use_amp: bool | str = "auto"
    """Automatic mixed precision: matmuls in amp_dtype, parameters and optimizer state stay fp32.
    auto: on where the device computes amp_dtype natively (GPUs; CPUs with AVX-512 BF16 or AMX),
    fp32 elsewhere, and fp32 on a GPU without bf16 units under a pipeline, tensor parallelism or
    torchft (they refuse fp16)."""
    amp_dtype: str = "auto"
    """bf16 (no scaling needed) or fp16 (narrow range: the loss is scaled by a GradScaler), on CPU
    or GPU; auto: bf16, or fp16 on a GPU without bf16 units (before Ampere) where the mode takes
    fp16 (not a pipeline, tensor parallelism or torchft)."""
    tf32: bool = True
    """On NVIDIA GPUs (Ampere and newer), let fp32 matmuls run on TF32 tensor cores (inputs rounded
    to a 10-bit mantissa, fp32 accumulation): several times faster than full fp32. No effect on
    CPUs."""
    async_save: bool = False
    """Copy the state to CPU memory and write the snapshot in a background thread while training
    goes on."""
    max_failed_saves: int = 3
    """A periodic save that fails (after a few quick retries) is logged and training goes on; this
    many failed save points in a row fail the job. The final and the preemption save must
    succeed."""
    lease_ttl_s: float = 60.0
    """Seconds the snapshot path's lease lasts without renewal (mingpt_ddp/snapshots/lease.py): a
    second job on the same path is refused while it lasts; a dead holder on another host is taken
    over after it. 0: no lease."""
    s3_endpoint_url: str = ""
    """Endpoint for s3:// snapshot paths (MinIO, Ceph, R2...); empty: AWS_ENDPOINT_URL or AWS
    itself."""
    collective_timeout_s: float = 600.0
    """A collective that waits longer than this fails instead of hanging the job."""
    stall_report_s: float = 300.0
    """When no step completes for this long, every rank writes its stacks and last collectives to
    <run_dir>/stall/ and rank 0 names the rank that is behind (mingpt_ddp/runtime/stall.py); keep
    it below collective_timeout_s, which ends the attempt. 0: off."""
    init_from: str = ""
    """Start from these weights instead of random ones (fine-tuning): a Hugging Face GPT-2 folder
    (python -m mingpt_ddp.export writes one), a .pt file, or another run's snapshots. Its
    vocabulary and shape must be this run's. A snapshot of this run, once there is one, is resumed
    instead. Empty: random initial weights."""
    straggler_factor: float = 2.0
    """On log steps, a rank whose own work (data and forward) exceeds the others' median by this
    factor, and by a fifth of the step, is named in one line (mingpt_ddp/runtime/straggler.py).
    0: off."""
    profile_steps: int = 0
    """Trace this many steps (after 2 of warm-up) with torch.profiler: every rank writes a Chrome
    trace, <run_dir>/traces/rank<R>.json.gz, for Perfetto (mingpt_ddp/runtime/profiling.py). 0:
    off."""
    trace_samples_path: str = ""
    """Directory for per-rank JSON lines of the window starts each rank trains on (to audit data
    order)."""
    compile: bool = False
    """torch.compile the model (inductor kernels; under FSDP block by block). Costs seconds to
    compile at start (cached on disk for later runs), then fuses the small ops between the matmuls:
    on 2 CPU cores with native bf16, gpt-micro's step went from ~21 to ~19 ms (docs/speedrun.md);
    off by default, since a short run does not earn its compile time back."""
    activation_checkpointing: str = "none"
    """Keep only a block's input through forward and recompute its insides during backward, for
    less activation memory at the cost of a second forward of those blocks: none, full (every
    block) or every-K (the first block and every K-th after it, e.g. every-2). Any parallel mode;
    mingpt_ddp/parallel/checkpointing.py."""
    cpu_threads: int = 0
    """Threads for each rank's CPU math; 0: the cores this process may use divided by the ranks on
    its node (torchrun alone gives every rank 1 thread, leaving cores idle when there are more cores
    than ranks)."""
    cpu_keep_freed_memory: bool = True
    """On CPU with glibc: the C allocator keeps the memory each step frees for the next, instead of
    returning it to the OS and page-faulting it back (distributed.keep_freed_cpu_memory; 15-20% of a
    small model's step). false: glibc's defaults. A MALLOC_* variable or LD_PRELOADed allocator
    wins."""
    tensorboard: bool = False
    """Also log every metrics record to TensorBoard event files in <run_dir>/tensorboard
    (pip install -e ".[tensorboard]"; then tensorboard --logdir runs)."""
    target_val_loss: float = 0.0
    """Stop at the first evaluation whose validation loss is at or below this (after a snapshot); 0:
    off."""

    def __post_init__(self) -> None:
        # Checked in this order, so a config with several mistakes always names the same one first.
        self._check_counts()
        self._check_choices()
        self._check_extras()

    def _check_counts(self) -> None:
        """Step counts, sizes and the lease's lifetime: numbers a run cannot work with below zero
        (or at zero), each named in its own message so the user knows which key to raise."""
        for name in (
            "max_steps",
            "batch_size",
            "grad_accum_steps",
            "eval_every",
            "eval_iters",
            "log_every",
            "save_every",
            "keep_last",
            "max_failed_saves",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"trainer_config.{name} must be positive, got {getattr(self, name)}"
                )
        if self.lease_ttl_s < 0:
            raise ConfigError(
                "trainer_config.lease_ttl_s must be >= 0 (0 turns the lease off), "
                f"got {self.lease_ttl_s}"
            )

    def _check_choices(self) -> None:
        """The keys that pick one of a few named options: a value outside them is refused here,
        naming the key and its options, instead of failing later in code far from the key."""
        if self.parallel not in ("ddp", "fsdp", "deepspeed", "horovod", "none"):
            raise ConfigError(
                "trainer_config.parallel must be ddp, fsdp, deepspeed, horovod or none, "
                f"got {self.parallel!r}"
            )
        if self.grad_reduce not in ("all_reduce", "via_rank0"):
            raise ConfigError(
                "trainer_config.grad_reduce must be all_reduce or via_rank0, "
                f"got {self.grad_reduce!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(
                f"trainer_config.device must be auto, cpu or cuda, got {self.device!r}"
            )
        if self.amp_dtype not in ("auto", "bf16", "fp16"):
            raise ConfigError(
                f"trainer_config.amp_dtype must be auto, bf16 or fp16, got {self.amp_dtype!r}"
            )
        if self.use_amp not in (True, False, "auto"):
            raise ConfigError(
                f"trainer_config.use_amp must be true, false or auto, got {self.use_amp!r}"
            )
        checkpoint_every(self.activation_checkpointing)

    def _check_extras(self) -> None:
        """What runs beside training (samples, the collectives' timeout, TensorBoard, CPU threads,
        the early stop): checked with the rest, so a missing tensorboard package fails the job
        before it trains."""
        if min(self.sample_chars, self.stall_report_s, self.profile_steps) < 0:
            raise ConfigError(
                "trainer_config: sample_chars, stall_report_s and profile_steps must be >= 0"
            )
        if self.straggler_factor and self.straggler_factor <= 1:
            raise ConfigError(
                f"trainer_config.straggler_factor must be above 1 (or 0: off), got "
                f"{self.straggler_factor}"
            )
        if self.collective_timeout_s <= 0:
            raise ConfigError("trainer_config.collective_timeout_s must be > 0")
        if self.tensorboard:
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "trainer_config.tensorboard=true needs the tensorboard package: "
                    'pip install -e ".[tensorboard]" (or set it to false)'
                ) from None
        if self.cpu_threads < 0 or self.target_val_loss < 0:
            raise ConfigError(
                "trainer_config: cpu_threads and target_val_loss must be >= 0 (0: automatic / off)"
            )

    # Where this run's files go: an explicit path, or the default place under run_dir.
    @property
    def snapshot_url(self) -> str:
        return self.snapshot_path or os.path.join(self.run_dir, "snapshots")

    @property
    def metrics_file(self) -> str:
        """The metrics file's path, or "" for none."""
        return (
            ""
            if self.metrics_path == "none"
            else self.metrics_path or os.path.join(self.run_dir, "metrics.jsonl")
        )

    @property
    def tensorboard_dir(self) -> str:
        return os.path.join(self.run_dir, "tensorboard") if self.tensorboard else ""
