"""The file rules of a multi-file snapshot, as its writer declares them to the store.

A single-file snapshot is the store's own (one torch.save, written by rank 0). A snapshot every
rank writes part of (FSDP's DCP shards, DeepSpeed's per-rank files) has rules only its writer
knows: the folder's extension, which file names belong in it, where the reader expects them,
what to check before they are read, and how to turn them into full tensors. The parallel
strategy that writes such a snapshot owns one FileLayout (mingpt_ddp/parallel/fsdp.py,
mingpt_ddp/parallel/deepspeed.py) and the store is handed them, so the store holds no rule of
any parallel mode and a new mode brings its layout along.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

META = "meta.pt"  # in a multi-file snapshot: everything but the model and optimizer tensors


def _no_check(folder: str) -> None:
    """Files that their reader loads safely (weights_only) need no check beyond their sha256."""


@dataclass(frozen=True)
class FileLayout:
    """How one kind of multi-file snapshot is named, checked and read."""

    kind: str
    """The manifest entry's kind ("sharded", "deepspeed"): saved in latest.json, so it never
    changes."""
    extension: str
    """The folder's extension: snapshot_<step>.g<n>.<extension>/."""
    file_names: re.Pattern
    """The only file names the folder may hold (besides meta.pt): a manifest naming others is
    refused."""
    full_tensors: Callable[[str], dict]
    """folder -> {"model": ..., ["optimizer": ...]} as full tensors, without a process group."""
    load_into: Callable[[str, dict], dict] | None = None
    """(folder, state dicts laid out for this run) -> them, filled: loading that reshards to any
    world size (DCP); None: only full_tensors."""
    refusal: Callable[[dict], str] | None = None
    """meta -> why a run of another parallel mode cannot resume from such a snapshot (its files
    are partitioned for the mode that wrote them); None: any mode can."""
    subdir: str = ""
    """Where in its staging directory the reader expects the files (DeepSpeed reads
    <dir>/<tag>/)."""
    check: Callable[[str], None] = _no_check
    """Raise if a staged folder's files are unsafe to hand to their reader."""

    def accepts(self, name: str) -> bool:
        return name == META or bool(self.file_names.match(name))
