"""The prepare step: a UTF-8 corpus in, a file of token ids out, once, for every rank that trains
on it (the command: prepare.py at the top of the checkout).

Why: holding the text in memory costs every rank ~30 bytes per character (the str,
its code points, int64 ids), times the ranks on a node. Encoded once into a flat file
of ids, 1 byte per character (2 or 4 for vocabularies over 256 or 32767 characters),
the corpus is read window by window (char_dataset.TokenFile), so a rank's memory does
not grow with the corpus and the ranks of a node share one copy in the OS page cache.

One prepared copy per source, under data_config.cache_dir:

    meta.json                   vocabulary, dtype, counts, the source files' sizes and identities,
                                the token file's name and checksums. Written last: it is the commit.
    tokens-<sha256[:16]>.bin    the ids, little-endian. Named by content, never rewritten in place.

The source is streamed in chunks twice (mingpt_ddp/corpus/sources.py; pass 1 finds the vocabulary, pass 2 encodes), so
memory is bounded whatever its size. Several files are joined as they are, like `cat` (add a
trailing newline to each if they need one); a leading byte-order mark is dropped from each. A copy is reused while the source files keep the
sizes and identities in meta.json (mtime, S3 ETag, fsspec ukey) and the token file
passes its size and sampled-checksum checks; otherwise it is rebuilt, never trained on.
One process prepares while the others wait on a file lock, so the ranks of a node (or of
every node, on a shared filesystem) prepare it once.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from mingpt_ddp.config.data import DEFAULT_CACHE_DIR
from mingpt_ddp.corpus.sources import (
    CHUNK_BYTES,
    SourceFile,
    chunks,
    compression_of,
    decode,
    find_sources,
)
from mingpt_ddp.errors import DatasetError

META = "meta.json"
FORMAT, VERSION = "mingpt-ddp/char-tokens", 1
DTYPES = {"uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32}
_UNICODE = 0x110000  # code points


def _code_points(text: str) -> torch.Tensor:
    """(len(text),) int32 code points; a view of the UTF-32 bytes (read-only, never written)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "buffer is not writable": we only read it
        return (
            torch.frombuffer(text.encode("utf-32-le"), dtype=torch.int32)
            if text
            else torch.zeros(0, dtype=torch.int32)
        )


def vocabulary(files: list[SourceFile]) -> tuple[str, int]:
    """Pass 1: every distinct character of the files, sorted by code point, and how many characters there are."""
    present = torch.zeros(_UNICODE, dtype=torch.bool)
    known_ascii, n_chars = b"", 0
    for source in files:
        for offset, chunk in chunks(source):
            n_chars += len(decode(source, offset, chunk))  # also proves the chunk is UTF-8
            # Deleting the ASCII characters already seen (fast, bytes.translate) leaves valid UTF-8
            # (no multi-byte character contains an ASCII byte): only what is left needs a closer look.
            rest = chunk.translate(None, known_ascii)
            if rest:
                present |= torch.bincount(
                    _code_points(rest.decode("utf-8")), minlength=_UNICODE
                ).bool()
                known_ascii = bytes(present[:128].nonzero().flatten().tolist())
    return "".join(map(chr, present.nonzero().flatten().tolist())), n_chars


def smallest_dtype(vocab_size: int) -> str:
    return "uint8" if vocab_size <= 256 else "int16" if vocab_size <= 32767 else "int32"


class Encoder:
    """Characters to ids in bulk: a table indexed by code point (and a byte table for ASCII text)."""

    def __init__(self, vocab: str):
        self.dtype = DTYPES[smallest_dtype(len(vocab))]
        self.table = torch.zeros(_UNICODE, dtype=self.dtype)
        self.table[_code_points(vocab).long()] = torch.arange(len(vocab)).to(self.dtype)
        # ASCII text with a <= 256-character vocabulary: bytes.translate maps every byte to its id directly.
        self.ascii = bytes(self.table[:256].tolist()) if self.dtype == torch.uint8 else None

    def encode(self, text_bytes: bytes, text: Callable[[], str]) -> bytearray | bytes:
        """The ids of one chunk, as raw bytes in the token dtype (text() decodes the chunk if needed)."""
        if self.ascii is not None and text_bytes.isascii():
            return text_bytes.translate(self.ascii)
        cps = _code_points(text())
        out = bytearray(cps.numel() * self.dtype.itemsize)
        if out:
            torch.index_select(self.table, 0, cps, out=torch.frombuffer(out, dtype=self.dtype))
        return out


