"""trainer_config.profile_steps: a Chrome-format trace per rank of a few training steps.

After WARMUP steps (the first steps pay for allocations, DDP's bucket rebuild, a pipeline's
shape inference: not what a trace should show), every rank records `profile_steps` steps with
torch.profiler and writes <run_dir>/traces/rank<R>.json.gz, which Perfetto (ui.perfetto.dev) or
chrome://tracing opens, and benchmarks/timeline.py draws. In it: the project's own regions
(`micro-step N` holding `forward` and `backward`, `gradient sync`, `optimizer step`: trainer.py;
`snapshot`: snapshots/protocol.py; a pipeline stage's actions, `stage 1 F0`: stages.Stage), every
op with its thread and time, torch's own named regions (`DistributedDataParallel.forward`,
`autograd::engine::evaluate_function: ...Backward0`, the collectives as `gloo:all_reduce` or
NCCL kernels, `Optimizer.step#AdamW.step`), and each traced step as the region `ProfilerStep#N`
(opened here: torch's own marks need a profiler schedule). Every rank's clock is its host's: on
one machine the ranks' traces line up.
"""

from __future__ import annotations

import os

import torch
from torch.profiler import ProfilerActivity, profile

WARMUP = 2  # steps before the trace starts


class StepProfiler:
    """Counts steps (beat, once each); traces `steps` of them after WARMUP, then writes the
    rank's trace and says where in one line (rank 0 prints it). A context manager: a run that
    ends inside the traced steps writes what it has."""

    def __init__(self, steps: int, run_dir: str, rank: int, device: torch.device):
        self.steps, self.rank, self.beats = steps, rank, 0
        self.path = os.path.join(run_dir, "traces", f"rank{rank}.json.gz")
        self.activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self.profiler: profile | None = None
        self.region = None  # the traced step's region, "ProfilerStep#N"

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc) -> None:
        self._finish()

    def beat(self) -> None:
        """A step ended: start the trace after WARMUP of them, end it `steps` later."""
        if not self.steps:
            return
        self.beats += 1
        if self.beats == WARMUP:
            self.profiler = profile(activities=self.activities)
            self.profiler.__enter__()
        if self.beats == WARMUP + self.steps:
            self._finish()
        elif self.profiler is not None:
            self._mark(f"ProfilerStep#{self.beats - WARMUP}")  # the next step's region

    def _mark(self, name: str | None) -> None:
        """Close the current step's region; open `name`'s (None: none)."""
        if self.region is not None:
            self.region.__exit__(None, None, None)
        self.region = torch.profiler.record_function(name) if name else None
        if self.region is not None:
            self.region.__enter__()

    def _finish(self) -> None:
        if self.profiler is None:
            return
        self._mark(None)
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        profiler.export_chrome_trace(self.path)  # .gz: compressed by its name
        if self.rank == 0:
            folder = os.path.dirname(self.path)
            print(f"trace | {self.beats - WARMUP} steps | every rank's in {folder}", flush=True)
