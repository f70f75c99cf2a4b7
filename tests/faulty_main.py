"""main.py with one fault injected, for tests that need a rank to misbehave on cue.

    FAULT=stall:RANK:STEP   that rank hangs (a stuck filesystem, a deadlock) before that step
    FAULT=raise:RANK:STEP   that rank raises an exception before that step

Faults fire only in the first attempt (TORCHELASTIC_RESTART_COUNT=0), so a restarted
group runs clean. Everything else is the real main.py, under the real torchrun.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import main  # noqa: E402
import trainer  # noqa: E402

kind, fault_rank, fault_step = os.environ["FAULT"].split(":")
_train_step = trainer.Trainer.train_step


def train_step(self):
    if self.ctx.rank == int(fault_rank) and self.step == int(fault_step) and self.ctx.restart_count == 0:
        print(f"fault | rank {self.ctx.rank} | {kind} before step {self.step + 1}", flush=True)
        if kind == "stall":
            time.sleep(3600)
        raise RuntimeError("injected failure")
    return _train_step(self)


trainer.Trainer.train_step = train_step

if __name__ == "__main__":
    main.cli()
