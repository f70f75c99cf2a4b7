"""The contract between the Trainer and the parallelism (trainer_config.parallel, mesh_config).

The Trainer owns the loop and the step: the data order, the learning-rate schedule, the
micro-batch loop, backward, clipping and the optimizer step, when to evaluate, log and snapshot,
and stop signals. A Strategy owns everything that depends on how the model is spread over the
ranks: the grid and the ladder that wrapped the model (grid.py: every torch-native layout), the
optimizers, evaluation's forward passes, the words that describe it, and its state as plain dicts.
The Trainer and the snapshot protocol call only what is below and never ask which layout runs.

What the Trainer's step uses:

    strategy.optimizers               the torch optimizers (the Trainer sets their lr every step)
    strategy.scaler                   fp16's GradScaler (disabled otherwise: its calls do nothing)
    strategy.train_model              what training calls: (x, y) -> (logits, loss)
    strategy.pipeline                 None, or the pipeline whose schedule runs forward + backward
    strategy.local(batch)             this rank's part of a (x, y) batch (context parallelism)
    strategy.forward_context()        autocast, and context parallelism's ring, for forwards
    strategy.gradient_sync(last)      gradients reduced on the last micro-step only
    strategy.reduce_gradients()       engines that reduce after backward (Horovod, torchft);
                                      False: the step is not applied (torchft's quorum said no)
    strategy.clip(max_norm)           clip by the global norm over the grid; returns it
    strategy.begin_step(step, n)      before a step draws its data: None, or the step this rank
                                      moved to (torchft: healed from a live peer)
    strategy.own_step                 None, or an engine's whole step (DeepSpeed):
                                      (batches, n) -> (loss, applied)

And the rest of the run:

    strategy.model                    the plain nn.Module (its parameters may be shards)
    strategy.evaluate(batches)        the mean loss over those batches, averaged over the ranks
    strategy.evaluation_share(r, n)   which share of the validation windows this rank evaluates
    strategy.sampling_model()         the module to generate text with (None: not on this rank)
    strategy.forward_on_all_ranks     every rank must take part in every forward (sampling too)
    strategy.grad_norm()              the last step's global gradient norm, before clipping
    strategy.describe()               (layout, precision): the words of the start-up line
    strategy.optimizer_state_bytes()  what this rank holds of the optimizer state
    strategy.files                    None: one file, written by rank 0 from tensor_state();
                                      else the kind of files every rank writes (write_files)
    strategy.snapshot_meta()          what a snapshot must record besides tensors (loss scale)
    strategy.check_snapshot(s, where) refuse a snapshot this layout cannot resume
    strategy.tensor_state()           {"model", "optimizer"} keyed by the whole model's names
    strategy.read_tensors(snapshot)   those tensors from an open snapshot, laid out for this run
    strategy.load_tensor_state(state) put them into the model and optimizers

The snapshot code never imports this package, nor this package the snapshot code: they meet in
these plain dicts and in the open snapshot the protocol hands over (its .meta, .kind, .layout and
.tensors(into=...)).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn

from mingpt_ddp.config.deepspeed import DeepSpeedConfig
from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.errors import ConfigError, SnapshotMismatch
from mingpt_ddp.parallel.checkpointing import checkpointing_words
from mingpt_ddp.parallel.plan import Plan, bf16_native, tf32_matmuls
from mingpt_ddp.runtime.distributed import ControlPlane, DistContext

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs and targets, (B, T) each


@dataclass(frozen=True)
class StrategyArgs:
    """What every strategy is built from."""

    plan: Plan
    """The parallelism and precision settings of the run ("auto" already decided)."""
    ctx: DistContext
    """Who this rank is, and its device."""
    optim: OptimizerConfig
    """The optimizer the strategy builds (or hands to its engine)."""
    batch_size: int
    """Windows per rank per micro-step."""
    accum_steps: int
    """Micro-steps per optimizer step, as the run starts."""
    control: ControlPlane
    """The collectives to coordinate with (the vote, gathers, means)."""
    deepspeed: DeepSpeedConfig
    """DeepSpeed's own settings (read by the DeepSpeed strategy only)."""


def assemble(like: nn.Module, state: dict, device: torch.device) -> nn.Module:
    """A plain model of like's class and config holding state's whole tensors (a sample's model,
    put together from shards or stages); the random stream is left as it was."""
    with torch.random.fork_rng(devices=[]):  # building initialises weights: keep the RNG
        whole = type(like)(like.config)
    whole.load_state_dict(state)
    return whole.to(device)


