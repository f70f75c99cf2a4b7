"""The manifest, latest.json: which snapshots under a snapshot path are committed.

A snapshot exists when the manifest names it, with its size and sha256 (a sharded one: every
file's). This module owns the manifest's three rules:

- **Names.** snapshot_<step>[.g<generation>].pt is one file; a folder's extension names the
  FileLayout of the strategy that wrote it (.dcp: FSDP's DCP shards, .zero: DeepSpeed's files). The
  generation is the lease's (mingpt_ddp/snapshots/lease.py), so two jobs never write the same name.
- **Untrusted input.** Snapshot paths get shared and downloaded, so every entry is checked
  (entry_problem) before anything it names is read or deleted: only names this project writes
  pass, and a bad entry is reported and skipped. (storage.check_name guards below that.)
- **One writer.** The manifest is replaced by compare-and-swap (storage.write_if), and records
  the lease generation that wrote it; a job holding an older generation cannot commit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from mingpt_ddp.runtime.distributed import warn0
from mingpt_ddp.snapshots.layout import FileLayout
from mingpt_ddp.snapshots.lease import LeaseError
from mingpt_ddp.snapshots.storage import Storage

MANIFEST = "latest.json"
# .pt: one file; any other extension: a folder, whose FileLayout (its writer's rules) says what it
# holds.
SNAPSHOT_RE = re.compile(r"^snapshot_(\d+)(?:\.g(\d+))?\.([a-z0-9]+)$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

Entries = list[dict]


def snapshot_name(step: int, generation: int, extension: str) -> str:
    return f"snapshot_{step:08d}{f'.g{generation}' if generation else ''}.{extension}"


def newest_first(entries: Entries) -> Entries:
    """By step; of two with one step (a fenced-out job's leftover), the later generation's first."""
    return sorted(
        entries,
        key=lambda e: (e["step"], int(SNAPSHOT_RE.match(e["file"]).group(2) or 0)),
        reverse=True,
    )


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0  # not bool, not "1", not 1.5


def entry_problem(entry: Any, layouts: dict[str, FileLayout]) -> str:
    """Why a manifest entry cannot be used ("" if it can). Only names this project writes pass, so a
    crafted manifest cannot point a read, a shard copy or a retention delete anywhere else.
    layouts: the known multi-file layouts, by extension."""
    if not isinstance(entry, dict):
        return "not an object"
    match = SNAPSHOT_RE.match(entry["file"]) if isinstance(entry.get("file"), str) else None
    if not match:
        return f"file is not snapshot_<step>[.g<n>].{' or .'.join(['pt', *layouts])}"
    if not _is_count(entry.get("step")) or entry["step"] != int(match.group(1)):
        return "step does not match the file name"
    if not _is_count(entry.get("bytes")):
        return "bytes is not a count"
    if match.group(3) == "pt":
        if entry.get("kind") in [layout.kind for layout in layouts.values()]:
            return "kind does not match the file name"
        return "" if SHA256_RE.match(str(entry.get("sha256"))) else "sha256 is not a sha256 digest"
    layout = layouts.get(match.group(3))
    if layout is None:
        return f"file is not snapshot_<step>[.g<n>].{' or .'.join(['pt', *layouts])}"
    if entry.get("kind") != layout.kind:
        return "kind does not match the file name"
    kind = layout.kind
    files = entry.get("files")
    if not isinstance(files, dict) or not files:
        return "files is not a table of shard files"
    for name, fingerprint in files.items():
        if not isinstance(name, str) or not layout.accepts(name):
            return f"shard file {name!r} is not a {kind} file name"
        if (
            not isinstance(fingerprint, dict)
            or not _is_count(fingerprint.get("bytes"))
            or not SHA256_RE.match(str(fingerprint.get("sha256")))
        ):
            return f"shard file {name!r} has no size and sha256"
    return ""


class Manifest:
    """latest.json under one snapshot path."""

    def __init__(self, storage: Storage, url: str, layouts: dict[str, FileLayout]):
        self.storage, self.url, self.layouts = storage, url, layouts  # layouts by extension

    def read(self) -> tuple[Entries, int, str | None]:
        """The committed entries that pass entry_problem, the lease generation that last committed,
        and the manifest's version (for the compare-and-swap that replaces it)."""
        data, version = self.storage.read_versioned(MANIFEST)
        if data is None:
            return [], 0, None
        try:
            doc = json.loads(data)
            entries, generation = doc["snapshots"], doc.get("generation", 0)
            if not isinstance(entries, list) or not _is_count(generation):
                raise TypeError("snapshots is not a list or generation is not a count")
        except (ValueError, KeyError, TypeError) as e:
            warn0(
                f"snapshot manifest {self.url}/{MANIFEST} is unreadable ({e}); "
                "looking for single-file snapshots (sharded ones need the manifest)"
            )
            return [], 0, version
        good = []
        for entry in entries:
            if problem := entry_problem(entry, self.layouts):
                warn0(
                    f"snapshot manifest {self.url}/{MANIFEST}: "
                    f"entry {json.dumps(entry)[:160]} skipped ({problem})"
                )
            else:
                good.append(entry)
        return good, generation, version

    def update(
        self, change: Callable[[Entries], tuple[Entries, Entries]], generation: int | None
    ) -> Entries:
        """Replace the manifest with change(entries) -> (kept, dropped), as one compare-and-swap;
        returns the dropped entries. generation: this job's lease generation, refused (LeaseError)
        if the manifest was committed by a newer one; None: no lease, keep the recorded
        generation."""
        for _ in range(
            5
        ):  # a lost compare-and-swap: read again (the refusal below ends it if fenced out)
            entries, recorded, version = self.read()
            if generation is not None and recorded > generation:
                raise LeaseError(
                    f"snapshot commit refused: this job holds lease generation {generation}, but "
                    f"{self.url}/{MANIFEST} was committed by generation {recorded}; "
                    "another job has taken over this snapshot path, and its snapshots stand"
                )
            kept, dropped = change(entries)
            doc = {"generation": recorded if generation is None else generation, "snapshots": kept}
            if self.storage.write_if(MANIFEST, json.dumps(doc, indent=1).encode(), version):
                return dropped
        raise RuntimeError(
            f"{self.url}/{MANIFEST} kept changing under this job's commit; is another job "
            "writing to this snapshot path without a lease (trainer_config.lease_ttl_s=0)?"
        )
