"""Snapshot storage: where training state is written, and how it is committed and read back.

A snapshot is everything needed to continue a run as if it had never stopped:
model and optimizer state, step, epoch, position in the epoch, every rank's RNG
state, the config and the vocabulary. The Trainer builds that dict; this module
only stores and retrieves it, through one small interface:

    store = SnapshotStore("runs/x/snapshots", keep_last=3)
    store.check_writable()          # at start-up, before any training step
    store.save(state, step)         # commit a new snapshot
    state = store.load_latest()     # newest loadable snapshot, or None

Layout under the snapshot URL (a directory or URL prefix):

    snapshot_00000500.pt   torch.save of the state dict
    snapshot_00001000.pt
    latest.json            manifest: the committed snapshots, newest last, with size + sha256

Never lose work: a snapshot file is written completely (temp file, fsync, rename)
before the manifest that names it is replaced, and old snapshots are deleted only
after that. A crash at any moment leaves the previous manifest and the snapshots
it names intact. On load the newest snapshot is checked against its recorded
size and checksum; a damaged one is skipped with a warning, falling back to the
one before.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import threading
import time
import uuid
from typing import Any

import torch

from distributed import print0, warn0
from storage import open_storage

MANIFEST = "latest.json"
_SNAPSHOT_RE = re.compile(r"^snapshot_(\d+)\.pt$")


class SnapshotError(RuntimeError):
    """Snapshot storage is unusable or a snapshot cannot be used; the message names the fix."""


def _hint(error: Exception) -> str:
    """What to fix, for the storage errors people actually hit."""
    text = f"{type(error).__name__}: {error}"
    if "Credentials" in type(error).__name__ or "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
        return "check the AWS credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE)"
    if "NoSuchBucket" in text:
        return "create the bucket or fix the bucket name in trainer_config.snapshot_path"
    if "EndpointConnection" in type(error).__name__ or "Connect" in type(error).__name__:
        return "check trainer_config.s3_endpoint_url / AWS_ENDPOINT_URL and that the server is reachable"
    return "point trainer_config.snapshot_path at a writable location"


def copy_to_cpu(obj: Any) -> Any:
    """A deep copy of a state dict with every tensor cloned to CPU memory.

    Training goes on updating the live tensors in place, so a background save must
    work on its own copy; this copy is the only part of an async save that stalls
    training.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: copy_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_to_cpu(v) for v in obj)
    return obj


class SnapshotStore:
    def __init__(self, url: str, keep_last: int = 3, s3_endpoint_url: str = ""):
        self.url = url
        self.keep_last = keep_last
        self.storage = open_storage(url, s3_endpoint_url)
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
                f"trainer_config.snapshot_path: cannot write to {self.url!r} ({type(e).__name__}: {e}); {_hint(e)}"
            ) from None

    def _manifest(self) -> list[dict]:
        try:
            entries = json.loads(self.storage.read(MANIFEST))["snapshots"]
            return [e for e in entries if _SNAPSHOT_RE.match(e["file"])]
        except FileNotFoundError:
            return []
        except (ValueError, KeyError, TypeError) as e:
            warn0(f"snapshot manifest {self.url}/{MANIFEST} is unreadable ({e}); scanning for snapshot files")
            return []

    def save(self, state: dict, step: int) -> dict:
        """Serialize and commit one snapshot now; returns its manifest entry."""
        try:
            return self._commit(state, step)
        except Exception as e:  # noqa: BLE001 - reported with a hint, whatever it is
            raise SnapshotError(f"snapshot save of step {step} to {self.url!r} failed "
                                f"({type(e).__name__}: {e}); {_hint(e)}") from e

    def _commit(self, state: dict, step: int) -> dict:
        buf = io.BytesIO()
        # The sha256 below covers the whole file, so torch.save's own CRC32 of every
        # record is redundant work (about a third of the save, and of the load).
        crc = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(state, buf)
        finally:
            torch.serialization.set_crc32_options(crc)
        data = buf.getbuffer()  # a view: no second copy of a possibly large buffer
        entry = {"file": f"snapshot_{step:08d}.pt", "step": step, "bytes": len(data),
                 "sha256": hashlib.sha256(data).hexdigest()}
        self.storage.write(entry["file"], data)  # 1. the snapshot, complete
        entries = [e for e in self._manifest() if e["step"] != step] + [entry]
        kept, dropped = entries[-self.keep_last:], entries[:-self.keep_last]
        self.storage.write(MANIFEST, json.dumps({"snapshots": kept}, indent=1).encode())  # 2. commit
        for old in dropped:  # 3. only now is it safe to forget old snapshots
            self.storage.delete(old["file"])
        return entry

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
                entry = self._commit(cpu_state, step)
                print0(f"snapshot | step {step} | {entry['bytes'] / 1e6:.1f} MB | written in background "
                       f"in {time.perf_counter() - t0:.2f} s | {self.url}/{entry['file']}")
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                warn0(f"background snapshot save of step {step} to {self.url} failed: {type(e).__name__}: {e}")
                self._error = e

        self._thread = threading.Thread(target=write, name=f"snapshot-{step}", daemon=True)
        self._thread.start()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise SnapshotError(f"background snapshot save to {self.url!r} failed "
                                f"({type(error).__name__}: {error}); {_hint(error)}") from error

    def wait(self) -> None:
        """Block until the background save (if any) has finished; raise if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.raise_if_failed()

    def _candidates(self) -> list[dict]:
        """Snapshots to try, newest first: the manifest's, or (without one) whatever files exist."""
        entries = self._manifest()
        if not entries:
            names = [n for n in self.storage.list() if _SNAPSHOT_RE.match(n)]
            entries = [{"file": n, "step": int(_SNAPSHOT_RE.match(n).group(1))} for n in names]
        return sorted(entries, key=lambda e: e["step"], reverse=True)

    def load_latest(self, map_location: str | torch.device = "cpu") -> dict | None:
        """The newest snapshot that passes its integrity check, or None for a fresh start."""
        candidates = self._candidates()
        for entry in candidates:
            where = f"{self.url}/{entry['file']}"
            try:
                data = self.storage.read(entry["file"])
                if "bytes" in entry and len(data) != entry["bytes"]:
                    raise SnapshotError(f"size {len(data)} bytes, manifest says {entry['bytes']}")
                if "sha256" in entry and hashlib.sha256(data).hexdigest() != entry["sha256"]:
                    raise SnapshotError("checksum mismatch")
                # weights_only=True: only tensors and plain containers are unpickled,
                # so a snapshot file cannot run code on load.
                state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
                if not isinstance(state, dict) or "step" not in state:
                    raise SnapshotError("not a snapshot of this project")
                return state
            except Exception as e:  # noqa: BLE001 - fall back to the previous snapshot
                warn0(f"snapshot {where} is unusable ({type(e).__name__}: {e}); trying the previous one")
        if candidates:
            warn0(f"no usable snapshot under {self.url}; starting fresh")
        return None
