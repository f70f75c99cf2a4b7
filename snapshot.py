"""Snapshot storage: where training state is written, and how it is committed and read back.

A snapshot is everything needed to continue a run as if it had never stopped:
model and optimizer state, step, epoch, position in the epoch, every rank's RNG
state, the config and the vocabulary. The Trainer builds that dict; this module
only stores and retrieves it, through one small interface:

    store = SnapshotStore("runs/x/snapshots", keep_last=3)
    store.check_writable()          # at start-up, before any training step
    store.save(state, step)         # commit a new snapshot
    with store.open_latest() as snapshot:   # the newest snapshot that passes its checks, or None
        snapshot.meta                       #   1. its metadata (step, config, vocabulary...)
        snapshot.tensors(into=...)          #   2. its tensors, a sharded one into the caller's layout

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

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from typing import Any, Iterator

import torch

from distributed import print0, warn0
from storage import open_storage, storage_hint

MANIFEST = "latest.json"
_SNAPSHOT_RE = re.compile(r"^snapshot_(\d+)\.(pt|dcp)$")  # .pt: one file; .dcp: a directory of shards
META = "meta.pt"  # in a sharded snapshot: everything but the model and optimizer tensors


class SnapshotError(RuntimeError):
    """Snapshot storage is unusable or a snapshot cannot be used; the message names the fix."""


class SnapshotMismatch(SnapshotError):
    """The snapshot is intact but belongs to another model or corpus: an error, not a fallback."""


def _serialize(obj: Any) -> memoryview:
    buf = io.BytesIO()
    # A sha256 covers every stored file, so torch.save's own CRC32 of every record
    # is redundant work (about a third of the save, and of the load).
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(obj, buf)
    finally:
        torch.serialization.set_crc32_options(crc)
    return buf.getbuffer()  # a view: no second copy of a possibly large buffer


def _fingerprint(data: bytes | memoryview) -> dict:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _load_bytes(data: bytes, map_location) -> Any:
    # weights_only=True: only tensors and plain containers are unpickled, so a
    # snapshot file cannot run code on load.
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


def _hint(error: Exception) -> str:
    return storage_hint(error, "trainer_config.snapshot_path", "point trainer_config.snapshot_path at a writable location")


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
            warn0(f"snapshot manifest {self.url}/{MANIFEST} is unreadable ({e}); "
                  "looking for single-file snapshots (sharded ones need the manifest)")
            return []

    def save(self, state: dict, step: int) -> dict:
        """Serialize and commit one snapshot now; returns its manifest entry."""
        try:
            return self._commit(state, step)
        except Exception as e:  # noqa: BLE001 - reported with a hint, whatever it is
            raise SnapshotError(f"snapshot save of step {step} to {self.url!r} failed "
                                f"({type(e).__name__}: {e}); {_hint(e)}") from e

    def _commit(self, state: dict, step: int) -> dict:
        data = _serialize(state)
        entry = {"file": f"snapshot_{step:08d}.pt", "step": step, **_fingerprint(data)}
        self.storage.write(entry["file"], data)  # 1. the snapshot, complete
        self._publish(entry)
        return entry

    def _publish(self, entry: dict) -> None:
        """Commit a written snapshot: the manifest names it, then old ones are deleted."""
        # Entries at or after this step are from a run that was rolled back past them
        # (say a newer snapshot was corrupt and we resumed from an older one): replace them.
        current = self._manifest()  # one read (one request, on S3) per commit
        older = sorted((e for e in current if e["step"] < entry["step"]), key=lambda e: e["step"])
        stale = [e for e in current if e["step"] > entry["step"]]
        entries = older + [entry]
        kept, dropped = entries[-self.keep_last:], entries[:-self.keep_last] + stale
        self.storage.write(MANIFEST, json.dumps({"snapshots": kept}, indent=1).encode())  # 2. commit
        for old in dropped:  # 3. only now is it safe to forget old snapshots
            for name in old.get("files", {}):
                self.storage.delete(f"{old['file']}/{name}")
            self.storage.delete(old["file"])

    def save_sharded(self, app_state: dict, meta: dict | None, step: int, is_main: bool) -> dict | None:
        """Collective: every rank writes its own shards with torch.distributed.checkpoint (DCP).

        app_state holds DTensors (each rank's shard of model and optimizer). DCP
        writes them to a rank-local staging directory; each rank then stores its
        files under snapshot_<step>.dcp/ itself, in parallel. Rank 0 adds meta.pt
        (step, RNG states, config...) and commits the manifest listing every file
        with its size and sha256: until then the snapshot does not exist.
        """
        import torch.distributed.checkpoint as dcp

        from distributed import all_gather_objects

        name = f"snapshot_{step:08d}.dcp"
        try:
            mine, error = {}, None
            with tempfile.TemporaryDirectory(prefix="dcp-stage-") as stage:
                dcp.save(app_state, storage_writer=dcp.FileSystemWriter(stage))
                try:
                    for file in sorted(os.listdir(stage)):
                        with open(os.path.join(stage, file), "rb") as f:
                            data = f.read()
                        self.storage.write(f"{name}/{file}", data)
                        mine[file] = _fingerprint(data)
                except Exception as e:  # noqa: BLE001 - shared with every rank below
                    error = f"{type(e).__name__}: {e}"
            # Every rank learns what every other wrote, or that one failed: all raise together
            # instead of the others waiting in the next collective.
            parts = all_gather_objects((mine, error))
            errors = [err for _, err in parts if err]
            if errors:
                raise SnapshotError(errors[0])
            files = {k: v for part, _ in parts for k, v in part.items()}
            if not is_main:
                return None
            meta_bytes = _serialize(meta)
            self.storage.write(f"{name}/{META}", meta_bytes)
            files[META] = _fingerprint(meta_bytes)
            entry = {"file": name, "step": step, "kind": "sharded", "files": files,
                     "bytes": sum(f["bytes"] for f in files.values())}
            self._publish(entry)
            return entry
        except Exception as e:  # noqa: BLE001 - reported with a hint, whatever it is
            raise SnapshotError(f"sharded snapshot save of step {step} to {self.url!r} failed "
                                f"({type(e).__name__}: {e}); {_hint(e)}") from e

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
            names = [n for n in self.storage.list() if _SNAPSHOT_RE.match(n) and n.endswith(".pt")]
            entries = [{"file": n, "step": int(_SNAPSHOT_RE.match(n).group(1))} for n in names]
        return sorted(entries, key=lambda e: e["step"], reverse=True)

    def _read_checked(self, name: str, expected: dict | None) -> bytes:
        data = self.storage.read(name)
        if expected and len(data) != expected["bytes"]:
            raise SnapshotError(f"{name}: size {len(data)} bytes, manifest says {expected['bytes']}")
        if expected and hashlib.sha256(data).hexdigest() != expected["sha256"]:
            raise SnapshotError(f"{name}: checksum mismatch")
        return data

    def _stage(self, entry: dict, directory: str) -> None:
        """Copy a sharded snapshot's files into a local directory, each checked against the manifest
        (DCP reads shards from a directory, wherever the snapshot is stored)."""
        for file, expected in entry["files"].items():
            with open(os.path.join(directory, file), "wb") as f:
                f.write(self._read_checked(f"{entry['file']}/{file}", expected))

    def _open(self, entry: dict, map_location) -> OpenSnapshot:
        """Read and check every file of one snapshot; its metadata is then known, its tensors ready."""
        if entry.get("kind") == "sharded":
            stage = tempfile.mkdtemp(prefix="dcp-load-")
            try:
                self._stage(entry, stage)
                meta = torch.load(os.path.join(stage, META), map_location=map_location, weights_only=True)
            except BaseException:
                shutil.rmtree(stage, ignore_errors=True)
                raise
            return OpenSnapshot(entry, meta, stage=stage)
        state = _load_bytes(self._read_checked(entry["file"], entry if "sha256" in entry else None), map_location)
        if not isinstance(state, dict) or "step" not in state:
            raise SnapshotError("not a snapshot of this project")
        tensors = {k: state.pop(k) for k in ("model", "optimizer") if k in state}
        return OpenSnapshot(entry, state, tensors=tensors)

    @contextlib.contextmanager
    def open_latest(self, map_location: str | torch.device = "cpu") -> Iterator[OpenSnapshot | None]:
        """The newest snapshot whose files all pass their size and checksum checks, or None.

        Loading is two explicit steps: this reads the metadata (step, config, vocabulary...),
        so the caller can refuse a snapshot of another model before any tensor is used; then
        OpenSnapshot.tensors() loads the tensors. A damaged snapshot is skipped with a
        warning, falling back to the one before.
        """
        candidates = self._candidates()
        for entry in candidates:
            try:
                snapshot = self._open(entry, map_location)
            except Exception as e:  # noqa: BLE001 - fall back to the previous snapshot
                warn0(f"snapshot {self.url}/{entry['file']} is unusable ({type(e).__name__}: {e}); "
                      "trying the previous one")
                continue
            try:
                yield snapshot
            finally:
                snapshot.close()
            return
        if candidates:
            warn0(f"no usable snapshot under {self.url}; starting fresh")
        yield None

    def load_latest(self, map_location: str | torch.device = "cpu") -> dict | None:
        """The newest usable snapshot as one dict, metadata and full tensors (a sharded one consolidated)."""
        with self.open_latest(map_location) as snapshot:
            return None if snapshot is None else {**snapshot.meta, **snapshot.tensors()}

    def consolidate(self, out_path: str) -> dict:
        """Write the newest snapshot, sharded or not, as one single-file snapshot at out_path."""
        state = self.load_latest()
        if state is None:
            raise SnapshotError(f"no snapshot under {self.url!r}")
        with open(out_path, "wb") as f:
            f.write(_serialize(state))
        return state


class OpenSnapshot:
    """A snapshot whose files passed their checks: its metadata, and its tensors on request."""

    def __init__(self, entry: dict, meta: dict, tensors: dict | None = None, stage: str | None = None):
        self.entry, self.meta, self._tensors, self._stage = entry, meta, tensors, stage

    @property
    def sharded(self) -> bool:
        return self._stage is not None

    def tensors(self, into: dict | None = None) -> dict:
        """{"model": ..., "optimizer": ...}. A single-file snapshot holds full tensors. A sharded one is
        loaded by DCP into `into`, state dicts laid out for this run at any world size (DCP reshards);
        without `into`, its shards are consolidated into full tensors."""
        if not self.sharded:
            return self._tensors
        if into is not None:
            import torch.distributed.checkpoint as dcp

            dcp.load(into, storage_reader=dcp.FileSystemReader(self._stage))
            return into
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        full = os.path.join(self._stage, "full.pt")
        dcp_to_torch_save(self._stage, full)
        return torch.load(full, map_location="cpu", weights_only=True)

    def close(self) -> None:
        if self._stage is not None:
            shutil.rmtree(self._stage, ignore_errors=True)

if __name__ == "__main__":
    import argparse
    import sys

    p = argparse.ArgumentParser(description="Snapshot tools.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="turn the newest (sharded) snapshot into one .pt file")
    c.add_argument("snapshot", help="snapshot directory or URL (trainer_config.snapshot_path)")
    c.add_argument("out", help="the single file to write")
    args = p.parse_args()
    try:
        state = SnapshotStore(args.snapshot).consolidate(args.out)
    except SnapshotError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {args.out}: step {state['step']}, {len(state['model'])} model tensors")
