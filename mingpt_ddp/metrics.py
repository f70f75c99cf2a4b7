"""What a run reports: the JSON-lines metrics file and the terminal progress line.

Only global rank 0 reports; the numbers it writes were already averaged over all
ranks by the trainer. The metrics file is the machine-readable history of the run
(one JSON object per logged step, plus one per event such as a snapshot, marked by
an "event" key); after a resume it is cut back to the snapshot's
step, because the steps after it are trained again, so the history has every step
once.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable

import torch

from mingpt_ddp.runtime.distributed import print0


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


class MetricsLog:
    """Append-only JSON lines on a local path (an empty path disables it), optionally mirrored to
    TensorBoard."""

    def __init__(
        self, path: str, tensorboard_dir: str = "", still_owner: Callable[[], bool] = lambda: True
    ):
        self.path = path
        # The run's history has one writer, the job holding the snapshot path's lease: a job that
        # lost it (paused past its lease, then woken) writes nothing more here.
        self.still_owner = still_owner
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # Opened on first use: the trainer's resume() always cuts the history back first
        # (truncate_after), which opens the writer with the right purge step.
        self.tensorboard_dir, self.tensorboard = tensorboard_dir, None

    def write(self, record: dict) -> None:
        if not self.still_owner():
            return
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        if self.tensorboard_dir:
            if self.tensorboard is None:
                self._open_tensorboard()
            # One chart per number (train_loss, val_loss, lr, tokens_per_sec...), x axis = step.
            prefix = f"{record['event']}/" if "event" in record else ""
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tensorboard.add_scalar(prefix + key, value, record["step"])
            self.tensorboard.flush()

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (written before a crash, about to be redone)."""
        if self.tensorboard_dir:  # TensorBoard hides its events past purge_step the same way
            self._open_tensorboard(purge_step=step + 1)
        if not self.path or not os.path.exists(self.path):
            return
        kept = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    if json.loads(line)["step"] <= step:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by the crash
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def _open_tensorboard(self, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import (
            SummaryWriter,  # TrainerConfig checked that it is installed
        )

        if self.tensorboard is not None:
            self.tensorboard.close()
        self.tensorboard = SummaryWriter(self.tensorboard_dir, purge_step=purge_step)

    @staticmethod
    def read(path: str, event: str = "") -> list[dict]:
        """The logged-step records; or, with event="snapshot", the records of that event."""
        records = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue  # blank, or a last line still being written (or cut short by a crash)
        return [r for r in records if r.get("event", "") == event]


class ProgressLine:
    """A one-line progress bar redrawn in place, only when stdout is a terminal (not in logs)."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30):
        self.total, self.width = total, width
        self.enabled = enabled and sys.stdout.isatty()

    def update(self, step: int) -> None:
        if self.enabled:
            filled = self.width * step // self.total
            sys.stdout.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {step}/{self.total}")
            sys.stdout.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()


class LogWindow:
    """The steps since the last log line: where they began, when, and their summed loss (on the
    device, so that no step waits for it). Ranks without a loss (a pipeline's earlier stages)
    add None and are left out of the mean."""

    def __init__(self, step: int, device: torch.device):
        self.start_step, self.device = step, device
        self.reset(step)

    def reset(self, step: int) -> None:
        self.step, self.time = step, time.perf_counter()
        self.totals = torch.zeros(2, device=self.device)  # (summed loss, how many)

    def add(self, loss: torch.Tensor | None) -> None:
        if loss is not None:
            self.totals[0] += loss
            self.totals[1] += 1

    def mean_loss(self, control) -> float:
        """The mean over the window and over every rank that computed a loss (a collective)."""
        loss_sum, count = control.sum(self.totals.clone()).tolist()
        return loss_sum / max(count, 1)


def peak_memory(device: torch.device, control) -> str:
    """The most memory any rank has held: its process's peak resident size (and on GPUs, the peak
    of tensors on its GPU). Collective: every rank reports, the largest is printed."""
    host_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    gpu_mb = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    host_mb, gpu_mb = (max(values) for values in zip(*control.gather((host_mb, gpu_mb))))
    return (
        f"{host_mb:.0f} MiB host"
        + (f", {gpu_mb:.0f} MiB GPU" if gpu_mb else "")
        + " (largest rank)"
    )


def report_optimizer_memory(strategy, control) -> None:
    """One line: the optimizer state each rank holds, as a mean over the ranks. Under DDP every
    rank holds all of it; ZeRO (any stage) and FSDP split it, 1/N per rank."""
    mine = torch.tensor(float(strategy.optimizer_state_bytes()), device=strategy.device)
    mean = control.mean(mine).item()
    muon = len(strategy.optimizers) > 1
    what = "AdamW's 2 moments" + (" + Muon's momentum" if muon else "")
    print0(f"memory | optimizer state {mean / 1e6:.3f} MB per rank ({what}, mean over ranks)")
