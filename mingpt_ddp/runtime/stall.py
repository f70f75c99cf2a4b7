"""The stall report: when no step completes for trainer_config.stall_report_s, every rank writes
where it is, and rank 0 prints one line naming the rank that is behind, before the collective
timeout ends the attempt.

A hang prints nothing. Every rank waits inside a collective for one rank that never arrives
(stopped, stuck in I/O, inside another collective), until collective_timeout_s ends the attempt
with an error that names no culprit. So each rank runs a watcher thread, apart from the training
thread, that every second publishes a heartbeat to the job's key-value store: a counter, the step,
and how many collectives this rank has entered (torch's flight recorders: the CPU one, gloo's, and
on GPU jobs NCCL's own as well). A process that is stopped (SIGSTOP, a debugger) or frozen stops
heartbeating with it. On a GPU the training thread runs ahead of the device (kernels and NCCL
collectives are queued, not waited for), so there a step counts as finished only once a CUDA event
recorded at its end has passed: the watcher queries it, without blocking, every period. When no
step has finished for stall_report_s:

- every rank that can writes stall/rank_R.txt beside the metrics: its step, its last collectives
  and the Python stack of every thread (faulthandler: the training thread's stack shows the
  collective it waits in);
- rank 0 names the rank that is behind: one whose heartbeat stopped ("silent"), else the one that
  entered the fewest collectives (the others wait for it in the next), else the lowest step.
"""

from __future__ import annotations

import collections
import faulthandler
import json
import os
import threading
import time

import torch
import torch.distributed as dist

PERIOD_S = 1.0  # how often each watcher heartbeats
SILENT_S = 3 * PERIOD_S  # a rank whose heartbeat has not moved for this long is stopped


# The flight recorders each device type's collectives are in: gloo's (CPU tensors) in the CPU one;
# a GPU job's default group is "cuda:nccl,cpu:gloo" (distributed.backend_for), its NCCL
# collectives in NCCL's own recorder (FlightRecorder<at::cuda::CUDAEvent>), which CPU builds lack.
RECORDERS = {
    "cpu": ("_dump_fr_trace_json",),
    "cuda": ("_dump_nccl_trace_json", "_dump_fr_trace_json"),
}


def _recorded(dump_name: str, names: bool) -> tuple[int, list[dict]] | None:
    """How many collectives of the default group (pg 0) one recorder saw enqueued (its sequence
    numbers start at 1: none is 0) and its entries; None if this torch lacks it or it fails."""
    try:
        from torch._C import _distributed_c10d

        trace = json.loads(getattr(_distributed_c10d, dump_name)(includeCollectives=names))
    except Exception:  # noqa: BLE001 - no such recorder (a CPU build, an older torch): no count
        return None
    status = trace.get("pg_status", {}).get("0", {})
    entries = [e for e in trace.get("entries", []) if e.get("pg_id") == 0]
    return max(int(status.get("last_enqueued_collective", 0)), 0), entries


def collectives(names: bool = False, device_type: str = "cpu") -> tuple[int, list[str]]:
    """How many collectives of the default group this rank has entered, and with names, the
    names of its last few. torch's flight recorders keep them (2000 entries by default in torch
    2.13, gloo's too; setup_distributed sets TORCH_FR_BUFFER_SIZE for older torch). On CUDA jobs
    NCCL's recorder and the CPU one (gloo's control plane) are added up: a rank behind in either
    is behind. -1 where no recorder could be read (an older torch)."""
    read = [r for d in RECORDERS.get(device_type, ()) if (r := _recorded(d, names)) is not None]
    if not read:
        return -1, []
    entries = sorted(
        (e for _, some in read for e in some), key=lambda e: e.get("time_created_ns", 0)
    )
    last = [f"#{e['collective_seq_id']} {e['profiling_name']}" for e in entries]
    return sum(count for count, _ in read), last[-5:]


def cuda_event():
    """An event recorded now on the current CUDA stream: it passes when the work queued before it
    (the step's kernels, and the NCCL work that stream waits for) is done."""
    event = torch.cuda.Event()
    event.record()
    return event


def attempt_store(ctx) -> dist.Store | None:
    """This attempt's own key space in the launcher's store (None for one process): heartbeats a
    dead attempt left there are never read."""
    from mingpt_ddp.runtime import distributed

    if distributed._JOB_STORE is None:
        return None
    return dist.PrefixStore(f"attempt_{ctx.restart_count}/stall", distributed._JOB_STORE)


