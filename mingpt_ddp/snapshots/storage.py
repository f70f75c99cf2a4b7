"""Byte storage for snapshots: local/shared directories, S3 (boto3) and any other fsspec URL.

Every backend offers the same operations on named objects under one root:
write (all-or-nothing), read, delete, list, and a compare-and-swap pair for the
small objects that must have one writer (the manifest and the lease):
read_versioned returns an object with its version, write_if replaces it only if
that version is still current. The same library reads what it wrote for every
scheme: boto3 for s3://, fsspec for the others, plain files for paths (that routing, the S3
client and S3's error codes are mingpt_ddp/urls.py's, shared with the corpus's sources).
mingpt_ddp/snapshots/store.py builds manifests, checksums and retention on top of this.

Names may come from a manifest someone else wrote (a shared or downloaded run), so
every backend refuses a name that could leave the root (check_name).
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import shutil
import uuid

import fsspec

from mingpt_ddp.urls import backend_of, s3_client, s3_error_code, split_s3_url


def check_name(name: str) -> str:
    """An object name as this module accepts it: one plain name, or folder/name (a sharded
    snapshot's file). No absolute path, no '..' or '.', no backslash: nothing read from a manifest
    or a listing can reach outside the storage root, whatever it says."""
    parts = name.split("/") if isinstance(name, str) else []
    if (
        not 1 <= len(parts) <= 2
        or any(p in ("", ".", "..") for p in parts)
        or "\\" in name
        or "\0" in name
    ):
        raise ValueError(f"unsafe object name {name!r}: not a plain name under the snapshot path")
    return name


def _read_hashed(storage, name: str) -> tuple[bytes | None, str | None]:
    """read_versioned for backends without object versions: the version is the sha256 of the
    bytes."""
    try:
        data = storage.read(name)
    except FileNotFoundError:
        return None, None
    return data, hashlib.sha256(data).hexdigest()


def _compare_then_write(storage, name: str, data: bytes, version: str | None) -> str | None:
    """The body of write_if where the backend has no conditional write: atomic only under a lock."""
    if _read_hashed(storage, name)[1] != version:
        return None
    storage.write(name, data)
    return hashlib.sha256(data).hexdigest()


class LocalStorage:
    """A directory on a local or shared (NFS, Lustre) filesystem, with atomic writes."""

    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))

    def _path(self, name: str) -> str:
        return os.path.join(self.root, check_name(name))

    def write(self, name: str, data: bytes) -> None:
        final = self._path(name)
        directory = os.path.dirname(final)  # names may have one level of folder (sharded snapshots)
        os.makedirs(directory, exist_ok=True)
        name = os.path.basename(final)
        # Write beside the target (same filesystem, so the rename is atomic), flush
        # it to disk, then rename over the target: readers see the old file or the
        # complete new one, never a partial one.
        tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        # fsync the directory too, so the rename itself survives a power cut.
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def read(self, name: str) -> bytes:
        with open(self._path(name), "rb") as f:
            return f.read()

    def local_path(self, name: str) -> str:
        """Where name is on this filesystem: a reader can check and use it in place, uncopied."""
        return self._path(name)

    def read_versioned(self, name: str) -> tuple[bytes | None, str | None]:
        """The object and its version (a hash of its bytes), or (None, None) if it does not
        exist."""
        return _read_hashed(self, name)

    def write_if(self, name: str, data: bytes, version: str | None) -> str | None:
        """Compare-and-swap: replace name with data only if its version is still `version` (None:
        only if it does not exist). Returns the new version, or None if another writer got there
        first.

        Every writer of these objects takes an exclusive lock on a lock file beside them for the
        read-compare-write, so two of them cannot interleave. flock works on local filesystems and
        on NFSv4 (the Linux client turns it into an NFS lock); on a filesystem without locking (some
        FUSE mounts) two writers racing within one write can both succeed."""
        os.makedirs(self.root, exist_ok=True)
        fd = os.open(
            os.path.join(self.root, f".{check_name(name)}.lock"), os.O_CREAT | os.O_RDWR, 0o644
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return _compare_then_write(self, name, data, version)
        finally:
            os.close(fd)  # closing releases the lock

    def delete(self, name: str) -> None:
        path = self._path(name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)  # a sharded snapshot's folder
        elif os.path.exists(path):
            os.remove(path)

    def list(self) -> list[str]:
        """Names under the root, without hidden ones (temp files of writes in flight, lock
        files)."""
        return (
            [n for n in os.listdir(self.root) if not n.startswith(".")]
            if os.path.isdir(self.root)
            else []
        )


class S3Storage:
    """s3://bucket/prefix through boto3; works with AWS and S3-compatible servers (MinIO, Ceph, R2).

    Endpoint, region and credentials come from the standard AWS sources (environment,
    ~/.aws/config, instance roles), AWS_ENDPOINT_URL included; `endpoint_url` overrides
    the endpoint. An S3 object becomes visible only when its upload completes, so
    every write is all-or-nothing; big objects go up as parallel multipart uploads
    and come down as parallel ranged GETs.
    """

    def __init__(self, url: str, endpoint_url: str = ""):
        from boto3.s3.transfer import TransferConfig

        self.bucket, key = split_s3_url(url)
        self.prefix = key.strip("/")
        self.client = s3_client(endpoint_url)
        self.transfer = TransferConfig(
            multipart_threshold=16 << 20, multipart_chunksize=16 << 20, max_concurrency=8
        )

    def _key(self, name: str) -> str:
        check_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def write(self, name: str, data: bytes) -> None:
        self.client.upload_fileobj(
            io.BytesIO(data), self.bucket, self._key(name), Config=self.transfer
        )

    def read(self, name: str) -> bytes:
        from botocore.exceptions import ClientError

        buf = io.BytesIO()
        try:
            self.client.download_fileobj(self.bucket, self._key(name), buf, Config=self.transfer)
        except ClientError as e:
            if s3_error_code(e) in ("404", "NoSuchKey"):
                raise FileNotFoundError(f"s3://{self.bucket}/{self._key(name)}") from None
            raise
        return buf.getvalue()

    def read_versioned(self, name: str) -> tuple[bytes | None, str | None]:
        """The object and its ETag, or (None, None) if it does not exist."""
        from botocore.exceptions import ClientError

        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError as e:
            if s3_error_code(e) in ("404", "NoSuchKey"):
                return None, None
            raise
        return response["Body"].read(), response["ETag"]

    def write_if(self, name: str, data: bytes, version: str | None) -> str | None:
        """Compare-and-swap through S3's conditional writes: If-Match the ETag we read (or
        If-None-Match: * to create), so S3 itself refuses the write if another writer replaced the
        object in between. Returns the new ETag, or None if refused."""
        from botocore.exceptions import ClientError

        condition = {"IfMatch": version} if version else {"IfNoneMatch": "*"}
        try:
            return self.client.put_object(
                Bucket=self.bucket, Key=self._key(name), Body=data, **condition
            )["ETag"]
        except ClientError as e:
            if s3_error_code(e) in (
                "PreconditionFailed",
                "ConditionalRequestConflict",
            ):
                return None
            raise

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(name))

    def list(self) -> list[str]:
        prefix = f"{self.prefix}/" if self.prefix else ""
        names = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        ):
            names += [
                obj["Key"][len(prefix) :]
                for obj in page.get("Contents", [])
                if "/" not in obj["Key"][len(prefix) :]
            ]
        return names


class FsspecStorage:
    """Any other fsspec URL (memory://, gs://, az://, ... when their packages are installed).
    Object stores publish an object only when its upload completes."""

    def __init__(self, url: str):
        self.fs, self.root = fsspec.core.url_to_fs(url)

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{check_name(name)}"

    def write(self, name: str, data: bytes) -> None:
        self.fs.makedirs(self._path(name).rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(self._path(name), data)

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(self._path(name))

    def read_versioned(self, name: str) -> tuple[bytes | None, str | None]:
        return _read_hashed(self, name)

    def write_if(self, name: str, data: bytes, version: str | None) -> str | None:
        """Compare, then write: fsspec has no conditional write, so two writers racing within one
        round trip can both succeed here (S3 and local paths have a real compare-and-swap)."""
        return _compare_then_write(self, name, data, version)

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


Storage = LocalStorage | S3Storage | FsspecStorage


def open_storage(url: str, s3_endpoint_url: str = "") -> Storage:
    """Plain paths and file:// are local, s3:// goes through boto3, everything else through
    fsspec (urls.backend_of: the corpus reads URLs by the same rule)."""
    kind, target = backend_of(url)
    if kind == "local":
        return LocalStorage(target)
    if kind == "s3":
        return S3Storage(target, s3_endpoint_url)
    return FsspecStorage(target)
