"""main.py with one fault injected, for tests that need a rank to misbehave on cue.

    FAULT=stall:RANK:STEP         that rank hangs (a stuck filesystem, a deadlock) before that step
    FAULT=raise:RANK:STEP         that rank raises an exception before that step
    FAULT=kill:RANK:STEP          that rank SIGKILLs itself before that step (a lost machine, the
                                  OOM killer), at that exact step however fast the steps are
    FAULT=block_write:RANK:STEP   that rank stops half-way through writing a file of the step's
                                  snapshot (half its bytes in the temporary file), and hangs there
    FAULT=enospc_at:RANK:STEP     every write of that step's snapshot files fails: No space left
                                  on device
    FAULT=enospc_from:RANK:STEP   every snapshot write from that step on fails: a disk that stays
                                  full
    FAULT=slow:RANK:STEP          that rank reads each batch SLOW_S late from that step on (a slow
                                  disk or a busy host: a straggler, not a stall)

Faults fire only in the first attempt (TORCHELASTIC_RESTART_COUNT=0), so a restarted
group runs clean. Everything else is the real main.py, under the real torchrun. A test
that waits for the "fault |" line knows the job is at that exact moment: no polling for
a temporary file, and no skipping when the moment was missed.
"""

import errno
import os
import re
import signal
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import main  # noqa: E402
import trainer  # noqa: E402
from mingpt_ddp.snapshots import storage  # noqa: E402

SLOW_S = 0.05  # the slow rank's delay per batch: several times a tiny model's step here
kind, fault_rank, fault_step = os.environ["FAULT"].split(":")
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
_train_step, _write = trainer.Trainer.train_step, storage.LocalStorage.write
_next_batch = trainer.Trainer._next_batch


def train_step(self):
    if (
        kind in ("stall", "raise", "kill")
        and self.ctx.rank == int(fault_rank)
        and self.step == int(fault_step)
        and first_attempt
    ):
        print(f"fault | rank {self.ctx.rank} | {kind} before step {self.step + 1}", flush=True)
        if kind == "stall":
            time.sleep(3600)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("injected failure")
    return _train_step(self)


def write(self, name: str, data) -> None:
    step = re.match(r"snapshot_(\d+)", name)
    if (
        kind.startswith("enospc")
        and step
        and first_attempt
        and os.environ.get("RANK", "0") == fault_rank
        and (
            int(step.group(1)) == int(fault_step)
            if kind == "enospc_at"
            else int(step.group(1)) >= int(fault_step)
        )
    ):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(self.root, name))
    if (
        kind == "block_write"
        and f"snapshot_{int(fault_step):08d}" in name
        and first_attempt
        and os.environ.get("RANK", "0") == fault_rank
    ):
        final = os.path.join(self.root, name)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = os.path.join(
            os.path.dirname(final), f".{os.path.basename(final)}.{uuid.uuid4().hex}.tmp"
        )
        with open(tmp, "wb") as f:  # what LocalStorage.write has done when a kill lands half-way
            f.write(bytes(data[: len(data) // 2]))
        print(f"fault | rank {fault_rank} | blocked half-way through writing {name}", flush=True)
        time.sleep(3600)
    return _write(self, name, data)


def next_batch(self):
    if kind == "slow" and self.ctx.rank == int(fault_rank) and self.step >= int(fault_step):
        time.sleep(SLOW_S)  # the injected fault itself: this rank's data arrives late
    return _next_batch(self)


trainer.Trainer.train_step = train_step
trainer.Trainer._next_batch = next_batch
storage.LocalStorage.write = write

if __name__ == "__main__":
    main.cli()
