"""Reading a snapshot path: the newest committed snapshot that passes its checks, its metadata
first and its tensors on request (store.py's SnapshotStore adds writing, under one lease).

sample.py and `python -m mingpt_ddp.snapshots consolidate` only read; a training run reads at
resume and writes after. A damaged snapshot (a size or sha256 that does not match the manifest)
is skipped with a warning, falling back to the one before.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch

from mingpt_ddp.errors import SnapshotError
from mingpt_ddp.runtime.distributed import warn0
from mingpt_ddp.snapshots.files import OpenSnapshot, open_entry, serialize
from mingpt_ddp.snapshots.layout import FileLayout
from mingpt_ddp.snapshots.layouts import LAYOUTS
from mingpt_ddp.snapshots.manifest import SNAPSHOT_RE, Manifest, newest_first
from mingpt_ddp.snapshots.storage import open_storage


class SnapshotReader:
    """The committed snapshots under one URL, read back checked."""

    def __init__(
        self, url: str, s3_endpoint_url: str = "", layouts: dict[str, FileLayout] | None = None
    ):
        self.url = url
        self.layouts = LAYOUTS if layouts is None else layouts
        self.storage = open_storage(url, s3_endpoint_url)
        by_extension = {layout.extension: layout for layout in self.layouts.values()}
        self.manifest = Manifest(self.storage, url, by_extension)
        self.last_committed: dict | None = (
            None  # the newest snapshot known good: where a rerun resumes
        )

    def _manifest(self) -> list[dict]:
        return self.manifest.read()[0]

    def _candidates(self) -> list[dict]:
        """Snapshots to try, newest first: the manifest's, or (without one) whatever files exist."""
        entries = self._manifest()
        if not entries:
            names = [n for n in self.storage.list() if SNAPSHOT_RE.match(n) and n.endswith(".pt")]
            entries = [{"file": n, "step": int(SNAPSHOT_RE.match(n).group(1))} for n in names]
        return newest_first(entries)

    def _read_checked(self, name: str, expected: dict | None) -> bytes:
        data = self.storage.read(name)
        if expected:
            _check(name, len(data), hashlib.sha256(data), expected)
        return data

    def _checked_path(self, name: str, expected: dict) -> str:
        """The file's own path (a filesystem storage's) once its bytes match the manifest; read
        in blocks, not kept."""
        path, digest, size = self.storage.local_path(name), hashlib.sha256(), 0
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
                size += len(block)
        _check(name, size, digest, expected)
        return path

    def _open(self, entry: dict, map_location) -> OpenSnapshot:
        layout = self.layouts.get(entry["kind"]) if "kind" in entry else None
        if "kind" in entry and layout is None:
            raise SnapshotError(
                f"written by a parallel mode this version does not know ({entry['kind']})"
            )
        local = hasattr(self.storage, "local_path")  # a filesystem: files are read in place
        checked_path = self._checked_path if local else None
        return open_entry(entry, layout, self._read_checked, map_location, checked_path)

    @contextlib.contextmanager
    def open_latest(
        self, map_location: str | torch.device = "cpu"
    ) -> Iterator[OpenSnapshot | None]:
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
                warn0(
                    f"snapshot {self.url}/{entry['file']} is unusable ({type(e).__name__}: {e}); "
                    "trying the previous one"
                )
                continue
            self.last_committed = entry
            try:
                yield snapshot
            finally:
                snapshot.close()
            return
        if candidates:
            warn0(f"no usable snapshot under {self.url}; starting fresh")
        yield None

    def load_latest(self, map_location: str | torch.device = "cpu") -> dict | None:
        """The newest usable snapshot as one dict: metadata and full tensors (shards joined)."""
        with self.open_latest(map_location) as snapshot:
            return None if snapshot is None else {**snapshot.meta, **snapshot.tensors()}

    def consolidate(self, out_path: str) -> dict:
        """Write the newest snapshot, sharded or not, as one single-file snapshot at out_path."""
        state = self.load_latest()
        if state is None:
            raise SnapshotError(f"no snapshot under {self.url!r}")
        with open(out_path, "wb") as f:
            f.write(serialize(state))
        return state


def _check(name: str, size: int, digest, expected: dict) -> None:
    """A stored file against its manifest entry: the size, then the sha256 of its bytes."""
    if size != expected["bytes"]:
        raise SnapshotError(f"{name}: size {size} bytes, manifest says {expected['bytes']}")
    if digest.hexdigest() != expected["sha256"]:
        raise SnapshotError(f"{name}: checksum mismatch")
