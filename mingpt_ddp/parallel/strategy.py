"""The contract between the Trainer and a parallel mode (trainer_config.parallel).

The Trainer owns the loop: the data order, the learning-rate schedule, when to evaluate, log and
snapshot, and stop signals. A Strategy owns everything that depends on how the model is spread
over the ranks: wrapping it, the optimizer and its whole step, evaluation's forward passes, the
words that describe it, and how its state is written and read. The Trainer and the snapshot
protocol call only the methods below and never ask which mode runs, so a new mode is one new
module beside single.py, ddp.py, fsdp.py, deepspeed.py and horovod.py, named in registry.py.

The contract, as the Trainer relies on it:

    Strategy.check(args)              refuse settings the mode does not run (ConfigError naming
                                      the one to change), before anything is built
    strategy.model                    the plain nn.Module (for sampling text; its parameters may be
                                      shards, so with forward_on_all_ranks every rank samples)
    strategy.optimizers               the torch optimizers whose param_groups["lr"] the Trainer sets
    strategy.begin_step(step)         before a step draws its data: None, or the step this rank
                                      moved to (torchft: healed from a live peer)
    strategy.train_step(batches, n)   one whole optimizer step over n micro-batches (an iterator
                                      of (x, y), each (B, T)): forward, backward, gradient
                                      reduction, global clipping, update. Returns (loss, committed):
                                      the step's mean loss on this rank (a device tensor, not
                                      synchronised) or None where this rank computed none, and
                                      whether the step was applied (the Trainer counts only those)
    strategy.evaluation_share(r, n)   which share of the validation windows this rank evaluates
    strategy.evaluate(batches)        the mean loss over those batches, averaged over the ranks
    strategy.sampling_model()         the module to generate text with (None: not on this rank)
    strategy.grad_norm()              the last step's global gradient norm, before clipping
    strategy.describe()               (mode, precision): the words of the start-up line
    strategy.optimizer_state_bytes()  what this rank holds of the optimizer state
    strategy.layout                   None: one file, written by rank 0 from tensor_state();
                                      else a FileLayout: every rank writes write_files(stage)
    strategy.snapshot_meta()          what a snapshot must record of the mode (partitioning)
    strategy.check_snapshot(s, where) refuse a snapshot this mode cannot resume (SnapshotMismatch)
    strategy.tensor_state()           {"model", "optimizer"} keyed by parameter name
    strategy.read_tensors(snapshot)   those tensors from an open snapshot, laid out for this run
    strategy.load_tensor_state(state) put them into the model and optimizers

The control-plane collectives (the vote, gathers, means) come in StrategyArgs.control: a mode
with its own ranks and transport could bring its own ControlPlane.

How the modes beyond data parallelism fit this contract:

- Pipeline parallelism (pipeline.py): only the last stage computes a loss,
  so train_step returns (None, True) on the other stages and the Trainer averages the losses that
  exist; evaluate forwards through the stages and sums over the ranks that have a loss; clipping
  sums each stage's squared norm over the pipeline; sampling_model puts the whole model together
  on rank 0; the data share is the replica's, not the rank's (plan.replica).
- Tensor parallelism (tensor.py): every rank of a group takes part in every forward
  (forward_on_all_ranks); clipping sums each rank's squares over the world, each value counted
  once; the QKV rows are put back in the standard order for snapshots and sampling_model.
- Context parallelism (context.py): train_step and evaluate cut each batch to this rank's chunks
  of every window, with their positions ((x, y, positions) reach the model), and switch the
  model's attention kernel to the ring (ring.py) around them.
- torchft (replica_groups.py): begin_step joins the step's quorum and heals a group that is
  behind from a live peer; train_step asks the manager whether the step may commit after the
  gradients are averaged across replica groups; a rejected step returns (loss, False) and is not
  counted.
- Horovod (horovod.py): horovodrun's ranks become torchrun's variables before the process group
  is joined (runtime/horovodrun.py), so the control plane is the usual gloo group; the gradients
  go through hvd.DistributedOptimizer, which wraps the optimizers inside the strategy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn

from mingpt_ddp.config.deepspeed import DeepSpeedConfig
from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.errors import SnapshotMismatch
from mingpt_ddp.parallel.checkpointing import checkpointing_words
from mingpt_ddp.parallel.plan import Plan, bf16_native, tf32_matmuls
from mingpt_ddp.runtime.distributed import ControlPlane, DistContext
from mingpt_ddp.snapshots.files import OpenSnapshot
from mingpt_ddp.snapshots.layout import FileLayout

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
    """The base of every parallel mode: the contract above, and what most modes share."""

    layout: FileLayout | None = None
    """How its snapshots are written: None, one file by rank 0; else every rank writes its files."""
    forward_on_all_ranks: bool = False
    """Every rank must run every forward (each holds only part of the parameters)."""
    amp_words: str = "{dtype} autocast"
    """How mixed precision works in this mode, in words, for the start-up line."""
    checkpointed: int = 0
    """How many blocks the mode put under activation checkpointing as it wrapped the model."""

    def __init__(self, model: nn.Module, args: StrategyArgs):
        self.model, self.args = model, args
        self.plan, self.ctx, self.control = args.plan, args.ctx, args.control
        self.device = args.ctx.device
        self.optimizers: list[torch.optim.Optimizer] = []

    @classmethod
    def check(cls, args: StrategyArgs) -> None:
        """Refuse settings this mode does not run (ConfigError, naming the setting to change)."""

    # -------------------------------------------------------------- the step
    def begin_step(self, step: int) -> int | None:
        """Called before each step draws its data: the step this rank moved to, if it moved."""
        return None

    def train_step(
        self, batches: Iterator[Batch], n_micro: int
    ) -> tuple[torch.Tensor | None, bool]:
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, batches: Iterator[Batch]) -> float:
        # eval(): no dropout. No gradients, so DDP's hooks are not needed (FSDP's gathers still
        # run).
        self.model.eval()
        total, n = torch.zeros((), device=self.device), 0
        for batch in batches:  # (x, y), or with positions (context parallel)
            with self.precision_context():
                total += self.model(*batch)[1]
            n += 1
        self.model.train()
        return self.control.mean(total / n).item()

    def evaluation_share(self, replica: int, replicas: int) -> tuple[int, int]:
        """(which, of how many): the share of the validation windows this rank evaluates; its
        replica's, so that evaluation splits like training."""
        return replica, replicas

    def sampling_model(self) -> nn.Module | None:
        """The model to generate text with: the plain module (its parameters may be shards, under
        forward_on_all_ranks every rank samples); None where this rank has none (a pipeline puts
        the whole model together on rank 0)."""
        return self.model

    def precision_context(self) -> AbstractContextManager:
        """The forward pass's precision context (none: the mode casts the parameters itself)."""
        return nullcontext()

    def grad_norm(self) -> float:
        raise NotImplementedError

    # ------------------------------------------------------------- in words
    def describe(self) -> tuple[str, str]:
        """(mode, precision) in words: what the start-up line says of this run."""
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
        return words + (" + GradScaler" if self.scales_loss() else "")

    def attention_words(self) -> str:
        return ""

    def scales_loss(self) -> bool:
        return False

    def optimizer_state_bytes(self) -> int:
        raise NotImplementedError

    # ----------------------------------------------------------- snapshots
    def snapshot_meta(self) -> dict:
        """What a snapshot records of the mode besides tensors: fp16's loss scale ("scaler") and
        DeepSpeed's partitioning ("deepspeed": None, any mode can resume it); keys of format 1
        on."""
        return {"scaler": {}, "deepspeed": None}

    def load_snapshot_meta(self, meta: dict) -> None:
        """Restore what snapshot_meta recorded (the loss scale)."""

    def check_snapshot(self, snapshot: OpenSnapshot, where: str) -> None:
        """Refuse a snapshot whose files only their own mode can read."""
        layout = snapshot.layout
        if layout is not None and layout is not self.layout and layout.refusal is not None:
            raise SnapshotMismatch(f"{where} {layout.refusal(snapshot.meta)}")

    def tensor_state(self) -> dict:
        raise NotImplementedError

    def read_tensors(self, snapshot: OpenSnapshot) -> dict:
        """The snapshot's tensors for load_tensor_state ({} if the mode loads them itself)."""
        return snapshot.tensors()

    def load_tensor_state(self, state: dict) -> None:
        raise NotImplementedError

    def write_files(self, stage: str) -> str:
        """Collective (modes with a layout): write this rank's files under stage; returns their
        folder."""
        raise NotImplementedError
