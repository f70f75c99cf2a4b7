"""The training loop: optimisation, evaluation, logging, and what state goes into a snapshot.

One Trainer runs in every process of the job. How the model is spread over the processes is
the strategy's (mingpt_ddp/parallel/: the grid of ranks and the ladder that wrapped the model):
under DDP each holds a full copy and DDP all-reduces the gradients during backward; under FSDP
each holds a shard. The step at the end of this file is the same on every layout.

Each data-parallel rank trains on a different shard of every global batch, as a DistributedSampler
would choose it (mingpt_ddp/corpus/order.py). The data position is *global samples consumed in this
epoch* (DataCursor), whatever the world size: a snapshot taken with 4 ranks resumes with 2.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import record_function as region

from char_dataset import CharDataset, to_device
from mingpt_ddp.config.deepspeed import DeepSpeedConfig
from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.config.trainer import TrainerConfig
from mingpt_ddp.metrics import (
    LogWindow,
    MetricsLog,
    ProgressLine,
    format_duration,
    peak_memory,
    report_optimizer_memory,
)
from mingpt_ddp.optim import schedule_change, set_learning_rates
from mingpt_ddp.parallel.plan import Plan, dropout_streams, replica, set_tf32
from mingpt_ddp.parallel.registry import build_strategy
from mingpt_ddp.parallel.strategy import Batch, Strategy, StrategyArgs
from mingpt_ddp.runtime.distributed import ControlPlane, DistContext, print0
from mingpt_ddp.runtime.profiling import StepProfiler
from mingpt_ddp.runtime.signals import StopSignals
from mingpt_ddp.runtime.stall import StallWatch, attempt_store
from mingpt_ddp.runtime.straggler import StepTimes
from mingpt_ddp.snapshots.protocol import Snapshots, Verdict
from mingpt_ddp.snapshots.store import SnapshotStore
from mingpt_ddp.train_state import StartsTrace, TrainState
from model import GPT


class Trainer:
    def __init__(
        self,
        model: GPT,
        dataset: CharDataset,
        trainer_cfg: TrainerConfig,
        optim_cfg: OptimizerConfig,
        ctx: DistContext,
        run_config: dict[str, Any],
        store: SnapshotStore,
        deepspeed_cfg: DeepSpeedConfig | None = None,
        modes: dict[str, Any] | None = None,
    ):
        self.cfg, self.optim_cfg, self.ctx, self.store = trainer_cfg, optim_cfg, ctx, store
        self.dataset, self.run_config, self.device = dataset, run_config, ctx.device
        c, self.control = trainer_cfg, ControlPlane()
        # modes: the sections of the parallelisms (mesh, pipeline, tensor, context, torchft)
        plan = Plan.of(c, ctx.device, **(modes or {}))  # "auto" precision decided
        # How far the run has got (step, data position, val loss, RNG): what a resume restores.
        self.state = self._train_state(len(dataset.train), plan)
        self.num_params = model.num_params()  # now: ZeRO-3 empties the parameters it partitions
        self.strategy = self._build_strategy(model, plan, deepspeed_cfg or DeepSpeedConfig())
        self.model, self.block_size = self.strategy.model, model.config.block_size  # FSDP: shards
        self.times = StepTimes(c.straggler_factor, ctx, self.control, self.model)  # data, forward
        torch.manual_seed(c.seed + self.state.stream)  # one seed, a stream each (_train_state)
        files = (c.metrics_file, c.tensorboard_dir) if ctx.is_main else ("", "")  # rank 0 writes
        self.metrics = MetricsLog(*files, still_owner=store.owns_path)
        self.stops = StopSignals(c.collective_timeout_s)  # SIGTERM/SIGINT: step, snapshot, exit
        # No step for stall_report_s: every rank writes where it is, rank 0 names the late one.
        self.stall = StallWatch(c.stall_report_s, ctx, c.run_dir, attempt_store(ctx))
        self.trace = StartsTrace(c.trace_samples_path, ctx.rank)  # which windows each step read
        self.profiler = StepProfiler(c.profile_steps, c.run_dir, ctx.rank, ctx.device)
        # Resume, periodic saves, and what a failed save or a signal means (states: this Trainer).
        self.snapshots = Snapshots(
            self, self.strategy, store, c, ctx.is_main, self.control, self.metrics
        )

    def _train_state(self, num_windows: int, plan: Plan) -> TrainState:
        """The run's progress, its replica's data share, each rank's dropout stream (plan.py)."""
        c, ctx = self.cfg, self.ctx
        share = replica(ctx.rank, ctx.world_size, plan)
        args = (num_windows, ctx, c.batch_size, c.grad_accum_steps, c.seed, self.control, share)
        return TrainState(*args, streams=dropout_streams(plan, ctx.world_size))

    def _build_strategy(self, model: GPT, plan: Plan, ds: DeepSpeedConfig):
        """The layout the config names, around the model moved to this rank's device."""
        set_tf32(plan, self.device)
        c = self.cfg
        args = (plan, self.ctx, self.optim_cfg, c.batch_size, c.grad_accum_steps, self.control)
        return build_strategy(c.parallel, model.to(self.device), StrategyArgs(*args, ds))

    step = property(lambda self: self.state.step)
    stop_signal = property(lambda self: self.stops.received)  # int | None

    # ------------------------------------------------------------ snapshot state
    def identity(self) -> dict[str, Any]:
        """What a snapshot must match to be resumed here: model shape, optimizer, vocabulary."""
        chars, optimizer = self.dataset.tokenizer.chars, self.optim_cfg.optimizer
        return {"gpt_config": vars(self.model.config), "optimizer": optimizer, "vocab": chars}

    def meta_state(self) -> dict[str, Any]:
        """Everything but the tensors, needed to continue exactly; collective (gathers RNG)."""
        return {
            **self.state.state_dict(),  # step, data position, val loss, global batch, RNG
            **self.strategy.snapshot_meta(),  # "scaler" (fp16's loss scale), "deepspeed"
            "config": self.run_config,
            "vocab": self.dataset.tokenizer.chars,
        }

    def position(self) -> str:  # where a resumed run stands, in words
        return self.state.position()

    def state_dict(self) -> dict[str, Any]:
        """The whole snapshot as one dict (what a single-file snapshot holds)."""
        return {**self.meta_state(), **self.strategy.tensor_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Everything a snapshot restores; model and optimizer if given (DeepSpeed loads its)."""
        if "model" in state:
            self.strategy.load_tensor_state(state)
        self.strategy.load_snapshot_meta(state)
        self.state.load_state_dict(state)

    # --------------------------------------------------------------------- data
    def _next_batch(self) -> Batch:
        starts = self.state.data_cursor.next_starts(self.cfg.batch_size)  # (B,) this rank's windows
        self.trace.write(self.state.step + 1, self.state.data_cursor.epoch, starts)
        return to_device(self.device, self.dataset.train.ids(starts))

    def _batches(self, n: int) -> Iterator[Batch]:
        """The next n micro-batches, read as the strategy asks for them (timed: data_ms)."""
        for _ in range(n):
            t0 = time.perf_counter()
            batch = self._next_batch()
            self.times.data_s += time.perf_counter() - t0
            yield batch

    # ------------------------------------------------------------------ training
    def evaluate(self) -> float:
        """Mean validation loss over a fixed, evenly spaced set of windows, averaged over all ranks.
        Its cost depends on eval_iters, batch size and world size, not on the corpus."""
        B, n_iters, val = self.cfg.batch_size, self.cfg.eval_iters, self.dataset.val
        share, W = self.strategy.evaluation_share(self.state.replica, self.state.replicas)
        starts = val.evenly_spaced(n_iters * B * W)[share::W]  # its share (its replica's)
        return self.strategy.evaluate(
            to_device(self.device, val.ids(starts[i * B : (i + 1) * B])) for i in range(n_iters)
        )

    def _sample(self) -> str:
        tok = self.dataset.tokenizer
        prompt = tok.encode("\n" if "\n" in tok.stoi else tok.chars[0])[None].to(self.device)
        gen = torch.Generator(self.device).manual_seed(self.cfg.seed)  # training's RNG untouched
        model = self.strategy.sampling_model()  # a split model put together on rank 0 only
        if model is None:
            return ""
        out = model.generate(prompt, self.cfg.sample_chars, temperature=0.8, generator=gen)
        return tok.decode(out[0, 1:])

    def train_step(self) -> torch.Tensor | None:
        """One optimizer step; this rank's mean loss (on device), or None (a pipeline's early
        stages)."""
        s, n = self.strategy, self.state.accum_steps
        self._moved_to(s.begin_step(self.state.step, n))  # torchft: healed from a live peer?
        set_learning_rates(s.optimizers, self.optim_cfg, self.state.step, self.cfg.max_steps)
        loss, applied = step(s, self._batches(n), n, self.optim_cfg.grad_clip)
        if applied:  # a step the quorum did not commit (torchft) is not counted
            self.state.step += 1
        return loss

    def start(self) -> None:
        """Begin at a live torchft group's step if ahead (a heal), else at the newest snapshot."""
        if not self._moved_to(self.strategy.begin_step(self.state.step, self.state.accum_steps)):
            self.snapshots.resume()
            saved, step = self.snapshots.resumed_config, self.state.step
            if notice := schedule_change(saved, self.optim_cfg, self.cfg.max_steps, step):
                print0(notice)

    def _moved_to(self, step: int | None) -> bool:
        """Follow the strategy to another step (a heal); whether it moved."""
        if step is None:
            return False
        print0(f"heal | step {self.state.step} -> {step} | copied from a live replica group")
        self.state.jump_to(step)
        return True

    def train(self) -> bool:
        """Train to max_steps; False if stopped early by SIGTERM/SIGINT (after a snapshot)."""
        try:
            with self.stops, self.stall, self.profiler:
                finished = self._train_loop()
        finally:
            self.trace.close()
        if self.ctx.is_main:
            self.store.wait()  # the final save is on disk before the process exits
        if self.stops.handover and self.stop_signal == self.stops.handover[0]:
            print0("preempted | snapshot saved; submitit requeues this job, which resumes from it")
            self.stops.hand_over()  # scontrol requeue, then exit
        return finished

    # ------------------------------------------------------------------ the loop
    def _train_loop(self) -> bool:
        """Train to max_steps (or the target loss); False if a stop signal ended it early."""
        self._announce()
        if why := self.state.finished(self.cfg.max_steps, self.cfg.target_val_loss):
            print0(f"train | {why}")  # a rerun of a finished run trains nothing
            return True
        progress = ProgressLine(self.cfg.max_steps, enabled=self.ctx.is_main)
        window, t_start = LogWindow(self.state.step, self.device), time.perf_counter()
        while self.state.step < self.cfg.max_steps:
            step, loss = self.state.step, self.train_step()
            if self.state.step == step:  # torchft did not commit it: nothing to count, log or save
                continue
            window.add(loss)
            self.stall.beat(self.state.step)
            self.profiler.beat()  # trainer_config.profile_steps: a trace of a few steps
            if self.state.step == window.start_step + 1:  # AdamW's state exists from step 1
                report_optimizer_memory(self.strategy, self.control)
            progress.update(self.state.step)
            last = self.state.step == self.cfg.max_steps
            evaluate = self.state.step % self.cfg.eval_every == 0 or last
            if self.state.step % self.cfg.log_every == 0 or evaluate:
                progress.clear()  # _log: True when the target loss was reached
                last = self._log(window, t_start, evaluate) or last
            vote = self.snapshots.save_and_vote(last, self.stop_signal)
            if vote.verdict == Verdict.STOP:
                progress.clear()
                self.stops.received = vote.signal  # every rank stops for the signal some rank got
                self.snapshots.stop_for(vote.signal)
                return False
            if last:
                break
        progress.clear()
        print0(
            f"done | step {self.state.step} | {format_duration(time.perf_counter() - t_start)} "
            f"wall time this run | peak memory per rank {peak_memory(self.device, self.control)}"
        )
        return True

    def _announce(self) -> None:
        """The start-up line: what is about to train, how, and for how long."""
        cfg, W, batch = self.cfg, self.ctx.world_size, self.state.global_batch
        tokens, epochs = batch * self.block_size, cfg.max_steps * batch / len(self.dataset.train)
        mode, precision = self.strategy.describe()
        print0(
            f"train | {self.num_params / 1e6:.2f}M parameters | {mode} | {precision}"
            f"{' + compile' if cfg.compile else ''} | world size {W} | "
            f"global batch {self.state.global_batch} windows = {tokens} tokens | "
            f"steps {self.state.step}->{cfg.max_steps} (~{epochs:.2f} epochs)"
        )

    def _log(self, window: LogWindow, t_start: float, evaluate: bool) -> bool:
        """One log line (and metrics record) for the steps since the last; with evaluate, the
        validation loss and a sample too. Returns whether the target loss was reached."""
        cfg, step, steps = self.cfg, self.state.step, self.state.step - window.step
        train_loss = window.mean_loss(self.control)  # over ranks; .item() only on log steps
        now = time.perf_counter()
        dt_step = (now - window.time) / steps
        eta = (now - t_start) / (step - window.start_step) * (cfg.max_steps - step)
        record = {
            "step": step,
            "epoch": self.state.data_cursor.epoch,
            "train_loss": round(train_loss, 6),
            "lr": self.strategy.optimizers[0].param_groups[0]["lr"],
            "tokens_per_sec": round(self.state.global_batch * self.block_size / dt_step, 1),
            "ms_per_step": round(1e3 * dt_step, 2),
            "grad_norm": round(self.strategy.grad_norm(), 4),
            "data_ms": round(1e3 * self.times.data_s / steps, 3),
        }
        words = self.strategy.step_record(record)  # a mixture of experts' balance, or ""
        print0(
            f"step {step:>6}/{cfg.max_steps} | epoch {record['epoch']} | loss {train_loss:.4f} | "
            f"lr {record['lr']:.2e} | {record['tokens_per_sec'] / 1e3:.1f}k tok/s | "
            f"{record['ms_per_step']:.1f} ms/step | ETA {format_duration(eta)}{words}"
        )
        self.times.report(window.step + 1, step, dt_step)  # a rank slower than the others?
        reached = evaluate and self._evaluate_and_report(record)
        self.metrics.write(record)
        window.reset(step)
        return reached

    def _evaluate_and_report(self, record: dict) -> bool:
        """The val loss (and a sample) into record, and one line; whether the target is met."""
        record["val_loss"] = self.state.last_val_loss = round(self.evaluate(), 6)
        line = f"eval | step {self.state.step} | val loss {record['val_loss']:.4f}"
        # Where every rank must take part in each forward (FSDP all-gathers parameters), all
        # ranks generate the same sample; rank 0 prints it.
        if self.cfg.sample_chars and (self.ctx.is_main or self.strategy.forward_on_all_ranks):
            record["sample"] = self._sample()
            line += f" | sample: {record['sample']!r}"
        print0(line)
        target = self.cfg.target_val_loss  # every rank has the same all-reduced loss: all stop
        reached = bool(target) and record["val_loss"] <= target
        if reached:
            print0(
                f"target | val loss {record['val_loss']:.4f} <= trainer_config.target_val_loss "
                f"{self.cfg.target_val_loss} at step {self.state.step} | stopping"
            )
        return reached