# ------------------------------------------------------------------ the prepared copy
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
    """Where the prepared copy of a source lives: <cache_dir>/<name>-<hash of the absolute source>."""
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
    """A checksum of `spans` evenly spaced pieces of a file: cost independent of its size, and it catches
    truncation, replacement and most damage. (The full sha256 is in meta.json, for --verify.)"""
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


@contextlib.contextmanager
def _exclusive(lock_file, directory: str, log: Callable[[str], None]) -> Iterator[bool]:
    """Hold an flock on the open lock_file while preparing; yields whether the lock is really held.

    The kernel drops a flock when its process dies, so a preparer killed mid-way never
    leaves a stale lock behind. Filesystems without flock (NFS without lockd, Lustre
    without -o flock) run unlocked: each writer then writes its own temporary files and
    renames them into place, so the result is still one complete copy, prepared twice.
    """
    try:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"data | another process is preparing {directory}; waiting for it")
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        locked = True
    except OSError:
        locked = False
    yield locked  # closing lock_file releases the lock


def _encode_to_file(
    directory: str, files: list[SourceFile], vocab: str, pending: list[str]
) -> dict:
    """Pass 2: encode every file into one token file in directory, named by its sha256.
    Paths written go into `pending` (removed by the caller unless the copy is committed)."""
    encoder = Encoder(vocab)
    tmp = os.path.join(directory, f".tokens-{uuid.uuid4().hex}.tmp")
    pending.append(tmp)
    source_hash, tokens_hash, written = hashlib.sha256(), hashlib.sha256(), 0
    with open(tmp, "wb") as out:
        for source in files:
            for offset, chunk in chunks(source):
                ids = encoder.encode(chunk, lambda: decode(source, offset, chunk))
                source_hash.update(chunk)
                tokens_hash.update(ids)
                out.write(ids)
                written += len(ids)
        out.flush()
        os.fsync(out.fileno())
    name = f"tokens-{tokens_hash.hexdigest()[:16]}.bin"
    os.replace(tmp, os.path.join(directory, name))
    pending.append(os.path.join(directory, name))
    return {
        "tokens_file": name,
        "tokens_bytes": written,
        "tokens_sha256": tokens_hash.hexdigest(),
        "source_sha256": source_hash.hexdigest(),
    }


def _commit(directory: str, meta: dict, pending: list[str]) -> None:
    """Write meta.json atomically (temp file, fsync, rename): from then on the copy exists."""
    tmp = os.path.join(directory, f".{META}.{uuid.uuid4().hex}.tmp")
    pending.append(tmp)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, ensure_ascii=False, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, META))


def _build(
    directory: str,
    spec: str,
    files: list[SourceFile],
    s3_endpoint_url: str,
    locked: bool,
    log: Callable[[str], None],
) -> None:
    t0 = time.perf_counter()
    vocab, n_chars = vocabulary(files)  # pass 1
    if n_chars == 0:
        raise DatasetError(f"data_config.path: {spec!r} is empty; point it at UTF-8 text")
    dtype = smallest_dtype(len(vocab))
    pending: list[str] = []  # what to remove if this does not end in a commit
    try:
        written = _encode_to_file(directory, files, vocab, pending)  # pass 2
        # The two passes must have read the same text: pass 2 maps a character pass 1 never saw to id 0.
        if written["tokens_bytes"] != n_chars * DTYPES[dtype].itemsize:
            changed = "the two passes read different numbers of characters"
        elif [s.describe() for s in find_sources(spec, s3_endpoint_url)] != [
            s.describe() for s in files
        ]:
            changed = "its files' sizes or identities are not what they were before pass 1"
        else:
            changed = ""
        if changed:
            raise DatasetError(
                f"data_config.path: {spec!r} changed while it was being prepared ({changed}); "
                "run again once nothing writes to it"
            )
        tokens_path = os.path.join(directory, written["tokens_file"])
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "source": spec,
            "files": [s.describe() for s in files],
            "source_bytes": sum(s.size for s in files),
            "source_sha256": written["source_sha256"],
            "vocab": vocab,
            "vocab_size": len(vocab),
            "dtype": dtype,
            "num_tokens": n_chars,
            "tokens_file": written["tokens_file"],
            "tokens_sha256": written["tokens_sha256"],
            "tokens_sampled_sha256": sampled_sha256(tokens_path, written["tokens_bytes"]),
            "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "prepare_seconds": round(time.perf_counter() - t0, 3),
        }
        _commit(directory, meta, pending)
        pending.clear()
    except OSError as e:
        raise DatasetError(
            f"data_config.cache_dir: cannot write the prepared copy in {directory!r} "
            f"({type(e).__name__}: {e}); free space or set data_config.cache_dir=<a writable "
            "directory>"
        ) from None
    finally:
        for path in pending:
            with contextlib.suppress(OSError):
                os.remove(path)
    if locked:  # nobody else writes here now: clear what older versions and killed preparers left
        for old in os.listdir(directory):
            if old != written["tokens_file"] and (
                old.startswith("tokens-") or old.endswith(".tmp")
            ):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(directory, old))
    seconds, mb = time.perf_counter() - t0, meta["source_bytes"] / 1e6
    packed = " compressed" if any(compression_of(s.url) for s in files) else ""
    log(
        f"data | prepared {n_chars:,} characters ({mb:.1f} MB{packed}) in {seconds:.2f} s ({mb / max(seconds, 1e-9):.0f} MB/s)"
        f" | vocabulary {len(vocab)} | {dtype} ids in {tokens_path}"
    )


