"""Where a corpus's text comes from: local files, globs, S3 and fsspec URLs, read in bounded chunks.

data_config.path names one file or several (a glob, concatenated in name order). Each
becomes a SourceFile: its URL, its size, an identity that changes when the file does
(mtime for local files, the ETag on S3, fsspec's ukey elsewhere), and a way to stream
its bytes. prepare.py reads every source this way, twice, with memory bounded by the
chunk size whatever the corpus size; it compares identities to know when a prepared
copy is stale.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator

import fsspec

CHUNK_BYTES = 16 << 20  # memory per pass is a few times this, whatever the corpus size
_GLOB = re.compile(r"[*?\[]")


class DatasetError(ValueError):
    """The corpus cannot be used as configured; the message says what to change."""


@dataclass
class SourceFile:
    """One file of the corpus: where it is, its size, and what identifies this version of it."""

    url: str
    size: int
    identity: dict  # {"mtime_ns"} local, {"etag"} S3, {"ukey"} other fsspec: changes when the file does
    open_blocks: Callable[[], Iterator[bytes]] = field(repr=False, compare=False)

    def describe(self) -> dict:
        return {"url": self.url, "bytes": self.size, "identity": self.identity}


def _local_files(spec: str) -> list[SourceFile]:
    path = os.path.expanduser(spec)
    names = sorted(glob.glob(path)) if _GLOB.search(path) else [path] if os.path.exists(path) else []
    files = []
    for name in names:
        if os.path.isdir(name):
            if _GLOB.search(path):
                continue
            raise DatasetError(f"data_config.path: {name!r} is a directory; name its files with a glob, "
                               f"e.g. data_config.path='{name.rstrip('/')}/*.txt'")
        st = os.stat(name)

        def blocks(name=name) -> Iterator[bytes]:
            with open(name, "rb") as f:
                while block := f.read(CHUNK_BYTES):
                    yield block

        files.append(SourceFile(os.path.abspath(name), st.st_size, {"mtime_ns": st.st_mtime_ns}, blocks))
    return files


def _s3_files(spec: str, endpoint_url: str) -> list[SourceFile]:
    from storage import s3_client

    bucket, _, key = spec[len("s3://"):].partition("/")
    client = s3_client(endpoint_url)

    def source(key: str, size: int, etag: str) -> SourceFile:
        def blocks() -> Iterator[bytes]:  # IfMatch: a GET of a changed object fails instead of mixing versions
            yield from client.get_object(Bucket=bucket, Key=key, IfMatch=etag)["Body"].iter_chunks(CHUNK_BYTES)
        return SourceFile(f"s3://{bucket}/{key}", size, {"etag": etag}, blocks)

    if not _GLOB.search(key):
        try:
            head = client.head_object(Bucket=bucket, Key=key)
        except Exception as e:  # noqa: BLE001 - a missing key is "no file"; anything else is reported
            if getattr(e, "response", {}).get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                return []
            raise
        return [source(key, head["ContentLength"], head["ETag"])]
    # A glob: list the prefix before the first wildcard, match the rest part by part ('*' stops at '/').
    prefix, parts = key[:_GLOB.search(key).start()], key.split("/")
    found = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            names = obj["Key"].split("/")
            if len(names) == len(parts) and all(map(fnmatch.fnmatchcase, names, parts)):
                found.append(source(obj["Key"], obj["Size"], obj["ETag"]))
    return sorted(found, key=lambda s: s.url)


def _fsspec_files(spec: str) -> list[SourceFile]:
    fs, path = fsspec.core.url_to_fs(spec)
    paths = sorted(fs.glob(path)) if _GLOB.search(path) else [path] if fs.exists(path) else []
    files = []
    for p in paths:
        info = fs.info(p)
        if info["type"] != "file":
            continue

        def blocks(p=p) -> Iterator[bytes]:
            with fs.open(p, "rb") as f:
                while block := f.read(CHUNK_BYTES):
                    yield block

        files.append(SourceFile(fs.unstrip_protocol(p), info["size"], {"ukey": fs.ukey(p)}, blocks))
    return files


def find_sources(spec: str, s3_endpoint_url: str = "") -> list[SourceFile]:
    """The files data_config.path names (a path, an s3:// or fsspec URL, or a glob of them), in name order."""
    from storage import storage_hint

    try:
        if spec.startswith("s3://"):
            files = _s3_files(spec, s3_endpoint_url)
        elif "://" in spec and not spec.startswith("file://"):
            files = _fsspec_files(spec)
        else:
            files = _local_files(spec.removeprefix("file://"))
    except DatasetError:
        raise
    except Exception as e:  # noqa: BLE001 - unreachable storage, credentials, a missing fsspec package...
        hint = storage_hint(e, "data_config.path", "check data_config.path")
        raise DatasetError(f"data_config.path: cannot read {spec!r} ({type(e).__name__}: {e}); {hint}") from None
    if not files:
        raise DatasetError(f"data_config.path: no file at {spec!r}; set data_config.path=<your UTF-8 text> "
                           "or fetch tiny Shakespeare with: python data/fetch_shakespeare.py")
    return files


# ------------------------------------------------------------------ encoding, in bounded chunks
def chunks(source: SourceFile) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of the file, cut at character boundaries: a UTF-8 character split
    between two reads is carried into the next chunk, so every chunk decodes on its own."""
    carry, offset = b"", 0
    for block in source.open_blocks():
        buf = carry + block
        cut = len(buf)
        for i in range(len(buf) - 1, max(len(buf) - 4, 0) - 1, -1):
            if buf[i] & 0xC0 != 0x80:  # not a continuation byte: the last character starts here
                cut = i
                break
        yield offset, buf[:cut]
        offset, carry = offset + cut, buf[cut:]
    if carry:
        yield offset, carry


def decode(source: SourceFile, offset: int, chunk: bytes) -> str:
    try:
        return chunk.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"data_config.path: {source.url!r} is not UTF-8 text (undecodable byte at offset "
                           f"{offset + e.start}); convert it to UTF-8 first") from None
