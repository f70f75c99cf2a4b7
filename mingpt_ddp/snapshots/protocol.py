"""Saving and resuming training state: what a snapshot must agree with, when one is taken, and what
happens when a save fails or a stop signal comes.

store.py stores snapshots (files, manifest, integrity checks, fallback to an older one); the
training state says what it is (a Snapshottable: the Trainer). This module is the protocol
between them, on every rank:

- resume(): open the newest snapshot, refuse one of another model shape, vocabulary, optimizer or
  partitioning (naming the setting to change), and load it so every rank continues from the
  same step;
- save_and_vote(): after each step, snapshot when it is time, then one all-reduce through which
  every rank learns the Verdict: go on, a failed save (go on, retry at the next save point), too
  many failed saves or a lost lease (stop), or a stop signal on some rank (snapshot, then stop);
- stop_for(): the snapshot a stop signal asks for, and where a rerun resumes if it fails.
"""

from __future__ import annotations

import enum
import signal
import time
from dataclasses import dataclass
from typing import Any, Protocol

from torch.profiler import record_function

from mingpt_ddp.config.model import GPTConfig
from mingpt_ddp.config.schema import to_dict
from mingpt_ddp.errors import SnapshotError, SnapshotMismatch
from mingpt_ddp.runtime.distributed import ControlPlane, print0, warn0
from mingpt_ddp.snapshots.files import OpenSnapshot
from mingpt_ddp.snapshots.lease import LeaseError
from mingpt_ddp.snapshots.store import SnapshotStore


class Snapshottable(Protocol):
    """What the protocol needs of the training state (like torchtitan's Stateful, plus identity):
    the Trainer."""

    step: int

    def identity(self) -> dict[str, Any]:
        """{"gpt_config", "optimizer", "vocab"}: what a snapshot must match to be resumed."""

    def meta_state(self) -> dict[str, Any]:
        """Everything but the tensors (collective)."""

    def state_dict(self) -> dict[str, Any]:
        """meta_state() and the tensors: what a single-file snapshot holds."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def position(self) -> str:
        """Where a resumed run stands, in words: step, data position, world size then and now."""


class TensorFiles(Protocol):
    """How the tensors are laid out in a snapshot: the parallel strategy's part of the protocol."""

    files: str | None  # None: one file, written by rank 0; else the kind of files every rank writes

    def check_snapshot(self, snapshot: OpenSnapshot, where: str) -> None:
        """Refuse a snapshot of a partitioning this run cannot load (SnapshotMismatch)."""

    def write_files(self, stage: str) -> str: ...

    def read_tensors(self, snapshot: OpenSnapshot) -> dict[str, Any]: ...


class Verdict(enum.IntEnum):
    """What every rank does after a step; the vote takes the largest over the ranks."""

    GO_ON = 0
    STOP = 1  # a stop signal on some rank: snapshot, then stop
    SAVE_FAILED = 2  # go on, and try again at the next save point
    SAVES_FAILING = 3  # too many in a row, or the last save: stop
    LEASE_LOST = 4  # another job owns the snapshot path: stop, writing nothing


@dataclass(frozen=True)
class Vote:
    verdict: Verdict
    signal: int = 0  # with STOP: the signal some rank received


