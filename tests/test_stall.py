"""The stall report on GPU jobs, shown on CPU (issue 45 finding 4): a CUDA job counts the
collectives in NCCL's flight recorder (torch._C._distributed_c10d._dump_nccl_trace_json, which CPU
builds lack) beside the CPU one, and a step counts as finished only once the event recorded at its
end has passed. Fake recorders and fake events stand in for the GPU's."""

import json

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d

from mingpt_ddp.runtime import stall
from mingpt_ddp.runtime.distributed import DistContext
from mingpt_ddp.runtime.stall import StallWatch, collectives


def recorder(enqueued: int, *names: tuple[int, str, int]):
    """A fake _dump_*_trace_json: the default group's count, and entries (seq, name, time)."""
    entries = [
        dict(pg_id=0, collective_seq_id=seq, profiling_name=name, time_created_ns=t)
        for seq, name, t in names
    ]
    entries.append(dict(pg_id=1, collective_seq_id=9, profiling_name="nccl:other_group"))
    status = {"0": {"last_enqueued_collective": str(enqueued)}}  # torch writes strings
    return lambda includeCollectives=True: json.dumps(
        {"pg_status": status, "entries": entries if includeCollectives else []}
    ).encode()


@pytest.fixture
def recorders(monkeypatch):
    cpu = recorder(7, (7, "gloo:all_reduce", 30))
    nccl = recorder(12, (11, "nccl:all_reduce", 10), (12, "nccl:_reduce_scatter_base", 40))
    monkeypatch.setattr(_distributed_c10d, "_dump_fr_trace_json", cpu)
    monkeypatch.setattr(_distributed_c10d, "_dump_nccl_trace_json", nccl, raising=False)
    return monkeypatch


def test_a_cuda_job_counts_nccls_recorder_beside_the_cpu_one(recorders):
    assert collectives(names=True, device_type="cpu") == (7, ["#7 gloo:all_reduce"])
    entered, last = collectives(names=True, device_type="cuda")
    assert entered == 7 + 12  # a rank behind in either recorder is behind
    assert last == ["#11 nccl:all_reduce", "#7 gloo:all_reduce", "#12 nccl:_reduce_scatter_base"]


def test_a_missing_or_failing_nccl_recorder_leaves_the_cpu_count(recorders):
    def broken(includeCollectives=True):
        raise RuntimeError("no NCCL here")

    recorders.setattr(_distributed_c10d, "_dump_nccl_trace_json", broken)
    assert collectives(device_type="cuda") == (7, [])
    recorders.delattr(_distributed_c10d, "_dump_nccl_trace_json")
    assert collectives(device_type="cuda") == (7, [])
    recorders.setattr(_distributed_c10d, "_dump_fr_trace_json", broken)
    assert collectives(device_type="cuda") == (-1, [])  # nothing to read: no count


def test_the_heartbeat_of_a_cuda_rank_carries_nccls_count(recorders, tmp_path):
    store = dist.HashStore()
    ctx = DistContext(rank=1, local_rank=1, world_size=2, device=torch.device("cuda", 1))
    watch = StallWatch(60.0, ctx, str(tmp_path), store, event=FakeEvent)
    watch._publish()
    assert json.loads(store.get("1")) == [1, 0, 19]  # counter, step, collectives (NCCL + gloo)
    watch._write_where()
    where = (tmp_path / "stall" / "rank_1.txt").read_text()
    assert "collectives entered 19" in where and "nccl:_reduce_scatter_base" in where


class FakeEvent:
    """A CUDA event's part the watch uses: query(), True once the GPU got there."""

    made: list["FakeEvent"] = []

    def __init__(self):
        self.done = False
        FakeEvent.made.append(self)

    def query(self) -> bool:
        return self.done


def test_on_a_gpu_a_step_counts_once_its_end_event_has_passed():
    FakeEvent.made.clear()
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cuda"))
    watch = StallWatch(60.0, ctx, "unused", None, event=FakeEvent)
    watch.watching = True  # as when its thread runs (which would call torch.cuda.set_device)
    start = watch.last
    for step in (1, 2, 3):
        watch.beat(step)  # the CPU queued the step's work and went on
    assert watch.step == 0 and watch.last == start and len(watch.pending) == 3
    watch._passed()  # the GPU has finished none of them: nothing moves
    assert watch.step == 0 and watch.last == start
    FakeEvent.made[0].done = FakeEvent.made[1].done = True
    watch._passed()  # steps 1 and 2 done on the GPU: the heartbeat says step 2, from now
    assert watch.step == 2 and watch.last > start and len(watch.pending) == 1
    FakeEvent.made[2].done = True
    watch._passed()
    assert watch.step == 3 and not watch.pending


def test_without_a_watcher_or_on_cpu_a_step_counts_when_queued():
    FakeEvent.made.clear()
    gpu = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cuda"))
    idle = StallWatch(0.0, gpu, "unused", None, event=FakeEvent)  # stall_report_s=0: no thread
    with idle:
        idle.beat(4)
    assert idle.step == 4 and not idle.pending and not FakeEvent.made  # no events pile up
    cpu = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    watch = StallWatch(60.0, cpu, "unused", None, event=FakeEvent)
    watch.watching = True
    watch.beat(5)
    assert watch.step == 5 and not FakeEvent.made


def test_the_default_event_is_a_cuda_event_recorded_on_the_current_stream(monkeypatch):
    recorded = []

    class Event:
        def record(self):
            recorded.append(self)

    monkeypatch.setattr(stall.torch.cuda, "Event", Event)
    event = stall.cuda_event()
    assert recorded == [event]
