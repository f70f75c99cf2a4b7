"""prepare.py that pauses in the middle of encoding until the test lets it go, for tests that must
act at a certain moment (kill it, start a second preparer) instead of hoping to catch one.

    python tests/paused_prepare.py FIFO SOURCE --cache-dir DIR

Reads are cut to 4 KiB, so the encoding pass writes a first piece of the temporary token
file; before the second piece the process prints "paused" and blocks opening FIFO
(a named pipe) until the test opens it for writing. Everything else is the real prepare.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mingpt_ddp.corpus import (
    prepare,  # noqa: E402
    sources,  # noqa: E402
)

fifo, args = sys.argv[1], sys.argv[2:]
sources.CHUNK_BYTES = 4096
_encode, calls = prepare.Encoder.encode, []


def encode(self, chunk, text):
    calls.append(1)
    if len(calls) == 2:  # pass 2 has written the first chunk's ids to the temporary file
        print("paused", flush=True)
        with open(fifo) as f:  # blocks until the test opens the FIFO for writing
            f.read()
    return _encode(self, chunk, text)


prepare.Encoder.encode = encode

if __name__ == "__main__":
    sys.exit(prepare.main(args))