def is_prepared_dir(path: str) -> bool:
    return "://" not in path and os.path.isfile(os.path.join(path, META))


def ensure_prepared(
    spec: str,
    cache_dir: str = DEFAULT_CACHE_DIR,
    s3_endpoint_url: str = "",
    log: Callable[[str], None] = print,
) -> Prepared:
    """The prepared copy of data_config.path, preparing it first if it is missing or stale.

    spec may also be a prepared directory itself (one made elsewhere and copied here):
    it is then used as it is, with no source to compare against.
    """
    if is_prepared_dir(spec):
        try:
            prepared = Prepared(spec, _read_meta(spec))
        except (ValueError, KeyError, TypeError) as e:
            raise DatasetError(
                f"data_config.path: {spec!r} has an unreadable {META} ({e}); prepare it again"
            ) from None
        if problem := _token_file_problem(prepared):
            raise DatasetError(
                f"data_config.path: {spec!r} is a prepared copy, but {problem}; prepare it again "
                "from its source"
            )
        return prepared
    files = find_sources(spec, s3_endpoint_url)
    directory = prepared_dir(spec, cache_dir)
    prepared, problem = check(directory, files)
    if prepared is None:
        try:
            os.makedirs(directory, exist_ok=True)
            lock_file = open(os.path.join(directory, ".lock"), "a")
        except OSError as e:
            raise DatasetError(
                f"data_config.cache_dir: cannot write in {directory!r} ({e}), where the prepared "
                f"copy needs (re)building ({problem}); set data_config.cache_dir=<a writable "
                "directory>"
            ) from None
        with lock_file, _exclusive(lock_file, directory, log) as locked:
            prepared, problem = check(
                directory, files
            )  # whoever held the lock may have prepared it
            if prepared is None:
                log(f"data | preparing {spec} -> {directory} ({problem})")
                _build(directory, spec, files, s3_endpoint_url, locked, log)
                prepared, problem = check(directory, files)
    if prepared is None:
        raise DatasetError(
            f"data_config.path: the prepared copy of {spec!r} in {directory!r} is unusable "
            f"right after preparing it ({problem})"
        )
    return prepared


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Prepare a UTF-8 corpus for training (main.py does this on first use)."
    )
    p.add_argument(
        "source",
        help="as data_config.path: a file, a glob ('books/*.txt'), an s3:// or fsspec URL, "
        "or a prepared directory",
    )
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="as data_config.cache_dir")
    p.add_argument(
        "--s3-endpoint-url",
        default="",
        help="as trainer_config.s3_endpoint_url (MinIO, Ceph, R2...)",
    )
    p.add_argument(
        "--verify", action="store_true", help="also recompute the token file's full sha256"
    )
    args = p.parse_args(argv)
    try:
        prepared = ensure_prepared(args.source, args.cache_dir, args.s3_endpoint_url)
        if args.verify:
            verify(prepared)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    m = prepared.meta
    print(
        f"ready | {prepared.directory} | {m['num_tokens']:,} {m['dtype']} ids | vocabulary {m['vocab_size']} | "
        f"from {len(m['files'])} file(s), {m['source_bytes']:,} bytes{' | full sha256 verified' if args.verify else ''}"
    )
    return 0