# ---------------------------------------------------------------------------- the step
def step(s: Strategy, batches: Iterator[Batch], n: int, grad_clip: float) -> tuple[Any, bool]:
    """One optimizer step over n micro-batches, on any layout (nanoGPT's step): (this rank's mean
    loss or None, whether the step was applied)."""
    batches = map(s.local, batches)  # context parallel: this rank's tokens of each window
    if s.own_step is not None:  # an engine's own step (DeepSpeed): backward to update
        return s.own_step(batches, n)
    with s.forward_context():  # autocast; context parallelism's ring
        loss = s.pipeline.step(batches) if s.pipeline else micro_steps(s, batches, n)
    return loss, update(s, grad_clip)


def micro_steps(s: Strategy, batches: Iterator[Batch], n: int) -> torch.Tensor:
    """Forward and backward of each micro-batch, gradients summed in place; the mean loss."""
    loss = torch.zeros((), device=s.device)
    for micro, (x, y) in enumerate(batches):
        with region(f"micro-step {micro}"):  # region: a named span in a profiler trace
            # Gradient sync on the last micro-step only: DDP's no_sync, FSDP's reduce-scatter.
            with s.gradient_sync(micro == n - 1), region("forward"):
                _, micro_loss = s.train_model(x, y)
            with region("backward"):  # each micro-step's loss / n: the mean loss's gradients
                s.scaler.scale(micro_loss / n).backward()  # scale: a no-op unless fp16
            loss += micro_loss.detach() / n
    return loss


def update(s: Strategy, grad_clip: float) -> bool:
    """Clip and apply the step's gradients; whether it was applied."""
    with region("gradient sync"):  # engines that average after backward (Horovod, torchft)
        if not s.reduce_gradients():
            return False
    for optimizer in s.optimizers:  # unscale first: the clip threshold is for true gradients
        s.scaler.unscale_(optimizer)
    # The norm over the whole model, wherever its pieces are; inf: measure, do not clip.
    s.last_norm = s.clip(grad_clip or math.inf)
    with region("optimizer step"):
        for optimizer in s.optimizers:
            s.scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
            optimizer.zero_grad(set_to_none=True)  # free gradient memory, not zeros
        s.scaler.update()
    return True
