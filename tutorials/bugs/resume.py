"""The bug zoo's resume exhibits: a checkpoint that leaves out the GradScaler's state, the random
number generators' or the learning-rate schedule's, caught by a resume-equivalence test.

One process trains with the project's pieces, as the Trainer puts them together: its step
(trainer.step, over the strategy of parallel=none with fp16 autocast, so GradScaler is on),
TrainState (step, DataCursor, RNG) and set_learning_rates. The snapshot is Trainer.state_dict's,
serialized and loaded with the project's own functions; a buggy checkpoint leaves one entry out.
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LambdaLR

from bugs.base import BATCH, BLOCK, CPU, Row, build, tiny_gpt, train_step, windows
from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.optim import set_learning_rates
from mingpt_ddp.runtime.distributed import ControlPlane, DistContext
from mingpt_ddp.snapshots.files import load_bytes, serialize
from mingpt_ddp.train_state import TrainState

STEPS, SAVE_AT, SEED = 8, 4, 1337
OPTIM = OptimizerConfig(learning_rate=3e-3, warmup_steps=STEPS)  # warming up: a new LR each step
# A first loss scale above what this model's fp16 gradients hold: the first steps overflow and
# are skipped while GradScaler halves it ("the scale factor often causes infs/NaNs to appear in
# gradients for the first few iterations as its value calibrates", its docstring says of the
# default); a run that forgets the scale it found goes through that again.
INIT_SCALE = 2.0**20


class Run:
    """A fresh process's training: the project's step, state and schedule; with_scheduler: the
    schedule from a torch LR scheduler instead (built once the snapshot is loaded, as scripts
    build it), whose state no snapshot here holds."""

    def __init__(self, ids: torch.Tensor, vocab: int, with_scheduler: bool = False):
        self.ids, self.with_scheduler, self.scheduler = ids, with_scheduler, None
        model = tiny_gpt(vocab, dropout=0.2)
        self.strategy = build(model, optim=OPTIM, use_amp=True, amp_dtype="fp16")
        self.strategy.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        ctx = DistContext(0, 0, 1, CPU)
        self.state = TrainState(len(ids) - BLOCK, ctx, BATCH, 1, SEED, ControlPlane())
        torch.manual_seed(SEED)  # the training stream (dropout), seeded as Trainer.__init__ does

    def train(self, until: int) -> list[dict]:
        """Steps up to `until`: each one's loss, learning rate and loss scale."""
        optimizer, steps = self.strategy.optimizers[0], []
        if self.with_scheduler and self.scheduler is None:
            self.scheduler = LambdaLR(optimizer, lambda s: OPTIM.lr_scale(s, STEPS))
        while self.state.step < until:
            if self.scheduler is None:
                set_learning_rates(self.strategy.optimizers, OPTIM, self.state.step, STEPS)
            lr, scale = optimizer.param_groups[0]["lr"], self.strategy.scaler.get_scale()
            starts = self.state.data_cursor.next_starts(BATCH)  # (B,)
            loss, _ = train_step(self.strategy, iter([windows(self.ids, starts)]), 1)
            if self.scheduler is not None:
                self.scheduler.step()
            self.state.step += 1
            steps.append({"loss": loss.item(), "lr": lr, "scale": scale})
        return steps

    def snapshot(self) -> bytes:
        """Trainer.state_dict's snapshot (TrainState's, the strategy's meta and tensors) as the
        store writes it."""
        state = {
            **self.state.state_dict(),
            **self.strategy.snapshot_meta(),
            **self.strategy.tensor_state(),
        }
        return bytes(serialize(state))

    def restore(self, data: bytes, leave_out: str = "") -> None:
        """Trainer.load_state_dict, of the snapshot without the entry `leave_out` (a buggy
        checkpoint never held it). Without RNG states this process's stream stays as it was
        seeded (what a loader that never saved them does)."""
        state = load_bytes(data, map_location="cpu")
        state.pop(leave_out, None)
        self.strategy.load_tensor_state(state)
        self.strategy.load_snapshot_meta(state)  # no "scaler": the fresh GradScaler stays
        if "rng" not in state:
            state["rng"] = [{"cpu": torch.get_rng_state(), "cuda": None}]
        self.state.load_state_dict(state)


_straight: dict = {}


