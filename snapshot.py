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
import os
import re
import uuid

import fsspec
import torch

from distributed import warn0

MANIFEST = "latest.json"
_SNAPSHOT_RE = re.compile(r"^snapshot_(\d+)\.pt$")


class SnapshotError(RuntimeError):
    """Snapshot storage is unusable or a snapshot cannot be used; the message names the fix."""


class LocalStorage:
    """A directory on a local or shared (NFS, Lustre) filesystem, with atomic writes."""

    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))

    def write(self, name: str, data: bytes) -> None:
        os.makedirs(self.root, exist_ok=True)
        final = os.path.join(self.root, name)
        # Write beside the target (same filesystem, so the rename is atomic),
        # flush it to disk, then rename over the target: readers see the old file
        # or the complete new one, never a partial one.
        tmp = os.path.join(self.root, f".{name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        # fsync the directory so the rename itself survives a power cut.
        dir_fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def read(self, name: str) -> bytes:
        with open(os.path.join(self.root, name), "rb") as f:
            return f.read()

    def delete(self, name: str) -> None:
        try:
            os.remove(os.path.join(self.root, name))
        except FileNotFoundError:
            pass

    def list(self) -> list[str]:
        return os.listdir(self.root) if os.path.isdir(self.root) else []


class FsspecStorage:
    """Any fsspec URL (memory://, gs://, az://, ...). Object stores publish an object only when
    its upload completes, so a plain write is already all-or-nothing there."""

    def __init__(self, url: str):
        self.fs, self.root = fsspec.core.url_to_fs(url)

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def write(self, name: str, data: bytes) -> None:
        self.fs.makedirs(self.root, exist_ok=True)
        self.fs.pipe_file(self._path(name), data)

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(self._path(name))

    def delete(self, name: str) -> None:
        try:
            self.fs.rm_file(self._path(name))
        except FileNotFoundError:
            pass

    def list(self) -> list[str]:
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []


def open_storage(url: str) -> LocalStorage | FsspecStorage:
    """Pick the storage for a URL: plain paths and file:// are local, everything else goes through fsspec."""
    if "://" not in url:
        return LocalStorage(url)
    if url.startswith("file://"):
        return LocalStorage(url[len("file://") :])
    return FsspecStorage(url)


class SnapshotStore:
    def __init__(self, url: str, keep_last: int = 3):
        self.url = url
        self.keep_last = keep_last
        self.storage = open_storage(url)

    def check_writable(self) -> None:
        """Write and delete a probe object, so a bad path fails now rather than at the first save."""
        probe = f".probe-{uuid.uuid4().hex}"
        try:
            self.storage.write(probe, b"ok")
            self.storage.delete(probe)
        except Exception as e:  # noqa: BLE001 - any failure here means the same fix
            raise SnapshotError(
                f"trainer_config.snapshot_path: cannot write to {self.url!r} ({type(e).__name__}: {e}); "
                "point it at a writable location"
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
        """Serialize and commit one snapshot; returns its manifest entry."""
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        entry = {"file": f"snapshot_{step:08d}.pt", "step": step, "bytes": len(data),
                 "sha256": hashlib.sha256(data).hexdigest()}
        self.storage.write(entry["file"], data)  # 1. the snapshot, complete
        entries = [e for e in self._manifest() if e["step"] != step] + [entry]
        kept, dropped = entries[-self.keep_last :], entries[: -self.keep_last]
        self.storage.write(MANIFEST, json.dumps({"snapshots": kept}, indent=1).encode())  # 2. commit
        for old in dropped:  # 3. only now is it safe to forget old snapshots
            self.storage.delete(old["file"])
        return entry

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
