"""Fetch tiny Shakespeare (Karpathy's char-rnn corpus) into data/tinyshakespeare/input.txt and
verify it.

    python data/fetch_shakespeare.py                      # download from the usual public URL
    python data/fetch_shakespeare.py --source ~/input.txt # or copy a local file (offline machines)

The file is checked (1,115,394 bytes, known sha256) before it is written, and it
is written atomically, so a half-finished download never looks like a corpus.
main.py calls ensure_tinyshakespeare() when the default data_config.path is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import urllib.request

# The usual public copy; TINYSHAKESPEARE_URL points elsewhere (a mirror, or file:///... on offline
# machines), read when a fetch starts (not at import: the environment is the caller's then).
URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SIZE = 1_115_394
SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
DEFAULT_PATH = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "tinyshakespeare", "input.txt"
)


class FetchError(RuntimeError):
    """The corpus could not be fetched or is not the expected file."""


def _read_source(source: str, timeout_s: float) -> bytes:
    if "://" not in source:
        with open(os.path.expanduser(source), "rb") as f:
            return f.read()
    with urllib.request.urlopen(source, timeout=timeout_s) as response:  # noqa: S310 - a fixed public corpus
        return response.read()


def ensure_tinyshakespeare(
    dest: str = DEFAULT_PATH, source: str | None = None, timeout_s: float = 20.0
) -> str:
    """Make sure `dest` holds tiny Shakespeare, fetching it from `source` (URL or local file;
    default: $TINYSHAKESPEARE_URL, else URL) if missing."""
    if os.path.exists(dest):
        return dest
    source = source or os.environ.get("TINYSHAKESPEARE_URL", URL)
    try:
        data = _read_source(source, timeout_s)
    except OSError as e:
        raise FetchError(f"cannot fetch tiny Shakespeare from {source} ({e})") from None
    if len(data) != SIZE or hashlib.sha256(data).hexdigest() != SHA256:
        raise FetchError(
            f"{source} is not tiny Shakespeare ({len(data)} bytes, expected {SIZE} "
            f"with sha256 {SHA256})"
        )
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    tmp = f"{dest}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, dest)  # atomic: other processes see no file or the whole file
    return dest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument(
        "--source", help="URL or local file to take the corpus from (default: $TINYSHAKESPEARE_URL)"
    )
    parser.add_argument("--dest", default=DEFAULT_PATH, help="where to write it")
    args = parser.parse_args()
    try:
        path = ensure_tinyshakespeare(args.dest, args.source)
    except (FetchError, OSError) as e:
        hint = (
            "; offline, copy input.txt here by hand or pass --source /path/to/input.txt"
            if (args.source or os.environ.get("TINYSHAKESPEARE_URL", URL)) == URL
            else ""
        )
        print(f"error: {e}{hint}", file=sys.stderr)
        return 1
    print(f"tiny Shakespeare ready at {path} ({SIZE:,} bytes, sha256 verified)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
