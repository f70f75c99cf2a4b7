"""Snapshot bytes: serializing a state, fingerprinting what is stored, and reading a committed
snapshot back after checking every file against the manifest (OpenSnapshot).

store.py decides what is written where and when; this module is what a snapshot is on disk and
how it is turned back into tensors, whatever its layout (one file, or a folder whose FileLayout
its writer declared: mingpt_ddp/snapshots/layout.py).
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
from collections.abc import Callable
from typing import Any

import torch

from mingpt_ddp.errors import SnapshotError
from mingpt_ddp.snapshots.layout import META, FileLayout
from mingpt_ddp.snapshots.stage import NodeStage, own_stage


def serialize(obj: Any) -> memoryview:
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


def fingerprint(data: bytes | memoryview) -> dict:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def load_bytes(data: bytes, map_location) -> Any:
    # weights_only=True: only tensors and plain containers are unpickled, so a
    # snapshot file cannot run code on load.
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


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


ReadChecked = Callable[[str, "dict | None"], bytes]  # (name, its manifest fingerprint) -> its bytes
CheckedPath = Callable[[str, dict], str]  # (name, its fingerprint) -> its path, once checked


def open_entry(
    entry: dict,
    layout: FileLayout | None,
    read: ReadChecked,
    map_location,
    checked_path: CheckedPath | None = None,
) -> OpenSnapshot:
    """Read and check every file of one committed snapshot; its metadata is then known, its tensors
    ready. A folder's files are gathered in a local directory laid out as its layout wants (DCP
    and DeepSpeed read a directory), each checked against the manifest: where the storage is a
    filesystem (checked_path given), as links to the files where they are; from object storage,
    downloaded once per node into a folder its ranks share (mingpt_ddp/snapshots/stage.py)."""
    if layout is None:
        expected = entry if "sha256" in entry else None
        state = load_bytes(read(entry["file"], expected), map_location)
        if not isinstance(state, dict) or "step" not in state:
            raise SnapshotError("not a snapshot of this project")
        tensors = {k: state.pop(k) for k in ("model", "optimizer") if k in state}
        return OpenSnapshot(entry, state, tensors=tensors)

    fill = functools.partial(
        _gather, entry=entry, layout=layout, read=read, checked_path=checked_path
    )
    if checked_path is not None:
        stage, release = own_stage(layout.kind, fill)
    else:
        stage, release = NodeStage(entry).open(fill)
    try:
        meta_file = os.path.join(stage, layout.subdir, META)
        meta = torch.load(meta_file, map_location=map_location, weights_only=True)
    except BaseException:
        release()
        raise
    return OpenSnapshot(entry, meta, layout=layout, stage=stage, release=release)


def _gather(folder: str, entry: dict, layout: FileLayout, read, checked_path) -> None:
    """Every file of the snapshot, checked, where its layout's reader expects it under folder: a
    link to the checked file where it is (checked_path given), else a copy of the bytes read."""
    files = os.path.join(folder, layout.subdir)
    os.makedirs(files, exist_ok=True)
    for file, expected in entry["files"].items():
        name, target = f"{entry['file']}/{file}", os.path.join(files, file)
        if checked_path is not None:
            os.symlink(checked_path(name, expected), target)
        else:
            with open(target, "wb") as f:
                f.write(read(name, expected))
    layout.check(files)


class OpenSnapshot:
    """A snapshot whose files passed their checks: its metadata, and its tensors on request."""

    def __init__(
        self,
        entry: dict,
        meta: dict,
        tensors: dict | None = None,
        layout: FileLayout | None = None,
        stage: str | None = None,
        release: Callable[[], None] = lambda: None,
    ):
        self.entry, self.meta, self._tensors, self.layout = entry, meta, tensors, layout
        self.kind = entry.get("kind", "single")  # single, or the FileLayout's kind
        self.directory = stage  # where a multi-file snapshot's checked files are staged
        self._release = release  # gives the staged folder back (removed by its last user)

    @property
    def reshardable(self) -> bool:
        """Its tensors load straight into this run's own layout, at any world size (DCP shards)."""
        return self.layout is not None and self.layout.load_into is not None

    def tensors(self, into: dict | None = None) -> dict:
        """{"model": ..., "optimizer": ...}. A single-file snapshot holds full tensors. A
        reshardable one is loaded into `into` (state dicts laid out for this run); otherwise, and
        without `into`, the layout puts its files back together into full tensors."""
        if self.layout is None:
            return self._tensors
        if into is not None and self.layout.load_into is not None:
            return self.layout.load_into(self.directory, into)
        return self.layout.full_tensors(self.directory)

    def close(self) -> None:
        self._release()
