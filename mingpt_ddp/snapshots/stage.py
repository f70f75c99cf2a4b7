"""Where a multi-file snapshot's files wait to be read: DCP and DeepSpeed read a local directory.

On a filesystem the store's own files are checked in place and linked into a folder of this
rank's (no copy). From object storage (S3) they must be downloaded; the ranks of one node share
one download of each snapshot instead of each fetching all of it (8 copies on an 8-GPU node).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator


def own_stage(kind: str, fill: Callable[[str], None]) -> tuple[str, Callable[[], None]]:
    """A folder of this rank's, filled by fill(folder); returns it and how to remove it."""
    folder = tempfile.mkdtemp(prefix=f"{kind}-load-")
    _fill(folder, fill)
    return folder, lambda: shutil.rmtree(folder, ignore_errors=True)


def _fill(folder: str, fill: Callable[[str], None]) -> None:
    """fill(folder), or, if it fails, no folder left half-filled."""
    try:
        fill(folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


class NodeStage:
    """A staging folder the ranks of one node share for one snapshot: the first to open it fills
    it (downloads and checks every file) while the others wait on its lock, they reuse it, and
    the last to close it removes it. A folder no open user counts (left by a killed job) is
    filled again rather than trusted."""

    def __init__(self, entry: dict):
        # Named after what the snapshot holds: its name and every file's fingerprint.
        what = json.dumps([entry["file"], entry["files"]], sort_keys=True).encode()
        name = f"mingpt-stage-{hashlib.sha256(what).hexdigest()[:20]}"
        self.folder = os.path.join(tempfile.gettempdir(), name)
        self._users_file = self.folder + ".users"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.folder + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _users(self) -> int:
        try:
            with open(self._users_file) as f:
                return int(f.read() or 0)
        except (OSError, ValueError):
            return 0

    def _set_users(self, n: int) -> None:
        with open(self._users_file, "w") as f:
            f.write(str(n))

    def open(self, fill: Callable[[str], None]) -> tuple[str, Callable[[], None]]:
        """The shared folder, filled by fill(folder) if no one has; returns it and how to leave."""
        with self._locked():
            users = self._users()
            if users == 0:
                shutil.rmtree(self.folder, ignore_errors=True)
                os.makedirs(self.folder)
                _fill(self.folder, fill)
            self._set_users(users + 1)
        return self.folder, self._leave

    def _leave(self) -> None:
        with self._locked():
            users = self._users() - 1
            if users > 0:
                self._set_users(users)
                return
            shutil.rmtree(self.folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.remove(self._users_file)  # (the empty lock file stays: removing it races)
