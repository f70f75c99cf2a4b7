"""The line that says why a job stops, printed by whichever rank of a node gets there first.

print0 leaves every line to global rank 0. When all ranks refuse the same configuration, the rank
that exits first makes torchrun stop the others, and rank 0 can be stopped before it prints: 1 of
4 launches of `torchrun --nproc_per_node=2 main.py pipeline_config.schedule=zerobubble` ended with
exit 1 and no message. So the first failing rank of each node prints the line and leaves a mark;
the node's other ranks see the mark and stay quiet: one line per node, not one per rank."""

from __future__ import annotations

import os
import re
import sys
import tempfile


def attempt_mark() -> str:
    """A file name unique to this node's worker group in this attempt: the launcher's process
    (the workers' parent: torchrun's agent, srun's step) with its start time, so that a reused
    pid is another name, and torchrun's restart count."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/stat", encoding="ascii") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]  # field 22: start time in ticks
    except (OSError, IndexError):
        started = "0"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return os.path.join(tempfile.gettempdir(), f"mingpt-error-{parent}-{started}-{restart}")


def print_error(line: str) -> None:
    """Print line to stderr, once per node of a launched job (every time in a lone process)."""
    if "LOCAL_RANK" in os.environ:  # one of several ranks of a node (torchrun, srun, our ranks.py)
        try:
            os.close(os.open(attempt_mark(), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return  # another rank of this node has said it
        except OSError:
            pass  # no writable temporary folder: better twice than never
    print(line, file=sys.stderr, flush=True)


# What gloo says on the survivors when another rank of the job is gone (killed, crashed, its machine
# lost): the cause is in that rank's output, and the survivor's traceback adds nothing to it.
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def peer_gone(e: BaseException) -> str:
    """The one line a survivor prints when a collective failed because another rank is gone ("" for
    any other exception: a bug keeps its traceback)."""
    first = str(e).splitlines()[0] if str(e) else ""
    if not isinstance(e, RuntimeError) or not any(s in first for s in PEER_GONE):
        return ""
    said = re.sub(r"^\[[^\]]*\] ", "", first).split(". ")[0]  # gloo's source path and advice off
    return (
        f"error: a collective failed because another rank is gone (gloo: {said}); that rank's "
        "output says why, and torchrun restarts the group if --max-restarts allows"
    )
