"""Where a corpus's text comes from: local files, globs, S3 and fsspec URLs, read in bounded
chunks.

data_config.path names one file or several (a glob, concatenated in name order). Each
becomes a SourceFile: its URL, its size, an identity that changes when the file does
(mtime for local files, the ETag on S3, fsspec's ukey elsewhere), and a way to stream
its bytes. A file named .gz, .bz2, .xz, .lzma or .zst (zstd needs the zstandard package) is
decompressed as it is read; its size and identity stay the compressed file's. prepare.py reads
every source this way, twice, with memory bounded by the
chunk size whatever the corpus size; it compares identities to know when a prepared
copy is stale. Which library reads which URL, and the S3 client, are mingpt_ddp/urls.py's, the
same as the snapshot store's (a corpus must not need the snapshot code to be read).
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import fsspec
import fsspec.compression
import fsspec.utils

from mingpt_ddp.errors import DatasetError
from mingpt_ddp.urls import backend_of, s3_client, s3_error_code, split_s3_url, storage_hint

CHUNK_BYTES = 16 << 20  # memory per pass is a few times this, whatever the corpus size
_GLOB = re.compile(r"[*?\[]")


@dataclass
class SourceFile:
    """One file of the corpus: where it is, its size, and what identifies this version of it."""

    url: str
    size: int
    identity: dict  # changes whenever the file does (see the three finders below)
    open_blocks: Callable[[], Iterator[bytes]] = field(repr=False, compare=False)

    def describe(self) -> dict:
        return {"url": self.url, "bytes": self.size, "identity": self.identity}


def _directory_hint(name: str) -> DatasetError:
    return DatasetError(
        f"data_config.path: {name!r} is a directory; name its files with a glob, "
        f"e.g. data_config.path='{name.rstrip('/')}/*.txt'"
    )


def compression_of(url: str) -> str | None:
    """The codec a file's name says it is compressed with (fsspec's names: gzip for .gz, bz2, xz,
    lzma, zstd for .zst), or None for plain text."""
    codec = fsspec.utils.infer_compression(url)
    if codec is None and url.endswith(
        (".zst", ".zstd")
    ):  # fsspec knows zstd only when it can read it
        raise DatasetError(
            f"data_config.path: {url} is zstd-compressed; to read it: pip install -e '.[zstd]'"
        )
    if codec == "zip":
        raise DatasetError(
            f"data_config.path: {url} is a zip archive, not one compressed file; unzip it "
            "and name its files (a glob), or compress them with gzip, bzip2, xz or zstd"
        )
    return codec


def _blocks(url: str, open_raw: Callable[[], BinaryIO]) -> Callable[[], Iterator[bytes]]:
    """A reader of the file's bytes in CHUNK_BYTES blocks, decompressed on the way if its name says
    it is compressed (fsspec's codecs read streams, so memory stays bounded whatever the size)."""
    codec = compression_of(url)

    def blocks() -> Iterator[bytes]:
        with open_raw() as raw:
            f = (
                fsspec.compression.compr[codec](raw, mode="rb")
                if codec
                else contextlib.nullcontext(raw)
            )
            with f as stream:
                while block := stream.read(CHUNK_BYTES):
                    yield block

    return blocks


def _local_files(spec: str) -> list[SourceFile]:
    path = os.path.expanduser(spec)
    # A name that exists is a file name, even with [ ] ? * in it; only otherwise is it a glob.
    is_glob = not os.path.exists(path) and bool(_GLOB.search(path))
    files = []
    for name in sorted(glob.glob(path)) if is_glob else [path] if os.path.exists(path) else []:
        if os.path.isdir(name):
            if is_glob:
                continue
            raise _directory_hint(name)
        st = os.stat(name)
        blocks = _blocks(name, lambda name=name: open(name, "rb"))
        # mtime alone misses a same-size rewrite that keeps it (cp -p, rsync -a, touch -r);
        # the inode change time (ctime) cannot be set from user space.
        identity = {"mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}
        files.append(SourceFile(os.path.abspath(name), st.st_size, identity, blocks))
    return files


def _s3_files(spec: str, endpoint_url: str) -> list[SourceFile]:
    bucket, key = split_s3_url(spec)
    client = s3_client(endpoint_url)

    def source(key: str, size: int, etag: str) -> SourceFile:
        # IfMatch: a GET of a changed object fails instead of mixing versions
        body = lambda: client.get_object(Bucket=bucket, Key=key, IfMatch=etag)["Body"]  # noqa: E731
        return SourceFile(f"s3://{bucket}/{key}", size, {"etag": etag}, _blocks(key, body))

    try:  # the key as written (an object may have [ ] ? * in its name)
        head = client.head_object(Bucket=bucket, Key=key)
        return [source(key, head["ContentLength"], head["ETag"])]
    except Exception as e:  # noqa: BLE001 - a missing key is "no file" (or a glob); anything else is reported
        if s3_error_code(e) not in ("404", "NoSuchKey"):
            raise
    if not _GLOB.search(key):
        return []
    # A glob: list the prefix before the first wildcard, match the rest part by part ('*' stops at
    # '/').
    prefix, parts = key[: _GLOB.search(key).start()], key.split("/")
    found = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            names = obj["Key"].split("/")
            if (
                len(names) == len(parts)
                and all(map(fnmatch.fnmatchcase, names, parts))
                and names[-1]
            ):
                found.append(
                    source(obj["Key"], obj["Size"], obj["ETag"])
                )  # (names[-1] == "": a folder marker)
    return sorted(found, key=lambda s: s.url)


def _fsspec_identity(fs, path: str, info: dict) -> dict:
    """What changes when the file does: modification time, ETag or checksum where the filesystem
    reports one. fsspec's ukey hashes all of info, which on some (sftp, smb) includes the access
    time, so reading the file would change it; it is the fallback only."""
    stable = {
        k: str(info[k])
        for k in (
            "mtime",
            "LastModified",
            "last_modified",
            "updated",
            "ETag",
            "etag",
            "md5Hash",
            "crc32c",
            "created",
        )
        if k in info
    }
    return stable or {"ukey": fs.ukey(path)}


def _fsspec_files(spec: str) -> list[SourceFile]:
    fs, path = fsspec.core.url_to_fs(spec)
    is_glob = not fs.exists(path) and bool(_GLOB.search(path))
    files = []
    for p in sorted(fs.glob(path)) if is_glob else [path] if fs.exists(path) else []:
        info = fs.info(p)
        if info["type"] != "file":
            if is_glob:
                continue
            raise _directory_hint(spec)

        blocks = _blocks(p, lambda p=p: fs.open(p, "rb"))
        files.append(
            SourceFile(fs.unstrip_protocol(p), info["size"], _fsspec_identity(fs, p, info), blocks)
        )
    return files


def find_sources(spec: str, s3_endpoint_url: str = "") -> list[SourceFile]:
    """The files data_config.path names (a path, an s3:// or fsspec URL, or a glob of them), in name
    order."""
    kind, target = backend_of(spec)
    try:
        if kind == "s3":
            files = _s3_files(target, s3_endpoint_url)
        elif kind == "fsspec":
            files = _fsspec_files(target)
        else:
            files = _local_files(target)
    except DatasetError:
        raise
    except Exception as e:  # noqa: BLE001 - unreachable storage, credentials, a missing fsspec package...
        hint = storage_hint(e, "data_config.path", "check data_config.path")
        raise DatasetError(
            f"data_config.path: cannot read {spec!r} ({type(e).__name__}: {e}); {hint}"
        ) from None
    if not files:
        raise DatasetError(
            f"data_config.path: no file at {spec!r}; set data_config.path=<your UTF-8 text> "
            "or fetch tiny Shakespeare with: python data/fetch_shakespeare.py"
        )
    return files


_BOM = "\ufeff".encode()


def _read_blocks(source: SourceFile) -> Iterator[bytes]:
    """The file's bytes as they arrive, with read failures turned into one-line errors."""
    try:
        yield from source.open_blocks()
    except Exception as e:  # noqa: BLE001 - a vanished file, an I/O error, a dropped connection...
        if s3_error_code(e) in ("412", "PreconditionFailed"):
            raise DatasetError(
                f"data_config.path: {source.url} changed while it was being prepared; run again "
                "once nothing writes to it"
            ) from None
        raise DatasetError(
            f"data_config.path: cannot read {source.url} ({type(e).__name__}: {e})"
        ) from None


def chunks(source: SourceFile) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of the file, cut at character boundaries: a UTF-8 character split
    between two reads is carried into the next chunk, so every chunk decodes on its own.
    A leading byte-order mark (some editors write one) is not text, and is dropped."""
    carry, offset = b"", 0
    for block in _read_blocks(source):
        buf = carry + block
        if offset == 0 and len(buf) < len(_BOM) and _BOM.startswith(buf):
            carry = buf  # too short yet to tell whether the file starts with a BOM
            continue
        if offset == 0 and buf.startswith(_BOM):
            buf, offset = buf[len(_BOM) :], len(_BOM)
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
        raise DatasetError(
            f"data_config.path: {source.url!r} is not UTF-8 text (undecodable byte at offset "
            f"{offset + e.start}); convert it to UTF-8 first"
        ) from None
