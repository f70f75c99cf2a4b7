"""The straggler report: a rank slower than the others, named in one line with where its time
went; the sibling of the stall report (stall.py), which names a rank that stopped.

Comparing step times names nobody: in synchronous training every rank waits for the slowest at
each collective, so every rank's step takes the same wall time. What differs is each rank's own
work before it waits: reading its batches (data) and its forward passes, in which DDP runs no
collective (its all-reduces run inside backward, where a fast rank waits for the slow one). So over
each log window (pooled to 10 steps or more; the first window, which sets things up, is skipped)
every rank adds up its data and forward seconds, the ranks exchange them (one small gather on such
log steps), and a rank whose own work exceeds the others' median by more than
trainer_config.straggler_factor, and by a fifth of the step, is named:

    straggler | rank 1 is 31.6x slower than the others over steps 16-25 | its step: data 50.7 ms,
    forward 1.7 ms, the rest 7.1 ms | the others': data 0.2 ms, forward 1.5 ms, the rest 57.7 ms
    (the rest: backward, collectives and the optimizer; a fast rank waits there for the slow one)

(tests/test_straggler.py's run: rank 1's batches 50 ms late, FAULT=slow:1:15.)

Forward is timed around the model's training forwards (hooks; on a GPU by CUDA events, since the
host runs ahead of the device). Where the forward holds collectives of its own (FSDP's all-gathers,
tensor parallelism) their waiting counts as forward too, and a pipeline's stages are not timed
(data alone is compared there).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn

from mingpt_ddp.runtime.distributed import print0

SIGNIFICANT = 0.2  # a straggler's extra work must cost at least this share of the step
MIN_STEPS = 10  # log windows are pooled up to this many steps: one step's times are noise


class StepTimes:
    """This rank's data and forward seconds over a log window, and the report at its end."""

    def __init__(self, factor: float, ctx, control, model: nn.Module):
        self.factor, self.world_size, self.control = factor, ctx.world_size, control
        self.data_s, self.forward_s = 0.0, 0.0  # since the last log line
        self.pool: list[float] = []  # data, forward and step seconds, steps, first step
        self.warm = False  # the first log window is not judged: its first steps set things up
        self.cuda = torch.device(ctx.device).type == "cuda"
        self._started: list = []  # the open forward's start (a time, or a CUDA event)
        self._events: list[tuple] = []  # CUDA (start, end) pairs, summed at the report
        # Run as plain Python under torch.compile (model.compile() compiles its hooks too, where
        # a clock read would be traced once and replayed as a constant).
        model.register_forward_pre_hook(torch.compiler.disable(self._before))
        model.register_forward_hook(torch.compiler.disable(self._after))

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _before(self, module, args) -> None:
        if torch.is_grad_enabled():  # training's forwards, not evaluation's or sampling's
            self._started.append(self._mark())

    def _after(self, module, args, output) -> None:
        if torch.is_grad_enabled() and self._started:
            start, end = self._started.pop(), self._mark()
            if self.cuda:
                self._events.append((start, end))
            else:
                self.forward_s += end - start

    def report(self, first: int, last: int, step_s: float) -> None:
        """On log steps, on every rank (a gather, once MIN_STEPS are pooled): name a straggler
        over the steps since the last report, this window's steps having taken step_s each."""
        for start, end in self._events:
            end.synchronize()
            self.forward_s += start.elapsed_time(end) / 1e3
        steps, warm = last - first + 1, self.warm
        window, self.warm = [self.data_s, self.forward_s, step_s * steps, steps], True
        if not warm:  # allocations, DDP's first buckets, compilation: one-time, on some ranks
            self.data_s, self.forward_s, self._events = 0.0, 0.0, []
            return
        if self.pool:
            self.pool[:4] = [pooled + more for pooled, more in zip(self.pool, window)]
        else:
            self.pool = [*window, first]
        self.data_s, self.forward_s, self._events = 0.0, 0.0, []
        if self.pool[3] < MIN_STEPS or not self.factor or self.world_size == 1:
            return
        data, forward, total, steps, start = self.pool
        self.pool = []
        mine = (data / steps, forward / steps, total / steps)
        if line := straggler_line(self.control.gather(mine), self.factor, int(start), last):
            print0(line)


def straggler_line(times: list[tuple], factor: float, first: int, last: int) -> str:
    """The report's line for every rank's (data, forward, step) seconds a step, or "" when no
    rank's own work (data + forward) exceeds factor times the others' median, by a fifth of the
    step or more."""
    own = [data + forward for data, forward, _ in times]
    slow = max(range(len(times)), key=own.__getitem__)
    others = [t for rank, t in enumerate(times) if rank != slow]
    usual = statistics.median(data + forward for data, forward, _ in others)
    step = statistics.median(s for _, _, s in times)
    if own[slow] <= factor * usual or own[slow] - usual < SIGNIFICANT * step:
        return ""

    median = [statistics.median(t[i] for t in others) for i in range(3)]
    ratio = f"{own[slow] / usual:.1f}x" if usual > 0 else "far"
    return (
        f"straggler | rank {slow} is {ratio} slower than the others over steps {first}-{last} | "
        f"its step: {_split(*times[slow])} | the others': {_split(*median)} (the rest: backward, "
        "collectives and the optimizer; a fast rank waits there for the slow one)"
    )


def _split(data: float, forward: float, step: float) -> str:
    rest = max(step - data - forward, 0.0)  # backward, collectives (waiting included), optimizer
    return f"data {1e3 * data:.1f} ms, forward {1e3 * forward:.1f} ms, the rest {1e3 * rest:.1f} ms"