class Snapshots:
    """One run's snapshots: resume from the newest, save on schedule, vote on what a failure
    means."""

    def __init__(
        self,
        state: Snapshottable,
        tensors: TensorFiles,
        store: SnapshotStore,
        cfg,
        is_main: bool,
        control: ControlPlane,
        metrics,
    ):
        self.state, self.tensors, self.store, self.cfg = state, tensors, store, cfg
        self.is_main, self.control = is_main, control
        self.metrics = metrics  # where each save's stall is recorded
        self.failed_saves = 0  # save points in a row that wrote no snapshot (rank 0 counts)
        self._counted_since: dict | None = None  # the snapshot committed when the count started
        self.resumed_config: dict = {}  # the resumed snapshot's run config ({}: started fresh)

    def resume(self) -> None:
        """Continue from the newest usable snapshot, or start fresh. Collective: every rank ends at
        the same step."""
        # To CPU memory first: loading copies onto the parameters' device (or shards), and RNG
        # states must stay CPU tensors.
        with self.store.open_latest(map_location="cpu") as snapshot:
            state = None
            if snapshot is not None:
                self.check_compatible(snapshot)  # 1. the metadata: refuse another model or corpus
                state = {**snapshot.meta, **self.tensors.read_tensors(snapshot)}  # 2. the tensors
        steps = self.control.gather(state["step"] if state else None)
        if len(set(steps)) > 1:  # e.g. one node could not read the newest snapshot and fell back
            raise SnapshotError(
                f"ranks loaded different snapshots (steps {steps}) from {self.store.url!r}; "
                "check that every node sees the same snapshot storage "
                "(trainer_config.run_dir / snapshot_path)"
            )
        if state is None:
            print0(f"resume | no snapshot under {self.store.url} | starting fresh at step 0")
            self.metrics.truncate_after(
                0
            )  # records of an earlier run here are not this run's history
            return
        self.state.load_state_dict(state)
        self.resumed_config = state.get("config", {})  # the settings it was written under
        print0(f"resume | {self.state.position()} | from {self.store.url}")
        self.metrics.truncate_after(self.state.step)  # steps after the snapshot will be redone

    def check_compatible(self, snapshot: OpenSnapshot) -> None:
        """Refuse a snapshot of another model shape, optimizer, partitioning or vocabulary, naming
        what differs."""
        meta, mine, where = (
            snapshot.meta,
            self.state.identity(),
            f"snapshot under {self.store.url!r}",
        )
        # A field a snapshot does not name was added since it was written: it had the default's
        # meaning.
        saved_gpt = {**to_dict(GPTConfig()), **meta["config"]["gpt_config"]}
        mismatched = [
            f"{f} (snapshot {saved_gpt.get(f)!r}, config {mine['gpt_config'][f]!r})"
            for f in GPTConfig.SHAPE_FIELDS
            if saved_gpt.get(f) != mine["gpt_config"][f]
        ]
        if mismatched:
            raise SnapshotMismatch(
                f"{where} is for another model shape: {'; '.join(mismatched)}; "
                "use matching gpt_config/data_config settings or another "
                "trainer_config.run_dir"
            )
        saved = meta["config"].get("optimizer_config", {}).get("optimizer", "adamw")
        if saved != mine["optimizer"]:
            raise SnapshotMismatch(
                f"{where} holds {saved} state, and this run uses {mine['optimizer']}; resume with "
                f"optimizer_config.optimizer={saved}, or use another trainer_config.run_dir"
            )
        self.tensors.check_snapshot(snapshot, where)
        if meta["vocab"] != mine["vocab"]:
            raise SnapshotMismatch(
                f"{where} was trained on a different vocabulary; use the same "
                "data_config.path or another trainer_config.run_dir"
            )

    def save_and_vote(self, last: bool, stop_signal: int | None) -> Vote:
        """Snapshot if it is time, then one all-reduce through which every rank learns whether rank
        0 lost the snapshot path to another job (all stop), whether a save failed (all go on, or all
        raise when rank 0 has counted too many in a row) or whether a rank received SIGTERM/SIGINT
        (all stop after a snapshot)."""
        if self.store.last_committed is not self._counted_since:  # a snapshot landed: count anew
            self._counted_since, self.failed_saves = self.store.last_committed, 0
        failure, mine = None, Verdict.GO_ON
        try:
            if self.is_main:
                # A paused job woken after losing its lease writes nothing more.
                self.store.check_owner()
            if self.state.step % self.cfg.save_every == 0 or last:
                self.save(block=last)
            if self.is_main:
                # A failed background save counts as a failed save point.
                self.store.raise_if_failed()
        except LeaseError as e:
            failure, mine = e, Verdict.LEASE_LOST
        except SnapshotError as e:
            failure, mine = e, self._count_failed_save(last)
        stopping = stop_signal if stop_signal and not last else 0
        if mine == Verdict.GO_ON and stopping:
            mine = Verdict.STOP
        verdict, signum = self.control.max([mine, stopping])
        return self._act_on(Vote(Verdict(verdict), signum), failure, last)

    def _act_on(self, vote: Vote, failure: Exception | None, last: bool) -> Vote:
        """Raise for the verdicts that end the run here; warn for a failed save; else the vote."""
        if vote.verdict == Verdict.LEASE_LOST:
            raise (
                failure
                if isinstance(failure, LeaseError)
                else LeaseError("rank 0 lost the snapshot path to another job")
            )
        if vote.verdict == Verdict.SAVES_FAILING:
            raise SnapshotError(self._failed_save_message(failure, last, fatal=True))
        if vote.verdict == Verdict.SAVE_FAILED:
            warn0(self._failed_save_message(failure, last, fatal=False))
            return Vote(Verdict.GO_ON)
        return vote

    def save(self, block: bool = False) -> float:
        """Save the current state; returns (and records in the metrics) the seconds training was
        stalled."""
        with record_function("snapshot"):  # a named region in a profiler trace (profiling.py)
            stalled = self._write(block)
        self.metrics.write(
            {"step": self.state.step, "event": "snapshot", "stall_ms": round(1e3 * stalled, 2)}
        )
        return stalled

    def _write(self, block: bool) -> float:
        t0, step, kind = time.perf_counter(), self.state.step, self.tensors.files
        if kind is not None:  # every rank writes its own files (shards, partitions), in parallel
            entry = self.store.save_files(
                self.tensors.write_files, self.state.meta_state(), step, self.is_main, kind
            )
            if entry:
                print0(
                    f"snapshot | step {step} | {entry['bytes'] / 1e6:.1f} MB "
                    f"in {len(entry['files'])} files ({kind}) | "
                    f"{time.perf_counter() - t0:.2f} s | "
                    f"{self.store.url}/{entry['file']}"
                )
            return time.perf_counter() - t0
        state = self.state.state_dict()  # every rank takes part in gathering the RNG states...
        if not self.is_main:  # ...but only global rank 0 writes: one snapshot per job, not per node
            return time.perf_counter() - t0
        if self.cfg.async_save and not block:
            self.store.save_async(state, step)
            print0(
                f"snapshot | step {step} | copied to CPU in {time.perf_counter() - t0:.3f} s, "
                "writing in the background"
            )
        else:
            self.store.wait()  # a background save still in flight must land first
            entry = self.store.save(state, step)
            print0(
                f"snapshot | step {step} | {entry['bytes'] / 1e6:.1f} MB | "
                f"{time.perf_counter() - t0:.2f} s | {self.store.url}/{entry['file']}"
            )
        return time.perf_counter() - t0

    def stop_for(self, signum: int) -> None:
        """Stopped by a signal on some rank: every rank saves the current step (if not just
        saved)."""
        print0(
            f"preempted | {signal.Signals(signum).name} received | "
            f"saving step {self.state.step}; rerun the same command to continue"
        )
        if self.state.step % self.cfg.save_every:
            try:
                self.save(block=True)
            except SnapshotError as e:  # nothing to go on with: say where a rerun starts
                raise SnapshotError(self._failed_save_message(e, last=True, fatal=True)) from None

    def _count_failed_save(self, last: bool) -> Verdict:
        """A save point whose snapshot was not written. The work since the last good snapshot is
        still in memory, so training goes on and the next save point tries again (a passing fault: a
        full disk being cleaned, S3 throttling), unless this was the last save or rank 0 has counted
        trainer_config.max_failed_saves in a row. Rank 0's count decides, for every rank."""
        self.failed_saves += 1
        fatal = last or self.failed_saves >= self.cfg.max_failed_saves
        return Verdict.SAVES_FAILING if fatal else Verdict.SAVE_FAILED

    def _failed_save_message(self, error: Exception | None, last: bool, fatal: bool) -> str:
        committed = self.store.last_committed
        resume = (
            f"step {committed['step']} ({self.store.url}/{committed['file']})"
            if committed
            else "step 0 (no snapshot yet)"
        )
        error = error or "a snapshot save failed on another rank"
        if fatal:
            why = (
                "the last save of this run failed"
                if last
                else f"{self.failed_saves} saves in a row failed"
            )
            return f"{why} ({error}); a rerun resumes from {resume}"
        return (
            f"{error}; training goes on and tries again at the next save point "
            f"({self.failed_saves} of trainer_config.max_failed_saves={self.cfg.max_failed_saves} "
            f"in a row); a rerun now would resume from {resume}"
        )
