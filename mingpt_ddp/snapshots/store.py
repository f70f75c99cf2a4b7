"""Snapshot storage: where training state is written, and how it is committed and read back.

A snapshot is everything needed to continue a run as if it had never stopped:
model and optimizer state, step, epoch, position in the epoch, every rank's RNG
state, the config and the vocabulary. The Trainer builds that dict; this module
only stores and retrieves it, through one small interface:

    store = SnapshotStore("runs/x/snapshots", keep_last=3)
    store.check_writable()          # at start-up, before any training step
    store.acquire(owner, ttl_s)     # one writer per path: a lease, and a generation that fences
    store.save(state, step)         # commit a new snapshot
    with store.open_latest() as snapshot:   # the newest snapshot that passes its checks, or None
        snapshot.meta                       #   1. its metadata (step, config, vocabulary...)
        snapshot.tensors(into=...)          #   2. its tensors (DCP shards: into this run's layout)

Layout under the snapshot URL (a directory or URL prefix):

    snapshot_00000500.g1.pt   torch.save of the state dict (g1: written under lease generation 1)
    snapshot_00001000.g2.pt   (a later job on the same path holds generation 2)
    snapshot_00001500.g2.dcp/ FSDP: every rank's DCP shards + meta.pt (.zero/: DeepSpeed's files)
    latest.json               manifest: the committed snapshots, newest last, with size + sha256,
                              and the generation that last committed
    lease.json                who writes here now (mingpt_ddp/snapshots/lease.py)

Never lose work: a snapshot file is written completely (temp file, fsync, rename)
before the manifest that names it is replaced, and old snapshots are deleted only
after that. A crash at any moment leaves the previous manifest and the snapshots
it names intact. On load the newest snapshot is checked against its recorded
size and checksum; a damaged one is skipped with a warning, falling back to the
one before.

One writer per path: every commit is a compare-and-swap of latest.json that a job
holding an older lease generation cannot make (a paused job that lost its lease).
Saves ride out passing faults (a full disk being cleaned, S3 throttling): each is
tried again with backoff, and the Trainer goes on training if a periodic save
still fails, until too many fail in a row.

The manifest is untrusted input: snapshot directories get shared and downloaded.
Every entry is checked against the names this module writes before anything is
read or deleted (manifest.py), and storage.py refuses any name that leaves the root, so no
manifest can make a run touch a file outside its snapshot path. The lease is lease.py's.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from mingpt_ddp.errors import SnapshotError, SnapshotMismatch  # noqa: F401 - for its users
from mingpt_ddp.runtime.distributed import all_gather_objects, print0, warn0
from mingpt_ddp.snapshots.files import copy_to_cpu, fingerprint, serialize
from mingpt_ddp.snapshots.layout import META, FileLayout
from mingpt_ddp.snapshots.lease import Lease, LeaseError
from mingpt_ddp.snapshots.manifest import MANIFEST, snapshot_name  # noqa: F401 - MANIFEST: users'
from mingpt_ddp.snapshots.reader import SnapshotReader
from mingpt_ddp.urls import storage_hint


def _hint(error: Exception) -> str:
    return storage_hint(
        error,
        "trainer_config.snapshot_path",
        "point trainer_config.snapshot_path at a writable location",
    )


class SnapshotStore(SnapshotReader):
    """Snapshots under one URL: committed atomically, one writer at a time, read back checked
    (SnapshotReader). layouts: the FileLayouts of the multi-file snapshots it may write and read,
    by kind; by default every kind this version knows (layouts.py)."""

    def __init__(
        self,
        url: str,
        keep_last: int = 3,
        s3_endpoint_url: str = "",
        save_attempts: int = 3,
        layouts: dict[str, FileLayout] | None = None,
    ):
        super().__init__(url, s3_endpoint_url, layouts)
        self.keep_last = keep_last
        self.save_attempts = save_attempts  # per save, with backoff, before it counts as failed
        self.lease: Lease | None = None  # taken by acquire() on the rank that commits
        self.generation = 0  # the lease generation this job writes under (0: no lease)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def check_writable(self) -> None:
        """Write and delete a probe object, so a bad path, bucket or credential fails now,
        before training, rather than at the first save an hour in."""
        probe = f".probe-{uuid.uuid4().hex}"
        try:
            self.storage.write(probe, b"ok")
            self.storage.delete(probe)
        except Exception as e:  # noqa: BLE001 - reported with a hint, whatever it is
            raise SnapshotError(
                f"trainer_config.snapshot_path: cannot write to {self.url!r} "
                f"({type(e).__name__}: {e}); {_hint(e)}"
            ) from None

    # ------------------------------------------------------------ one writer
    def acquire(self, owner: str, ttl_s: float, clock=time.time, renew: bool = True) -> str:
        """Take this path's lease for job `owner` (lease.py; LeaseError names the holder if another
        job has
        it), then write its generation into latest.json at once: from then on a job holding an older
        generation cannot commit, even before this one saves anything. Returns how the lease was
        taken."""
        _, generation, _ = self.manifest.read()
        self.lease = Lease(self.storage, self.url, owner, ttl_s, clock)
        how = self.lease.acquire(min_generation=generation)
        self.generation = self.lease.generation
        self.manifest.update(lambda entries: (entries, []), self.generation)  # the fence
        if renew:
            self.lease.start_renewing()
        return how

    def check_owner(self) -> None:
        """Raise LeaseError if another job has taken this path (cheap: see Lease.check)."""
        if self.lease is not None:
            self.lease.check()

    def owns_path(self) -> bool:
        try:
            self.check_owner()
            return True
        except LeaseError:
            return False

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()

    # ---------------------------------------------------------------- saving
    def _name(self, step: int, extension: str) -> str:
        # The generation in the name: a fenced-out job's files can never replace the owner's.
        return snapshot_name(step, self.generation, extension)

    def _retry(self, attempt: Callable[[], Any]) -> Any:
        """attempt(), tried again after 0.5 s, 1 s, ... on a storage error (a full disk being
        cleaned,
        S3 throttling beyond boto3's own retries, a connection reset); never on a lost lease."""
        for i in range(self.save_attempts):
            try:
                return attempt()
            except LeaseError:
                raise
            except Exception:  # noqa: BLE001 - the last one propagates
                if i + 1 == self.save_attempts:
                    raise
                time.sleep(0.5 * 2**i)

    @contextlib.contextmanager
    def _save_failures(self, what: str, step: int, tried: str = "") -> Iterator[None]:
        """Whatever makes a save fail becomes one SnapshotError naming the step, the place, the
        cause and what to do about it (the caller decides whether training goes on); a lost lease
        stays a LeaseError,
        since it means another job owns the path and this one must stop."""
        try:
            yield
        except LeaseError:
            raise
        except Exception as e:  # noqa: BLE001 - reported with a hint, whatever it is
            raise SnapshotError(
                f"{what} of step {step} to {self.url!r} failed{tried} "
                f"({type(e).__name__}: {e}); {_hint(e)}"
            ) from e

    def save(self, state: dict, step: int) -> dict:
        """Serialize and commit one snapshot now; returns its manifest entry."""
        with self._save_failures("snapshot save", step, f" after {self.save_attempts} attempts"):
            return self._commit(serialize(state), step)

    def _commit(self, data: memoryview, step: int) -> dict:
        entry = {"file": self._name(step, "pt"), "step": step, **fingerprint(data)}
        self._retry(lambda: self.storage.write(entry["file"], data))  # 1. the snapshot, complete
        self._publish(entry)
        return entry

    def _publish(self, entry: dict) -> None:
        """Commit a written snapshot: the manifest names it, then old ones are deleted."""

        def change(current: list[dict]) -> tuple[list[dict], list[dict]]:
            # Entries at or after this step are from a run that was rolled back past them
            # (say a newer snapshot was corrupt and we resumed from an older one): replace them.
            older = sorted(
                (e for e in current if e["step"] < entry["step"]), key=lambda e: e["step"]
            )
            stale = [
                e for e in current if e["step"] >= entry["step"] and e["file"] != entry["file"]
            ]
            entries = older + [entry]
            return entries[-self.keep_last :], entries[: -self.keep_last] + stale

        try:
            generation = self.generation if self.lease is not None else None
            dropped = self._retry(lambda: self.manifest.update(change, generation))  # 2. commit
        except LeaseError:
            self._delete(
                entry
            )  # fenced out: its files are its own (named by its generation), and now orphans
            raise
        self.last_committed = entry
        for old in dropped:  # 3. only now is it safe to forget old snapshots
            self._delete(old)

    def _delete(self, entry: dict) -> None:
        try:
            for name in entry.get("files", {}):
                self.storage.delete(f"{entry['file']}/{name}")
            self.storage.delete(entry["file"])
        except Exception as e:  # noqa: BLE001 - a leftover file is not lost work
            warn0(
                f"could not delete {self.url}/{entry['file']} ({type(e).__name__}: {e}); it can be "
                "removed by hand"
            )

    def save_files(
        self, write: Callable[[str], str], meta: dict | None, step: int, is_main: bool, kind: str
    ) -> dict | None:
        """Collective: every rank writes its own part of the state, in parallel.

        write(stage) writes this rank's files into a rank-local staging directory and returns the
        folder holding them (the strategy's writer: DCP shards, DeepSpeed's partitions). Each rank
        then stores its files under snapshot_<step>.g<generation>.<the layout's extension>/ itself.
        Rank 0 adds meta.pt (step, RNG states, config...) and commits the manifest listing every
        file with its size and sha256: until then the snapshot does not exist.
        """
        name = self._name(step, self.layouts[kind].extension)
        with self._save_failures(f"{kind} snapshot save", step):
            mine, error = self._store_own_files(write, name, kind)
            # Every rank learns what every other wrote, or that one failed: all raise together
            # instead of the others waiting in the next collective.
            parts = all_gather_objects((mine, error))
            errors = [err for _, err in parts if err]
            if errors:
                raise SnapshotError(errors[0])
            if not is_main:
                return None
            files = {k: v for part, _ in parts for k, v in part.items()}
            meta_bytes = serialize(meta)
            self._retry(lambda: self.storage.write(f"{name}/{META}", meta_bytes))
            files[META] = fingerprint(meta_bytes)
            entry = {
                "file": name,
                "step": step,
                "kind": kind,
                "files": files,
                "bytes": sum(f["bytes"] for f in files.values()),
            }
            self._publish(entry)
            return entry

    def _store_own_files(
        self, write: Callable[[str], str], name: str, kind: str
    ) -> tuple[dict, str | None]:
        """This rank's part of save_files: its files written, stored, fingerprinted; or the
        error."""
        mine, error = {}, None
        with tempfile.TemporaryDirectory(prefix=f"{kind}-stage-") as stage:
            folder = write(stage)
            try:
                for file in sorted(os.listdir(folder)):
                    with open(os.path.join(folder, file), "rb") as f:
                        data = f.read()
                    self._retry(lambda f=file, d=data: self.storage.write(f"{name}/{f}", d))
                    mine[file] = fingerprint(data)
            except Exception as e:  # noqa: BLE001 - shared with every rank by save_files
                error = f"{type(e).__name__}: {e}"
        return mine, error

    def save_async(self, state: dict, step: int) -> None:
        """Copy state to CPU memory now, write it in a background thread while training goes on.

        At most one save is in flight: a second call first waits for the first.
        A failed background write is logged at once and raised by the next
        save_async(), wait() or raise_if_failed(), so the job fails instead of
        silently running on without snapshots.
        """
        self.wait()
        cpu_state = copy_to_cpu(state)

        def write() -> None:
            t0 = time.perf_counter()
            try:
                entry = self._commit(serialize(cpu_state), step)
                print0(
                    f"snapshot | step {step} | {entry['bytes'] / 1e6:.1f} MB | written in "
                    "background "
                    f"in {time.perf_counter() - t0:.2f} s | {self.url}/{entry['file']}"
                )
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                warn0(
                    f"background snapshot save of step {step} to {self.url} failed: "
                    f"{type(e).__name__}: {e}"
                )
                self._error = e

        self._thread = threading.Thread(target=write, name=f"snapshot-{step}", daemon=True)
        self._thread.start()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, LeaseError):
                raise error
            raise SnapshotError(
                f"background snapshot save to {self.url!r} failed "
                f"({type(error).__name__}: {error}); {_hint(error)}"
            ) from error

    def wait(self) -> None:
        """Block until the background save (if any) has finished; raise if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.raise_if_failed()
