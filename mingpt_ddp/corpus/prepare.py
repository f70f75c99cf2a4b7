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

The source is streamed in chunks twice (sources.py; pass 1 finds the vocabulary, pass 2
encodes, encode.py), so memory is bounded whatever its size. Several files are joined as they
are, like `cat` (add a trailing newline to each if they need one); a leading byte-order mark is
dropped from each. A copy is reused (prepared.py checks it) while the source files keep the
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
import sys
import time
import uuid
from collections.abc import Callable, Iterator

from mingpt_ddp.config.data import DEFAULT_CACHE_DIR
from mingpt_ddp.corpus.encode import DTYPES, Encoder, smallest_dtype, vocabulary
from mingpt_ddp.corpus.prepared import (
    FORMAT,
    META,
    VERSION,
    Prepared,
    _read_meta,
    _token_file_problem,
    check,
    is_prepared_dir,
    prepared_dir,
    sampled_sha256,
    verify,
)
from mingpt_ddp.corpus.sources import (
    SourceFile,
    chunks,
    compression_of,
    decode,
    find_sources,
)
from mingpt_ddp.errors import DatasetError


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
                text = lambda s=source, o=offset, c=chunk: decode(s, o, c)  # only if needed
                ids = encoder.encode(chunk, text)
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
    """Both passes, checked against each other, then the commit (meta.json) and the log line."""
    t0 = time.perf_counter()
    vocab, n_chars = vocabulary(files)  # pass 1
    if n_chars == 0:
        raise DatasetError(f"data_config.path: {spec!r} is empty; point it at UTF-8 text")
    dtype = smallest_dtype(len(vocab))
    pending: list[str] = []  # what to remove if this does not end in a commit
    try:
        written = _encode_to_file(directory, files, vocab, pending)  # pass 2
        _check_unchanged(spec, files, s3_endpoint_url, written, n_chars * DTYPES[dtype].itemsize)
        tokens_path = os.path.join(directory, written["tokens_file"])
        meta = _meta(spec, files, vocab, dtype, n_chars, written, tokens_path, t0)
        _commit(directory, meta, pending)
        pending.clear()
    except OSError as e:
        raise DatasetError(
            f"data_config.cache_dir: cannot write the prepared copy in {directory!r} "
            f"({type(e).__name__}: {e}); free space or set data_config.cache_dir=<a writable "
            "directory>"
        ) from None
    finally:
        _remove(pending)
    if locked:  # nobody else writes here now: clear what older versions and killed preparers left
        _remove_leftovers(directory, keep=written["tokens_file"])
    seconds, mb = time.perf_counter() - t0, meta["source_bytes"] / 1e6
    packed = " compressed" if any(compression_of(s.url) for s in files) else ""
    log(
        f"data | prepared {n_chars:,} characters ({mb:.1f} MB{packed}) in {seconds:.2f} s "
        f"({mb / max(seconds, 1e-9):.0f} MB/s) | vocabulary {len(vocab)} | {dtype} ids in "
        f"{tokens_path}"
    )


def _check_unchanged(spec, files, s3_endpoint_url: str, written: dict, expected: int) -> None:
    """The two passes must have read the same text: pass 2 maps a character pass 1 never saw to
    id 0. Refuse a source that changed while it was read."""
    if written["tokens_bytes"] != expected:
        changed = "the two passes read different numbers of characters"
    elif [s.describe() for s in find_sources(spec, s3_endpoint_url)] != [
        s.describe() for s in files
    ]:
        changed = "its files' sizes or identities are not what they were before pass 1"
    else:
        return
    raise DatasetError(
        f"data_config.path: {spec!r} changed while it was being prepared ({changed}); "
        "run again once nothing writes to it"
    )


def _meta(spec, files, vocab, dtype, n_chars, written, tokens_path, t0) -> dict:
    """meta.json: what was prepared from what, and the checksums that say it is still whole."""
    return {
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


def _remove_leftovers(directory: str, keep: str) -> None:
    """Token files of older versions, and the temporary files of killed preparers."""
    old = [n for n in os.listdir(directory) if n.startswith("tokens-") or n.endswith(".tmp")]
    _remove(os.path.join(directory, n) for n in old if n != keep)


def _remove(paths) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.remove(path)


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
        return _given_prepared(spec)
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
            prepared, problem = check(directory, files)  # whoever held the lock may have made it
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


def _given_prepared(spec: str) -> Prepared:
    """data_config.path names a prepared directory: used as it is, if it is whole."""
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
    verified = " | full sha256 verified" if args.verify else ""
    print(
        f"ready | {prepared.directory} | {m['num_tokens']:,} {m['dtype']} ids | "
        f"vocabulary {m['vocab_size']} | from {len(m['files'])} file(s), "
        f"{m['source_bytes']:,} bytes{verified}"
    )
    return 0
