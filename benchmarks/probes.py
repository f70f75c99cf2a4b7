"""What a training step did, measured from inside: the bytes of tensors saved for backward at
their peak (SavedBytes), and the time a pipeline's ranks spent computing in their stages
(StageClock). benchmarks/parallelisms.py uses both."""

from __future__ import annotations

import time

import torch


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
