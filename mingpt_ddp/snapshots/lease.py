"""One writer per snapshot path: a lease that names its holder, and a generation number that fences.

Why: two copies of one job on one snapshot path happen (a SLURM requeue whose predecessor
still runs, Kubernetes starting a replacement before the old pod is gone, a second person
re-running a command). Without a lease both train, overwrite each other's snapshots and
interleave their metrics, and the next resume silently mixes two runs.

The lease is one small object, lease.json, beside the snapshots:

    {"owner": "<job id>", "generation": 7, "host": "node3", "pid": 4242,
     "started": ..., "renewed": ..., "ttl_s": 60, ...}

Global rank 0 takes it before training and renews it every ttl/4 from a background thread.
Every change to it is a compare-and-swap (storage.write_if: If-Match on S3, a file lock on
local and shared filesystems), so of two jobs starting at once exactly one wins. A job may
take the lease when it is free, when it already holds it (a torchrun restart of the same
run), when it is stale (not renewed for ttl_s), or at once when its holder ran on this
machine and that process is gone (a SIGKILLed job's rerun does not wait). Otherwise it is
refused with the holder's host, process and the time the lease goes stale.

A lease alone cannot stop a holder that was paused (SIGSTOP, a VM freeze, a long swap storm)
past its lease and then wakes up believing it still holds it. So every take increments the
generation, a fencing token that only grows: the new holder writes it into latest.json at
once, and mingpt_ddp/snapshots/store.py refuses to commit a manifest from an older generation. The
paused job can then write nothing that counts, and stops with a fencing error when it next looks.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

from mingpt_ddp.snapshots.storage import Storage

LEASE = "lease.json"


class LeaseError(RuntimeError):
    """Another job holds the snapshot path, or this job lost it to another: the message says
    which."""


def _read_proc(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def process_start(pid: int) -> str:
    """When process pid started (clock ticks since boot, /proc/<pid>/stat field 22), or "" if it is
    gone. With the boot id it tells a live holder from a new process that reused its pid. A zombie
    (state Z) is gone too: it has exited, and only its parent has not yet collected its exit status,
    which for a killed torchrun worker whose agent was killed too waits on whichever process adopts
    it."""
    stat = _read_proc(f"/proc/{pid}/stat")
    fields = stat.rsplit(")", 1)[1].split() if stat else []  # after the name: state, ppid, ...
    return fields[19] if fields and fields[0] not in ("Z", "X") else ""


def this_process() -> dict:
    """Who is taking the lease: enough for a person to find the holder, and for a rerun on the
    same machine to see that the holder is gone."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": process_start(os.getpid()),
        "boot_id": _read_proc("/proc/sys/kernel/random/boot_id").strip(),
    }


def holder_is_gone(record: dict) -> bool:
    """True only when the holder ran on this machine (same host name and boot) and its process has
    exited. On another machine nothing can be known from here: only the lease's age tells."""
    me = this_process()
    if not me["boot_id"] or (record.get("host"), record.get("boot_id")) != (
        me["host"],
        me["boot_id"],
    ):
        return False
    return process_start(int(record.get("pid", -1))) != record.get("pid_start")


def _elapsed_clock() -> float:
    """Seconds on a clock that keeps counting while this process is stopped and while the machine is
    suspended (CLOCK_BOOTTIME on Linux): a holder must count its lease as spent across a laptop's
    sleep too, as the other jobs do."""
    return (
        time.clock_gettime(time.CLOCK_BOOTTIME)
        if hasattr(time, "CLOCK_BOOTTIME")
        else time.monotonic()
    )


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