class Strategy:
    """The base of every parallel layout: the contract above, and what most layouts share."""

    files: str | None = None
    """Its snapshots: None, one file by rank 0; else the kind every rank writes files of."""
    forward_on_all_ranks: bool = False
    """Every rank must run every forward (each holds only part of the parameters)."""
    amp_words: str = "{dtype} autocast"
    """How mixed precision works in this layout, in words, for the start-up line."""
    checkpointed: int = 0
    """How many blocks went under activation checkpointing as the model was wrapped."""
    pipeline = None
    """The pipeline whose schedule runs each step's forwards and backwards (pipeline.py)."""
    own_step = None
    """An engine's whole step, (batches, n) -> (loss, applied), in place of the Trainer's."""

    def __init__(self, model: nn.Module, args: StrategyArgs):
        self.model, self.args = model, args
        self.plan, self.ctx, self.control = args.plan, args.ctx, args.control
        self.device = args.ctx.device
        self.optimizers: list[torch.optim.Optimizer] = []
        self.train_model = model
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=False)

    @classmethod
    def check(cls, args: StrategyArgs) -> None:
        """Refuse settings this layout does not run (ConfigError, naming the setting to change)."""

    # -------------------------------------------------------------- the step
    def begin_step(self, step: int, n_micro: int) -> int | None:
        """Called before each step (of n_micro micro-steps) draws its data: the step this rank
        moved to, if it moved."""
        return None

    def local(self, batch: Batch) -> tuple:
        return batch

    def forward_context(self) -> AbstractContextManager:
        return nullcontext()

    def gradient_sync(self, sync: bool) -> AbstractContextManager:
        return nullcontext()

    def reduce_gradients(self) -> bool:
        return True

    def step_record(self, record: dict) -> str:
        """Collective, on log steps: what the layout adds to the step's metrics record, and the
        words it adds to its line (a mixture of experts' balance)."""
        return ""

    def clip(self, max_norm: float) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, batches: Iterator[Batch]) -> float:
        # eval(): no dropout. No gradients, so DDP's hooks are not needed (FSDP's gathers still
        # run).
        self.model.eval()
        total, n = torch.zeros((), device=self.device), 0
        with self.forward_context():
            for batch in batches:
                total += self.model(*self.local(batch))[1]
                n += 1
        self.model.train()
        return self.control.mean(total / n).item()

    def evaluation_share(self, replica: int, replicas: int) -> tuple[int, int]:
        """(which, of how many): the share of the validation windows this rank evaluates; its
        replica's, so that evaluation splits like training."""
        return replica, replicas

    def sampling_model(self) -> nn.Module | None:
        """The model to generate text with: the plain module (its parameters may be shards, under
        forward_on_all_ranks every rank samples); None where this rank has none."""
        return self.model

    def grad_norm(self) -> float:
        raise NotImplementedError

    # ------------------------------------------------------------- in words
    def describe(self) -> tuple[str, str]:
        """(layout, precision) in words: what the start-up line says of this run."""
        return self.plan.parallel + self.checkpointing_words(), self.precision()

    def checkpointing_words(self) -> str:
        """What the start-up line says of activation checkpointing (nothing when off)."""
        return checkpointing_words(self.checkpointed, len(self.model.blocks))

    def precision(self) -> str:
        plan = self.plan
        if not plan.use_amp:
            return "fp32 (TF32 matmuls)" if plan.tf32 and tf32_matmuls(self.device) else "fp32"
        words = self.amp_words.format(dtype=plan.amp_dtype)
        if plan.amp_dtype == "bf16":  # whether the hardware has bf16 units decides if bf16 pays off
            words += f" ({bf16_native(self.device)[1]})" + self.attention_words()
        return words + (" + GradScaler" if self.scaler.is_enabled() else "")

    def attention_words(self) -> str:
        return ""

    def optimizer_state_bytes(self) -> int:
        raise NotImplementedError

    # ----------------------------------------------------------- snapshots
    def snapshot_meta(self) -> dict:
        """What a snapshot records of the layout besides tensors: fp16's loss scale ("scaler") and
        DeepSpeed's partitioning ("deepspeed": None, any layout can resume it)."""
        return {"scaler": {}, "deepspeed": None}

    def load_snapshot_meta(self, meta: dict) -> None:
        """Restore what snapshot_meta recorded (the loss scale)."""

    def check_snapshot(self, snapshot, where: str) -> None:
        """Refuse a snapshot whose files only their own engine can read (its layout's refusal)."""
        layout = snapshot.layout
        if layout is not None and snapshot.kind != self.files and layout.refusal is not None:
            raise SnapshotMismatch(f"{where} {layout.refusal(snapshot.meta)}")

    def tensor_state(self) -> dict:
        raise NotImplementedError

    def read_tensors(self, snapshot) -> dict:
        """The snapshot's tensors for load_tensor_state ({} if the engine loads them itself)."""
        return snapshot.tensors()

    def load_tensor_state(self, state: dict) -> None:
        raise NotImplementedError

    def write_files(self, stage: str) -> str:
        """Collective (layouts with files): write this rank's files under stage; returns their
        folder."""
        raise NotImplementedError


CPU_OFFLOAD_NEEDS_FSDP = (
    "trainer_config.fsdp_cpu_offload=true keeps FSDP's shards in CPU memory instead of GPU "
    "memory: it needs parallel=fsdp on GPUs; set fsdp_cpu_offload=false"
)


def check_no_foreign_options(plan) -> None:
    """Options of the grid's data parallelism (FSDP's CPU offload, DDP's star hook), set under an
    engine where they would do nothing: refused, naming the layout they belong to."""
    if plan.cpu_offload:
        raise ConfigError(CPU_OFFLOAD_NEEDS_FSDP)
    if plan.grad_reduce == "via_rank0":
        raise ConfigError(
            "trainer_config.grad_reduce=via_rank0 is a DDP communication hook; use parallel=ddp"
        )
