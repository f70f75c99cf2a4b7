"""How far a run has got, as a snapshot records it: step, data position, the latest validation
loss, the global batch and every rank's random streams. The tensors are the strategy's; this is
the rest, what makes a resumed run continue exactly where the saved one stopped.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from mingpt_ddp.corpus.order import DataCursor
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.runtime.distributed import ControlPlane, DistContext, print0, warn0

FORMAT_VERSION = 3  # 3: data position as a DataCursor state


class TrainState:
    """The progress of one run on one rank; state_dict() is collective (it gathers RNG states)."""

    def __init__(
        self,
        num_windows: int,
        ctx: DistContext,
        batch_size: int,
        accum_steps: int,
        seed: int,
        control: ControlPlane,
        replica: tuple[int, int] | None = None,
        streams: list[int] | None = None,
    ):
        self.ctx, self.control = ctx, control
        # Which random stream each rank draws (dropout): its own, unless ranks hold the same
        # activations (tensor parallelism's ranks), whose masks must then be equal.
        self.streams = streams or list(range(ctx.world_size))
        self.stream = self.streams[ctx.rank]
        # (which replica, how many): the data-parallel coordinates; every rank is its own replica
        # unless a pipeline's stages share one (mingpt_ddp/parallel/stages.py).
        self.replica, self.replicas = replica or (ctx.rank, ctx.world_size)
        if num_windows < self.replicas * batch_size:
            raise ConfigError(
                f"the training region has {num_windows} windows, fewer than one global "
                f"batch (batch_size {batch_size} x {self.replicas_words()}); use more text "
                "or a smaller trainer_config.batch_size"
            )
        self.data_cursor = DataCursor(num_windows, self.replicas, self.replica, seed)
        self.batch_size, self.accum_steps, self.seed = batch_size, accum_steps, seed
        self.step = 0
        self.last_val_loss: float | None = None  # saved: a rerun knows a target was already met
        self.saved_world_size = ctx.world_size  # of the snapshot resumed from

    def replicas_words(self) -> str:
        """ "2 ranks" ("1 rank"), or with a pipeline "2 replicas" (each of several ranks)."""
        word = "replica" if self.replicas != self.ctx.world_size else "rank"
        return f"{self.replicas} {word}{'s' * (self.replicas != 1)}"

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.replicas * self.accum_steps

    def state_dict(self) -> dict[str, Any]:
        device = self.ctx.device
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "data_cursor": self.data_cursor.state_dict(),
            "val_loss": self.last_val_loss,
            "world_size": self.ctx.world_size,
            "streams": self.streams,
            "global_batch": self.global_batch,
            "rng": self.control.gather({"cpu": torch.get_rng_state(), "cuda": cuda}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.last_val_loss = state["step"], state.get("val_loss")
        self.saved_world_size = state["world_size"]
        self._load_data_cursor(state)
        self._load_rng(state)
        if state["global_batch"] != self.global_batch:
            self._keep_global_batch(state["global_batch"])

    def jump_to(self, step: int) -> None:
        """Continue at another step (a torchft group healed from a peer), reading this replica's
        windows of that step: its data position is a function of the step, not copied."""
        self.step = step
        self.data_cursor.seek(step * self.accum_steps, self.batch_size)

    def finished(self, max_steps: int, target: float) -> str:
        """Why a rerun of a finished run trains nothing (target met, or max_steps reached), or
        "" if it has steps to train."""
        loss = self.last_val_loss
        if target and loss is not None and loss <= target:
            return (
                f"snapshot's val loss {loss:.4f} already meets trainer_config.target_val_loss "
                f"{target}; nothing to do"
            )
        if self.step >= max_steps:
            return (
                f"snapshot is already at step {self.step} >= max_steps {max_steps}; nothing to do "
                "(raise trainer_config.max_steps, or use another trainer_config.run_dir for a new "
                "run)"
            )
        return ""

    def position(self) -> str:
        """Where the run stands, in words (the resume line)."""
        return (
            f"step {self.step} | epoch {self.data_cursor.epoch} | "
            f"{self.data_cursor.samples_consumed} samples into the epoch | "
            f"saved at world size {self.saved_world_size}, now {self.ctx.world_size}"
        )

    def _load_rng(self, state: dict[str, Any]) -> None:
        ctx = self.ctx
        saved = state.get("streams") or list(range(state["world_size"]))  # before tp: by rank
        if saved == self.streams:
            # The same ranks drawing the same streams: every rank continues its own exactly.
            rng = state["rng"][ctx.rank]
            torch.set_rng_state(rng["cpu"])
            if rng["cuda"] is not None and ctx.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], ctx.device)
        else:
            # Another world size or layout (a dp snapshot at tp2: two ranks must now draw one
            # stream): start new ones, a function of the seed and of the step, so they do not
            # replay step 0's.
            torch.manual_seed(self.seed + 100_003 * self.step + self.stream)

    def _load_data_cursor(self, state: dict[str, Any]) -> None:
        # Format 1-2 kept the epoch and position at the top level.
        cursor = state.get("data_cursor") or {
            "epoch": state["epoch"],
            "samples_consumed": state["samples_consumed"],
        }
        if (
            cursor.get("order") != DataCursor.ORDER
        ):  # from before the order was a Feistel permutation
            warn0(
                f"the snapshot walked epoch {cursor['epoch']} in another order; the rest of that "
                "epoch follows this version's order, so some of its windows may repeat or be "
                "skipped (later epochs are exact)"
            )
        self.data_cursor.load_state_dict(cursor)

    def _keep_global_batch(self, global_batch: int) -> None:
        """At a new world size, keep the global batch (and so the meaning of a step and of the
        learning-rate schedule) by changing gradient accumulation; the per-rank batch stays."""
        per_micro_step = self.batch_size * self.replicas
        if global_batch % per_micro_step:
            warn0(
                f"global batch {global_batch} is not a multiple of batch_size x world size = "
                f"{per_micro_step}; continuing with a global batch of {self.global_batch}"
            )
            return
        self.accum_steps = global_batch // per_micro_step
        print0(
            f"resume | global batch kept at {global_batch} windows = {self.batch_size} per rank "
            f"x {self.replicas_words()} x {self.accum_steps} accumulation steps"
        )


class StartsTrace:
    """trainer_config.trace_samples_path: every step's window starts, one JSON line per
    micro-step, one file per rank (the tests check from it that no window is seen twice)."""

    def __init__(self, directory: str, rank: int):
        self.file = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            self.file = open(os.path.join(directory, f"rank{rank}.jsonl"), "a")

    def write(self, step: int, epoch: int, starts: torch.Tensor) -> None:
        if self.file is not None:
            line = {"step": step, "epoch": epoch, "starts": starts.tolist()}
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
