"""A prepared copy of a corpus: where it lives, what its meta.json says, and whether it can be
trusted (made from these exact source files, its token file whole). prepare.py makes one."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass

import torch

from mingpt_ddp.corpus.encode import DTYPES
from mingpt_ddp.corpus.sources import CHUNK_BYTES, SourceFile
from mingpt_ddp.errors import DatasetError

META = "meta.json"
FORMAT, VERSION = "mingpt-ddp/char-tokens", 1


@dataclass
class Prepared:
    """A prepared copy that passed its checks: its directory and its meta.json."""

    directory: str
    meta: dict

    @property
    def tokens_path(self) -> str:
        return os.path.join(self.directory, self.meta["tokens_file"])

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.meta["dtype"]]


def prepared_dir(spec: str, cache_dir: str) -> str:
    """Where the prepared copy of a source lives: <cache_dir>/<name>-<hash of the absolute
    source>."""
    canonical = (
        spec
        if "://" in spec and not spec.startswith("file://")
        else os.path.abspath(os.path.expanduser(spec.removeprefix("file://")))
    )
    stem = (
        re.sub(
            r"[^\w.-]+", "_", os.path.splitext(os.path.basename(canonical.rstrip("/")))[0]
        ).strip("_")
        or "corpus"
    )
    return os.path.join(
        cache_dir, f"{stem[:40]}-{hashlib.sha256(canonical.encode()).hexdigest()[:12]}"
    )


def sampled_sha256(path: str, size: int, spans: int = 17, span_bytes: int = 1 << 16) -> str:
    """A checksum of `spans` evenly spaced pieces of a file: cost independent of its size, and it
    catches truncation, replacement and most damage. (The full sha256 is in meta.json, for
    --verify.)"""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for i in range(spans):
            f.seek(max(0, size - span_bytes) * i // (spans - 1))  # integer positions, first to last
            h.update(f.read(span_bytes))
    return h.hexdigest()


def _read_meta(directory: str) -> dict:
    with open(os.path.join(directory, META), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"not a {FORMAT} v{VERSION} meta.json")
    return meta


def _token_file_problem(prepared: Prepared) -> str | None:
    """Why the token file cannot be trusted (None: it can): missing, truncated, or damaged."""
    name, expected = (
        prepared.meta["tokens_file"],
        prepared.meta["num_tokens"] * prepared.dtype.itemsize,
    )
    try:
        size = os.path.getsize(prepared.tokens_path)
    except FileNotFoundError:
        return f"{name} is missing"
    if size != expected:
        return (
            f"{name} has {size:,} bytes where {expected:,} were written (truncated or overwritten)"
        )
    if sampled_sha256(prepared.tokens_path, size) != prepared.meta["tokens_sampled_sha256"]:
        return f"{name} is damaged (sampled checksum mismatch)"
    return None


def check(directory: str, files: list[SourceFile]) -> tuple[Prepared | None, str]:
    """The prepared copy in directory if it is complete and was made from these exact source files,
    else (None, why not)."""
    try:
        prepared = Prepared(directory, _read_meta(directory))
    except (FileNotFoundError, NotADirectoryError):
        return None, "not prepared yet"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"its {META} is unreadable ({e})"
    now, then = [s.describe() for s in files], prepared.meta["files"]
    if now != then:
        changed = next(
            (f"{a['url']} changed" for a, b in zip(now, then) if a != b),
            f"{len(then)} -> {len(now)} files",
        )
        return None, f"the source changed since it was prepared: {changed}"
    problem = _token_file_problem(prepared)
    return (None, problem) if problem else (prepared, "")


def is_prepared_dir(path: str) -> bool:
    return "://" not in path and os.path.isfile(os.path.join(path, META))


def verify(prepared: Prepared) -> None:
    """Recompute the token file's full sha256 (reads the whole file; ensure_prepared samples it)."""
    h = hashlib.sha256()
    with open(prepared.tokens_path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            h.update(block)
    if h.hexdigest() != prepared.meta["tokens_sha256"]:
        raise DatasetError(
            f"{prepared.tokens_path} is damaged (sha256 mismatch); delete {prepared.directory} "
            "and prepare it again"
        )
