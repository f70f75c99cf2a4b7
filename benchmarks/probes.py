"""What a training step did, measured from inside: the bytes of tensors saved for backward at
their peak (SavedBytes), and the time a pipeline's ranks spent computing in their stages
(StageClock). benchmarks/parallelisms.py uses both."""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class SavedBytes:
    """The bytes of tensors saved for backward alive at once, at their peak (saved-tensor hooks);
    a storage counted once however often it is saved, parameters left out."""

    def __init__(self, params):
        from torch.multiprocessing.reductions import StorageWeakRef

        self.ref = StorageWeakRef
        self.skip = {p.untyped_storage()._cdata for p in params}
        self.live: dict[int, tuple] = {}
        self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        # A DTensor (tensor parallelism) is a wrapper: its bytes are its local shard's.
        local = t._local_tensor if hasattr(t, "_local_tensor") else t
        storage = local.untyped_storage()
        key = storage._cdata
        if key not in self.skip and key not in self.live:
            self.live[key] = (self.ref(storage), storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


class StageClock:
    """Time spent computing inside the pipeline's stages (forward and backward chunks, the
    weight-gradient chunks of the zero-bubble schedules, the loss),
    summed over a step: what the rank was busy with; the rest of the step it waited.

    The step is timed on a common clock (common_window): every rank's window opens as all leave
    one barrier and closes as all leave the next, so the ranks' idle shares are shares of the same
    stretch of time. Timed by each rank over its own schedule.step, a rank that enters its step
    late (the last stage, waiting for its first activation) counts that wait as outside the step:
    at m = 1 on 2 stages the two shares then summed to 0.83, where one chain of work on a common
    window must leave them summing to at least 1 (each idles while the other computes)."""

    busy = wall = 0.0

    @classmethod
    def install(cls) -> None:
        from torch.distributed.pipelining import schedules, stage

        targets = [
            (stage._PipelineStageBase, "forward_one_chunk"),
            (stage._PipelineStageBase, "backward_one_chunk"),
            (stage._PipelineStageBase, "backward_weight_one_chunk"),  # zero bubble's W
            (schedules._PipelineSchedule, "_compute_loss"),
        ]
        for owner, name in targets:
            setattr(owner, name, cls.timed(getattr(owner, name)))

    @classmethod
    def timed(cls, method, into: str = "busy"):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                setattr(cls, into, getattr(cls, into) + time.perf_counter() - t0)

        return run

    @classmethod
    def common_window(cls, step):
        """step, timed into `wall` from a barrier every rank leaves to the next one."""
        import torch.distributed as dist

        def run(*args, **kwargs):
            dist.barrier()
            t0 = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                dist.barrier()
                cls.wall += time.perf_counter() - t0

        return run


def tracked_peak(strategy, step, *args) -> tuple:
    """step(strategy, *args) under the memory tracker the planner traces with
    (mingpt_ddp/planner/memory.py: tracker_for): its result, and this rank's peak by category.
    Not around a pipeline's schedule: under MemTracker a 1F1B step never completed (a stage
    waited for a microbatch's receive)."""
    from mingpt_ddp.planner.memory import fold, tracker_for

    tracker = tracker_for(strategy)
    with tracker:
        result = step(strategy, *args)
    return result, fold(tracker.get_tracker_snapshot("peak"))


class LivePeak(TorchDispatchMode):
    """The peak of the bytes alive during a step, counted from the start's: the storages that
    the step's ops create (a dispatch mode sees every op's outputs; weak references see each
    storage freed), above what was alive before it. For a pipeline's schedule, where the memory
    trackers do not run (tracked_peak says why): the same quantity, without their categories.

    held: the tensors alive at the start (counted there). An op's output may be a view of one
    (a matmul's `weight.t()`): its storage is not new, and counting it again had the peaks of a
    pipeline's stage 0 read 98 KB (its blocks' weight matrices) too high."""

    def __init__(self, held=()):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self.ref, self.live, self.now, self.peak = StorageWeakRef, {}, 0, 0
        self.held = {_local(t).untyped_storage()._cdata for t in held if t is not None}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            # Plain tensors only: a DTensor's storage is not its shard's (the shard's own ops,
            # dispatched below it, are seen as plain tensors)
            if type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta:
                self._add(t.untyped_storage())
        return out

    def _add(self, storage) -> None:
        key = storage._cdata
        if key in self.held or (key in self.live and not self.live[key][0].expired()):
            return
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.live[key] = (self.ref(storage), storage.nbytes())
        self.now = sum(n for _, n in self.live.values())
        self.peak = max(self.peak, self.now)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def live_peak(strategy, step, *args) -> tuple:
    """step(strategy, *args) under LivePeak: its result, and the rank's peak bytes: what was
    alive at the start (parameters, gradients, optimizer state, buffers) plus the step's peak."""
    from mingpt_ddp.optim import state_tensors
    from mingpt_ddp.parallel.plan import local_bytes

    modules = strategy.modules
    params = [p for m in modules for p in m.parameters()]
    held = [
        *params,
        *(p.grad for p in params),
        *(b for m in modules for b in m.buffers()),
        *state_tensors(strategy.optimizers),
    ]
    with LivePeak(held) as counter:
        result = step(strategy, *args)
    return result, local_bytes(held) + counter.peak