class Lease:
    """The lease on one snapshot path, as held (or sought) by one job; used by global rank 0
    only."""

    def __init__(self, storage: Storage, url: str, owner: str, ttl_s: float, clock=time.time):
        self.storage, self.url, self.owner, self.ttl_s, self.clock = (
            storage,
            url,
            owner,
            ttl_s,
            clock,
        )
        self.generation = 0
        self._version: str | None = None  # of lease.json as we last wrote it
        self._record: dict = {}
        self._valid_until = 0.0  # _elapsed_clock() until which we know the lease is ours
        self._lost = ""  # why, once another job has taken it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ taking it
    def acquire(self, min_generation: int = 0) -> str:
        """Take the lease or raise LeaseError naming the holder. Returns how it was taken (for the
        log). min_generation: the generation latest.json records, so a deleted lease.json cannot
        reuse one."""
        for _ in range(3):  # a lost compare-and-swap means someone else moved: look again
            record, version = self._read()
            how = self._may_take(record)
            generation = max(int(record.get("generation", 0)) if record else 0, min_generation) + 1
            now = self.clock()
            new = {
                "owner": self.owner,
                "generation": generation,
                **this_process(),
                "started": now,
                "renewed": now,
                "ttl_s": self.ttl_s,
            }
            start = _elapsed_clock()
            written = self.storage.write_if(LEASE, json.dumps(new, indent=1).encode(), version)
            if written:
                self.generation, self._record, self._version = generation, new, written
                self._valid_until = start + self.ttl_s
                return how
        raise LeaseError(
            f"trainer_config.snapshot_path {self.url!r}: the lease kept changing "
            "while this job tried to take it; another job is starting on the same path"
        )

    def _read(self) -> tuple[dict | None, str | None]:
        data, version = self.storage.read_versioned(LEASE)
        if data is None:
            return None, None
        try:
            record = json.loads(data)
            return (record if isinstance(record, dict) else {}), version
        except ValueError:
            return (
                {},
                version,
            )  # unreadable: treated as free, but still replaced by compare-and-swap

    def _may_take(self, record: dict | None) -> str:
        if not record or record.get("released"):
            return "free"
        if record.get("owner") == self.owner:
            return f"held by this job already (generation {record.get('generation')}): a restart"
        renewed, ttl = float(record.get("renewed", 0)), float(record.get("ttl_s", 0))
        if self.clock() > renewed + ttl:
            return (
                f"stale since {_when(renewed + ttl)} "
                f"(job {record.get('owner')} on {record.get('host')})"
            )
        if holder_is_gone(record):
            return f"its holder, pid {record.get('pid')} on this machine, has exited"
        raise LeaseError(
            f"trainer_config.snapshot_path {self.url!r} is in use by another job: "
            f"{record.get('owner')} (host {record.get('host')}, pid {record.get('pid')}, "
            f"since {_when(float(record.get('started', 0)))}); "
            f"its lease goes stale at {_when(renewed + ttl)} if that job stops; "
            "stop it, or give this run its own trainer_config.run_dir"
        )

    # ------------------------------------------------------------- keeping it
    def start_renewing(self) -> None:
        """Renew every ttl/4 in a daemon thread, so a long step or evaluation never lets it
        lapse."""
        self._thread = threading.Thread(target=self._renew_loop, name="lease-renewal", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self._renew()
            except Exception:  # noqa: BLE001 - storage down for now: check() reports it if it lasts
                pass
            if self._lost:
                return

    def _renew(self) -> None:
        with self._lock:
            if self._lost:
                return
            start = _elapsed_clock()
            record = {**self._record, "renewed": self.clock()}
            written = self.storage.write_if(
                LEASE, json.dumps(record, indent=1).encode(), self._version
            )
            if written:
                self._record, self._version = record, written
                self._valid_until = start + self.ttl_s
                return
            current, _ = self._read()
            current = current or {}
            self._lost = (
                f"this job lost the lease on trainer_config.snapshot_path {self.url!r} to job "
                f"{current.get('owner')} (host {current.get('host')}, pid {current.get('pid')}, "
                f"generation {current.get('generation')}) "
                f"while it was not renewed for {self.ttl_s:g} s (paused or cut off); "
                "stopping without writing, the other job's snapshots stand"
            )

    def check(self) -> None:
        """Raise LeaseError if another job has taken the lease. Cheap while the last renewal is
        recent; past it (this process was paused, or renewals kept failing) it asks the storage
        first."""
        if not self._lost and _elapsed_clock() >= self._valid_until:
            try:
                self._renew()
            except Exception:  # noqa: BLE001 - storage unreachable: the manifest's fencing still guards commits
                pass
        if self._lost:
            raise LeaseError(self._lost)

    def release(self) -> None:
        """Mark the lease free at the end of the job, so the next run need not wait; only if still
        ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if not self._lost and self._version is not None:
                record = {**self._record, "released": True, "renewed": self.clock()}
                try:
                    self.storage.write_if(
                        LEASE, json.dumps(record, indent=1).encode(), self._version
                    )
                except Exception:  # noqa: BLE001 - it will go stale instead
                    pass
