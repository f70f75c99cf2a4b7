"""Saving and resuming a Trainer: what a snapshot must agree with, when one is taken, and what happens
when a save fails or a stop signal comes.

store.py stores snapshots (files, manifest, integrity checks, fallback to an older one); the
Trainer says what its state is (Trainer.state_dict / load_state_dict: model, optimizers, step, data
position, every rank's random streams). This module is the protocol between them, on every rank:

- resume(): open the newest snapshot, refuse one of another model shape, vocabulary, optimizer or
  partitioning (naming the setting to change), load it so every rank continues from the same step,
  and keep the global batch when the world size changed;
- save_and_vote(): after each step, snapshot when it is time, then one all-reduce through which every
  rank learns whether to go on: a failed save (go on, retry at the next save point), too many failed
  saves or a lost lease (stop), or a stop signal on any rank (snapshot, then stop);
- stop_for(): the snapshot a stop signal asks for, and where a rerun resumes if it fails.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from mingpt_ddp.config.schema import to_dict
from mingpt_ddp.runtime.distributed import all_gather_objects, max_over_ranks, print0, warn0
from mingpt_ddp.snapshots.lease import LeaseError
from mingpt_ddp.config.model import GPTConfig
from mingpt_ddp.snapshots.store import SnapshotError, SnapshotMismatch, dcp_writer

# The stop vote's values for a failed save, for saves that keep failing, and for a lost lease;
# signal numbers (SIGTERM 15, SIGINT 2) are below them.
SAVE_FAILED = 1000  # and go on
SAVES_FAILING = 1001  # too many in a row, or the last save: stop
LEASE_LOST = 1002


class Checkpointer:
    """One Trainer's snapshots: resume from the newest, save on schedule, vote on what a failure means."""

    def __init__(self, trainer: Any):  # the story's Trainer (trainer.py), read and set by attribute
        self.trainer, self.store = trainer, trainer.store
        self.cfg, self.ctx = trainer.cfg, trainer.ctx
        self.failed_saves = 0  # save points in a row whose snapshot could not be written (rank 0 counts)
        self._counted_since: dict | None = None  # the snapshot committed when the count last started

    def resume(self) -> None:
        """Continue from the newest usable snapshot, or start fresh. Collective: every rank must end at the same step."""
        # To CPU memory first: set_state_dict copies onto the parameters' device (or shards
        # for FSDP), and RNG states must stay CPU tensors.
        with self.store.open_latest(map_location="cpu") as snapshot:
            state = None
            if snapshot is not None:
                self.check_compatible(snapshot.meta)  # 1. the metadata: refuse another model or corpus
                # 2. the tensors: a sharded snapshot is loaded straight into this run's own layout;
                # DeepSpeed's engine reads its own files (each rank its partition).
                if self.trainer.zero:
                    self.trainer.zero.load(snapshot.directory)
                    tensors = {}
                else:
                    tensors = snapshot.tensors(into=self.trainer.tensor_state() if snapshot.sharded else None)
                state = {**snapshot.meta, **tensors}
        steps = all_gather_objects(state["step"] if state else None)
        if len(set(steps)) > 1:  # e.g. one node could not read the newest snapshot and fell back
            raise SnapshotError(f"ranks loaded different snapshots (steps {steps}) from {self.store.url!r}; "
                                "check that every node sees the same snapshot storage (trainer_config.run_dir / "
                                "snapshot_path)")
        if state is None:
            print0(f"resume | no snapshot under {self.store.url} | starting fresh at step 0")
            self.trainer.metrics.truncate_after(0)  # records of an earlier run here are not this run's history
            return
        self.trainer.load_state_dict(state)
        print0(f"resume | step {self.trainer.step} | epoch {self.trainer.data_cursor.epoch} | "
               f"{self.trainer.data_cursor.samples_consumed} samples into the epoch "
               f"| saved at world size {state['world_size']}, now {self.ctx.world_size} | from {self.store.url}")
        if state["global_batch"] != self.cfg.batch_size * self.ctx.world_size * self.trainer.accum_steps:
            self._keep_global_batch(state["global_batch"])
        self.trainer.metrics.truncate_after(self.trainer.step)  # steps after the snapshot will be redone

    def check_compatible(self, meta: dict[str, Any]) -> None:
        """Refuse a snapshot of another model shape, optimizer, partitioning or vocabulary, naming what differs."""
        # A field a snapshot does not name was added since it was written: it had the default's meaning.
        saved_gpt = {**to_dict(GPTConfig()), **meta["config"]["gpt_config"]}
        current = self.trainer.raw_model.config
        mismatched = [f"{f} (snapshot {saved_gpt.get(f)!r}, config {getattr(current, f)!r})"
                      for f in GPTConfig.SHAPE_FIELDS if saved_gpt.get(f) != getattr(current, f)]
        if mismatched:
            raise SnapshotMismatch(
                f"snapshot under {self.store.url!r} is for another model shape: {'; '.join(mismatched)}; "
                "use matching gpt_config/data_config settings or another trainer_config.run_dir")
        saved_optimizer = meta["config"].get("optimizer_config", {}).get("optimizer", "adamw")
        if saved_optimizer != self.trainer.optim_cfg.optimizer:
            raise SnapshotMismatch(
                f"snapshot under {self.store.url!r} holds {saved_optimizer} state, and this run uses "
                f"{self.trainer.optim_cfg.optimizer}; resume with optimizer_config.optimizer={saved_optimizer}, or use another "
                "trainer_config.run_dir")
        self._check_same_partitioning(meta)
        if meta["vocab"] != self.trainer.dataset.tokenizer.chars:
            raise SnapshotMismatch(
                f"snapshot under {self.store.url!r} was trained on a different vocabulary; "
                "use the same data_config.path or another trainer_config.run_dir")

    def _check_same_partitioning(self, meta: dict[str, Any]) -> None:
        """DeepSpeed's files are its engine's, partitioned per rank: they resume with DeepSpeed, at the
        same ZeRO stage and world size (DDP and FSDP snapshots resume anywhere but under DeepSpeed)."""
        saved = meta.get("deepspeed")
        where = f"snapshot under {self.store.url!r}"
        if saved and not self.trainer.zero:
            raise SnapshotMismatch(f"{where} was written by DeepSpeed ZeRO-{saved['zero_stage']}; resume with "
                                   f"trainer_config.parallel=deepspeed deepspeed_config.zero_stage={saved['zero_stage']}, "
                                   "or export its weights with python -m mingpt_ddp.snapshots consolidate")
        if self.trainer.zero and not saved:
            raise SnapshotMismatch(f"{where} was written by parallel={meta['config']['trainer_config']['parallel']}, "
                                   "which DeepSpeed cannot load; resume with that, or use another trainer_config.run_dir")
        if self.trainer.zero and saved["zero_stage"] != self.trainer.zero.cfg.zero_stage:
            raise SnapshotMismatch(f"{where} was written by DeepSpeed ZeRO-{saved['zero_stage']}; resume with "
                                   f"deepspeed_config.zero_stage={saved['zero_stage']}")
        if self.trainer.zero and meta["world_size"] != self.ctx.world_size:
            raise SnapshotMismatch(f"{where} holds DeepSpeed partitions for {meta['world_size']} ranks, and this job "
                                   f"has {self.ctx.world_size}; resume with {meta['world_size']} ranks (nnodes x "
                                   "nproc_per_node), or export its weights with python -m mingpt_ddp.snapshots consolidate")

    def _keep_global_batch(self, global_batch: int) -> None:
        """At a new world size, keep the global batch (and so the meaning of a step and of the
        learning-rate schedule) by changing gradient accumulation; the per-rank batch stays."""
        per_micro_step = self.cfg.batch_size * self.ctx.world_size
        if global_batch % per_micro_step:
            warn0(f"global batch {global_batch} is not a multiple of batch_size x world size = {per_micro_step}; "
                  f"continuing with a global batch of {per_micro_step * self.trainer.accum_steps}")
            return
        self.trainer.accum_steps = global_batch // per_micro_step
        print0(f"resume | global batch kept at {global_batch} windows = "
               f"{self.cfg.batch_size} per rank x {self.ctx.world_size} ranks x {self.trainer.accum_steps} accumulation steps")

    def save_and_vote(self, last: bool) -> int:
        """Snapshot if it is time, then one all-reduce through which every rank learns whether rank 0 lost
        the snapshot path to another job (all stop), whether a save failed (all go on, or all raise when
        rank 0 has counted too many in a row) or whether a rank received SIGTERM/SIGINT (all stop after a
        snapshot). Returns 0 to go on, or the signal to stop for."""
        if self.store.last_committed is not self._counted_since:  # a snapshot landed: the count starts over
            self._counted_since, self.failed_saves = self.store.last_committed, 0
        failure, code = None, 0
        try:
            if self.ctx.is_main:
                self.store.check_owner()  # a paused job woken after losing its lease writes nothing more
            if self.trainer.step % self.cfg.save_every == 0 or last:
                self.save(block=last)
            if self.ctx.is_main:
                self.store.raise_if_failed()  # a background save that failed counts as a failed save point
        except LeaseError as e:
            failure, code = e, LEASE_LOST
        except SnapshotError as e:
            failure, code = e, self._count_failed_save(last)
        verdict = max_over_ranks(code or (0 if last else (self.trainer.stop_signal or 0)))
        if verdict == LEASE_LOST:
            raise failure if code == LEASE_LOST else LeaseError("rank 0 lost the snapshot path to another job")
        if verdict == SAVES_FAILING:
            raise SnapshotError(self._failed_save_message(failure, last, fatal=True))
        if verdict == SAVE_FAILED:
            warn0(self._failed_save_message(failure, last, fatal=False))
            return 0
        return verdict

    def save(self, block: bool = False) -> float:
        """Save the current state; returns (and records in the metrics) the seconds training was stalled."""
        stalled = self._write(block)
        self.trainer.metrics.write({"step": self.trainer.step, "event": "snapshot", "stall_ms": round(1e3 * stalled, 2)})
        return stalled

    def _write(self, block: bool) -> float:
        t0 = time.perf_counter()
        if self.trainer.sharded or self.trainer.zero:  # every rank writes its own shards (or DeepSpeed partitions), in parallel
            write, kind = (self.trainer.zero.save, "deepspeed") if self.trainer.zero else (dcp_writer(self.trainer.tensor_state()), "sharded")
            entry = self.store.save_sharded(write, self.trainer.meta_state(), self.trainer.step, self.ctx.is_main, kind)
            if entry:
                print0(f"snapshot | step {self.trainer.step} | {entry['bytes'] / 1e6:.1f} MB in {len(entry['files'])} files "
                       f"({kind}) | {time.perf_counter() - t0:.2f} s | {self.store.url}/{entry['file']}")
            return time.perf_counter() - t0
        state = self.trainer.state_dict()  # every rank takes part in gathering the RNG states...
        if self.ctx.is_main:  # ...but only global rank 0 writes: one snapshot per job, not per node
            if self.cfg.async_save and not block:
                self.store.save_async(state, self.trainer.step)
                print0(f"snapshot | step {self.trainer.step} | copied to CPU in {time.perf_counter() - t0:.3f} s, "
                       "writing in the background")
            else:
                self.store.wait()  # a background save still in flight must land first
                entry = self.store.save(state, self.trainer.step)
                print0(f"snapshot | step {self.trainer.step} | {entry['bytes'] / 1e6:.1f} MB | "
                       f"{time.perf_counter() - t0:.2f} s | {self.store.url}/{entry['file']}")
        return time.perf_counter() - t0

    def stop_for(self, signum: int) -> None:
        """Stopped by a signal on some rank: every rank saves the current step (if not just saved)."""
        self.trainer.stop_signal = signum
        print0(f"preempted | {signal.Signals(signum).name} received | "
               f"saving step {self.trainer.step}; rerun the same command to continue")
        if self.trainer.step % self.cfg.save_every:
            try:
                self.save(block=True)
            except SnapshotError as e:  # nothing to go on with: say where a rerun starts
                raise SnapshotError(self._failed_save_message(e, last=True, fatal=True)) from None

    def _count_failed_save(self, last: bool) -> int:
        """A save point whose snapshot was not written. The work since the last good snapshot is still in
        memory, so training goes on and the next save point tries again (a passing fault: a full disk
        being cleaned, S3 throttling), unless this was the last save or rank 0 has counted
        trainer_config.max_failed_saves in a row. Rank 0's count decides, for every rank."""
        self.failed_saves += 1
        return SAVES_FAILING if last or self.failed_saves >= self.cfg.max_failed_saves else SAVE_FAILED

    def _failed_save_message(self, error: SnapshotError | None, last: bool, fatal: bool) -> str:
        committed = self.store.last_committed
        resume = f"step {committed['step']} ({self.store.url}/{committed['file']})" if committed else \
            "step 0 (no snapshot yet)"
        error = error or "a snapshot save failed on another rank"
        if fatal:
            why = "the last save of this run failed" if last else f"{self.failed_saves} saves in a row failed"
            return f"{why} ({error}); a rerun resumes from {resume}"
        return (f"{error}; training goes on and tries again at the next save point ({self.failed_saves} of "
                f"trainer_config.max_failed_saves={self.cfg.max_failed_saves} in a row); a rerun now would "
                f"resume from {resume}")