def straight_run(ids: torch.Tensor, vocab: int, scheduler: bool) -> tuple[list[dict], bytes]:
    """The uninterrupted run: its steps after SAVE_AT, and the snapshot it took at SAVE_AT (a
    periodic save, which changes nothing in the run); once per corpus and kind of schedule."""
    key = (id(ids), scheduler)
    if key not in _straight:
        run = Run(ids, vocab, scheduler)
        run.train(SAVE_AT)
        snapshot = run.snapshot()
        _straight[key] = run.train(STEPS), snapshot
    return _straight[key]


def resumed(ids: torch.Tensor, vocab: int, leave_out: str = "", scheduler: bool = False):
    """(uninterrupted steps after SAVE_AT, the same steps after a resume from SAVE_AT's snapshot
    in a fresh run) of the same code; the checkpoint without the entry `leave_out`."""
    straight, snapshot = straight_run(ids, vocab, scheduler)
    second = Run(ids, vocab, scheduler)
    second.restore(snapshot, leave_out)
    return straight, second.train(STEPS)


def equivalent(pair) -> bool:
    """The resume-equivalence check: every step after the resume as the uninterrupted run's."""
    straight, after = pair
    return [s["loss"] for s in straight] == [s["loss"] for s in after]


def loss_jump(pair) -> str:
    """Where the resumed curve departs furthest from the uninterrupted one."""
    straight, after = pair
    gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(straight, after)]
    at = max(range(len(gaps)), key=gaps.__getitem__)
    return (
        f"step {SAVE_AT + 1 + at}'s loss {after[at]['loss']:.4f} against "
        f"{straight[at]['loss']:.4f} uninterrupted"
    )


def curves(pair) -> list[str]:
    """The losses after the resume, both ways: the teaching output's lines."""
    return [
        f"steps {SAVE_AT + 1}-{STEPS}, {name:>13}: {[round(s['loss'], 4) for s in steps]}"
        for name, steps in zip(("uninterrupted", "resumed"), pair)
    ]


def skipped(steps: list[dict]) -> int:
    """Steps GradScaler skipped (fp16 gradients overflowed): the scale fell after them."""
    scales = [s["scale"] for s in steps]
    return sum(b < a for a, b in zip(scales, scales[1:]))


CHECK = (
    f"resume equivalence: {STEPS} steps straight against {SAVE_AT}, snapshot, resume in a "
    f"fresh run, {STEPS - SAVE_AT} more: every loss after the resume must be the same"
)


def project_resume(ids: torch.Tensor, vocab: int) -> tuple[list[dict], list[dict]]:
    """The project's own checkpoint, resumed: the run every resume exhibit must pass."""
    return resumed(ids, vocab)


def resume_without_scaler(ids: torch.Tensor, vocab: int) -> Row:
    bug, project = resumed(ids, vocab, leave_out="scaler"), project_resume(ids, vocab)
    return Row(
        "resume_without_scaler_state",
        f"the resumed GradScaler starts again at {bug[1][0]['scale']:.0f} instead of "
        f"{bug[0][0]['scale']:.0f}: {skipped(bug[1])} steps skipped after the resume "
        f"({skipped(bug[0])} uninterrupted); {loss_jump(bug)}",
        CHECK,
        not equivalent(bug),
        equivalent(project),
        [
            "fp16's loss scale is found by trial (halved on every overflow, a skipped step);",
            "forgetting it pays the search again and shifts the whole curve after the resume.",
            *curves(bug),
        ],
    )


def resume_without_rng(ids: torch.Tensor, vocab: int) -> Row:
    bug, project = resumed(ids, vocab, leave_out="rng"), project_resume(ids, vocab)
    return Row(
        "resume_without_rng_state",
        f"dropout replays the masks of step 1 on: {loss_jump(bug)}",
        CHECK,
        not equivalent(bug),
        equivalent(project),
        [
            "The resumed process seeds its generator as a new run does, so its dropout masks",
            "repeat those of the first steps instead of continuing the stream.",
            *curves(bug),
        ],
    )


def resume_without_lr_schedule(ids: torch.Tensor, vocab: int) -> Row:
    bug, project = resumed(ids, vocab, scheduler=True), project_resume(ids, vocab)
    straight, after = bug
    return Row(
        "resume_without_lr_schedule",
        f"the learning rate of step {SAVE_AT + 1} is {after[0]['lr']:.2e} after the resume "
        f"against {straight[0]['lr']:.2e} uninterrupted (the scheduler counts from 0 again); "
        f"{loss_jump(bug)}",
        CHECK,
        not equivalent(bug),
        equivalent(project),
        [
            "An LR scheduler is state: unsaved, it starts warmup over from step 0 after every",
            "resume. The project keeps no scheduler; the step decides the rate.",
            *curves(bug),
        ],
    )