class StallWatch:
    """Watches the training thread's steps from a thread of its own (start/stop, or `with`)."""

    def __init__(
        self, after_s: float, ctx, out_dir: str, store: dist.Store | None = None, event=None
    ):
        self.after_s, self.rank, self.world_size = after_s, ctx.rank, ctx.world_size
        self.out_dir, self.store = out_dir, store  # store: this attempt's; None: one process
        self.device = torch.device(ctx.device)
        # On a GPU a step's end is an event (event(): one recorded now, with .query()); the
        # watcher counts the step finished when it has passed. pending: (step, event), oldest first
        self.event = (event or cuda_event) if self.device.type == "cuda" else None
        self.pending: collections.deque = collections.deque()
        self.watching = False  # the watcher thread runs: only then are events kept
        self.step, self.reported, self.beats = 0, False, 0
        self.last, self.seen = time.monotonic(), {}  # both set again when the loop starts
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def __enter__(self) -> StallWatch:
        """Start watching: the clock starts here, at the loop, not at start-up (a snapshot read,
        a heal, compilation before the first step are no stall)."""
        self.last = time.monotonic()
        # seen (rank 0): rank -> (its last counter, since when); one never heard is silent too
        self.seen = {r: (None, self.last) for r in range(self.world_size)}
        if self.after_s > 0:
            self.watching = True
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def beat(self, step: int) -> None:
        """The training thread queued a step. On CPU it is done: a few assignments, no lock
        needed. On a GPU an event marks its end, and the watcher counts it done once the event
        has passed (deque.append and popleft are thread-safe)."""
        if self.event is not None and self.watching:
            self.pending.append((step, self.event()))
        else:
            self._finished(step)

    def _finished(self, step: int) -> None:
        self.step, self.last, self.reported = step, time.monotonic(), False

    def _passed(self) -> None:
        """(watcher) The steps whose end event has passed are done; query() does not block."""
        done = None
        while self.pending and self.pending[0][1].query():
            done = self.pending.popleft()[0]
        if done is not None:
            self._finished(done)

    def _run(self) -> None:
        if self.device.type == "cuda":  # this thread's CUDA calls on this rank's GPU, not GPU 0
            torch.cuda.set_device(self.device)
        while not self._stop.wait(PERIOD_S):
            try:
                self._passed()
                self._publish()
                waited = time.monotonic() - self.last
                if waited > self.after_s and not self.reported and self._sure(waited):
                    self.reported = True
                    self._report()
            except Exception as e:  # noqa: BLE001 - a watcher must never end the training
                # Mostly the store is gone (its host, torchrun's agent or rank 0, died): say so
                # once, in one line (the C++ error carries a stack trace), and watch no more.
                said = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
                print(f"stall | rank {self.rank} | watcher stopped: {said}", flush=True)
                self.watching = False  # steps count as done when queued again: no events pile up
                return

    def _sure(self, waited: float) -> bool:
        """Whether rank 0 can say who is behind: a rank that stopped just before the stall began
        needs 3 periods to look silent, so without a silent rank rank 0 waits that long more."""
        return self.rank != 0 or waited > self.after_s + SILENT_S or bool(self.silent())

    def _publish(self) -> None:
        """This rank's heartbeat: a counter (a stopped process stops it), step, collectives."""
        if self.store is None:
            return
        self.beats += 1
        entered = collectives(device_type=self.device.type)[0]
        self.store.set(str(self.rank), json.dumps([self.beats, self.step, entered]))
        if self.rank == 0:  # keep, per rank, since when its counter last moved
            now = time.monotonic()
            for r, beat in self._heartbeats().items():
                if self.seen.get(r, (None,))[0] != beat[0]:
                    self.seen[r] = (beat[0], now)

    def _heartbeats(self) -> dict[int, list[int]]:
        keys = [str(r) for r in range(self.world_size)]
        # One round trip when every rank has published (the usual case), one per key otherwise.
        present = keys if self.store.check(keys) else [k for k in keys if self.store.check([k])]
        return {int(k): json.loads(v) for k, v in zip(present, self.store.multi_get(present))}

    def _report(self) -> None:
        waited = time.monotonic() - self.last
        path = self._write_where()
        if self.rank == 0:
            print(f"stall | no step for {waited:.0f} s after step {self.step} | "
                  f"{self.behind()} | stacks: {os.path.dirname(path)}/", flush=True)  # fmt: skip

    def _write_where(self) -> str:
        """stall/rank_R.txt: this rank's step, last collectives and every thread's stack."""
        os.makedirs(os.path.join(self.out_dir, "stall"), exist_ok=True)
        path = os.path.join(self.out_dir, "stall", f"rank_{self.rank}.txt")
        entered, last = collectives(names=True, device_type=self.device.type)
        with open(path, "w") as f:
            f.write(f"rank {self.rank} | step {self.step} | collectives entered {entered}\n")
            f.write("last collectives: " + ", ".join(last) + "\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        return path

    def silent(self) -> list[int]:
        """The ranks whose heartbeat counter has not moved for SILENT_S (rank 0's view)."""
        now = time.monotonic()
        return [r for r, (_, since) in sorted(self.seen.items()) if now - since > SILENT_S]

    def behind(self) -> str:
        """Who holds the others up: silent ranks, else fewest collectives, else the lowest step."""
        if self.store is None:
            return "one process: see its stack"
        now, beats, silent = time.monotonic(), self._heartbeats(), self.silent()
        if silent:
            ago = max(now - self.seen[r][1] for r in silent)
            return f"rank {', '.join(map(str, silent))} silent for {ago:.0f} s: stopped or frozen"
        for what, index in (("collectives entered", 2), ("step", 1)):
            values = {r: beat[index] for r, beat in beats.items()}
            low = min(values.values(), default=0)
            if low != max(values.values(), default=0):
                late = [r for r, v in values.items() if v == low]
                return f"rank {', '.join(map(str, late))} behind: {what} {low}, others more"
        return "every rank at the same step and collective: a shared wait (I/O, the store?)"
