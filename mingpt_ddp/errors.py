"""The mistakes a user can fix, as exception types every part of the package can raise (a leaf:
it imports nothing of the project, so no module needs another just for its error type)."""


class ConfigError(ValueError):
    """A user-fixable configuration problem; the message names the setting to change."""


class DatasetError(ValueError):
    """The corpus cannot be used as configured; the message says what to change."""


class SnapshotError(RuntimeError):
    """Snapshot storage is unusable or a snapshot cannot be used; the message names the fix."""


class SnapshotMismatch(SnapshotError):
    """The snapshot is intact but belongs to another model or corpus: an error, not a fallback."""
