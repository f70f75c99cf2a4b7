"""Never lose work: kills at any moment, preemption, async saves, and resuming at another world
size.

Every test here runs real torchrun jobs on CPU and checks what a resumed job does
against what an uninterrupted one does.
"""

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from conftest import (
    MAIN,
    REPO,
    descendants,
    kill_tree,
    run_main,
    start_main,
    tiny_overrides,
    wait_for_line,
)

from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.runtime.stacks import alive
from mingpt_ddp.snapshots.store import MANIFEST, SnapshotStore

pytestmark = pytest.mark.slow
FAULTY = REPO / "tests" / "faulty_main.py"  # main.py with faults injected (FAULT=...)


def start_job(args, nproc=2, script=MAIN, env=None) -> subprocess.Popen:
    return start_main(args, nproc=nproc, env=env, script=script)


def final_weights(run_dir):
    return SnapshotStore(str(run_dir / "snapshots")).load_latest()["model"]


def assert_same_run(a_dir, b_dir, max_steps):
    a, b = (
        MetricsLog.read(str(a_dir / "metrics.jsonl")),
        MetricsLog.read(str(b_dir / "metrics.jsonl")),
    )
    assert [r["step"] for r in b] == list(range(1, max_steps + 1))  # every step once
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    wa, wb = final_weights(a_dir), final_weights(b_dir)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_sigkill_while_a_snapshot_is_being_written_keeps_the_previous_one(shakespeare, tmp_path):
    args = tiny_overrides(shakespeare, tmp_path, max_steps=40, save_every=5)
    snap_dir = tmp_path / "snapshots"
    # Rank 0 stops half-way through writing the step-10 snapshot (tests/faulty_main.py), and is
    # killed there.
    job = start_job(args, script=FAULTY, env={"FAULT": "block_write:0:10"})
    wait_for_line(job, "fault | rank 0 | blocked half-way through writing snapshot_00000010.g1.pt")
    kill_tree(job)
    assert any(
        n.startswith(".snapshot_00000010.g1.pt.") and n.endswith(".tmp")
        for n in os.listdir(snap_dir)
    )
    assert [e["step"] for e in json.loads((snap_dir / MANIFEST).read_text())["snapshots"]] == [
        5
    ]  # not committed
    resumed = run_main(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume | step 5 |" in resumed.stdout
    assert SnapshotStore(str(snap_dir)).load_latest()["step"] == 40


def test_sigterm_finishes_the_step_saves_and_resumes_exactly(ddp_reference, shakespeare, tmp_path):
    straight, settings, extra = ddp_reference  # the same job, never interrupted
    args = tiny_overrides(shakespeare, tmp_path, **settings) + extra
    job = start_job(args)
    lines = wait_for_line(job, "snapshot | step 10")
    job.send_signal(
        signal.SIGTERM
    )  # what SLURM / Kubernetes send before killing; torchrun forwards it
    rest, _ = job.communicate(timeout=60)
    log = "".join(lines) + rest
    assert "preempted | SIGTERM received | saving step" in log
    stopped_at = int(log.split("preempted | SIGTERM received | saving step ")[1].split(";")[0])
    assert (
        SnapshotStore(str(tmp_path / "snapshots")).load_latest()["step"] == stopped_at
    )  # nothing lost
    resumed = run_main(args, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resume | step {stopped_at} |" in resumed.stdout
    assert_same_run(straight.run_dir, tmp_path, settings["max_steps"])


def test_a_stop_signal_sent_to_every_process_of_the_job_still_saves_the_step(shakespeare, tmp_path):
    # SLURM signals every process of a job step, so each worker gets SIGTERM twice within
    # milliseconds: once from SLURM and once forwarded by torchrun. That is one request, not two.
    args = tiny_overrides(shakespeare, tmp_path, max_steps=100000, save_every=100000, log_every=20)
    job = start_job(args)
    lines = wait_for_line(job, "| loss ")
    for pid in [
        *descendants(job.pid),
        job.pid,
    ]:  # the workers, then the agent, which forwards it again
        os.kill(pid, signal.SIGTERM)
    rest, _ = job.communicate(timeout=60)
    log = "".join(lines) + rest
    assert job.returncode != 0  # not finished: the scheduler must know
    assert "preempted | SIGTERM received | saving step" in log, log[-3000:]
    stopped_at = int(log.split("preempted | SIGTERM received | saving step ")[1].split(";")[0])
    assert SnapshotStore(str(tmp_path / "snapshots")).load_latest()["step"] == stopped_at


def test_a_sigkilled_torchrun_agent_takes_its_workers_down_with_a_snapshot(shakespeare, tmp_path):
    """`kill -9` of torchrun (or the OOM killer taking it): the workers must not train on as
    orphans. Linux signals each when its parent dies; they save the step and exit, and the same
    command resumes from it."""
    args = tiny_overrides(shakespeare, tmp_path, max_steps=100000, save_every=100000, log_every=20)
    job = start_job(args)
    lines = wait_for_line(job, "| loss ")
    workers = descendants(job.pid)
    assert len(workers) >= 2
    os.kill(job.pid, signal.SIGKILL)  # the agent alone
    job.wait(timeout=10)
    deadline = time.monotonic() + 60
    while [p for p in workers if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)  # polling a condition, bounded: orphans would never end
    assert not [p for p in workers if alive(p)], "the workers train on without their agent"
    log = "".join(lines) + job.stdout.read()  # every writer of the pipe has exited
    assert "preempted | SIGTERM received | saving step" in log, log[-3000:]
    stopped_at = int(log.split("preempted | SIGTERM received | saving step ")[1].split(";")[0])
    assert SnapshotStore(str(tmp_path / "snapshots")).load_latest()["step"] == stopped_at
    again = tiny_overrides(shakespeare, tmp_path, max_steps=stopped_at + 5, log_every=20)
    resumed = run_main(again, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resume | step {stopped_at} |" in resumed.stdout


def test_a_second_ctrl_c_a_moment_later_stops_at_once_and_keeps_the_last_snapshot(
    shakespeare, tmp_path
):
    args = tiny_overrides(shakespeare, tmp_path, max_steps=40, save_every=5)
    # One process, whose step-10 save hangs half-way (tests/faulty_main.py): the first Ctrl-C asks
    # for a snapshot that cannot come; the second, a moment later, is the user insisting.
    job = start_job(args, nproc=0, script=FAULTY, env={"FAULT": "block_write:0:10"})
    wait_for_line(job, "blocked half-way through writing snapshot_00000010")
    job.send_signal(signal.SIGINT)
    with pytest.raises(subprocess.TimeoutExpired):  # the first one waits for the step's snapshot
        job.wait(timeout=2)
    job.send_signal(signal.SIGINT)
    job.communicate(timeout=30)
    assert job.returncode == 130
    assert SnapshotStore(str(tmp_path / "snapshots")).load_latest()["step"] == 5


def test_async_saves_give_the_same_run_and_the_same_snapshots(ddp_reference, shakespeare, tmp_path):
    straight, settings, extra = ddp_reference  # the same job, saving in the foreground
    result = run_main(
        tiny_overrides(shakespeare, tmp_path, **settings, async_save="true") + extra, nproc=2
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "writing in the background" in result.stdout
    assert_same_run(straight.run_dir, tmp_path, settings["max_steps"])
    assert sorted(p.name for p in (tmp_path / "snapshots").glob("snapshot_*.pt")) == [
        "snapshot_00000010.g1.pt",
        "snapshot_00000020.g1.pt",
        "snapshot_00000030.g1.pt",
    ]


def test_a_failing_background_save_fails_the_job(shakespeare, tmp_path):
    args = tiny_overrides(shakespeare, tmp_path, max_steps=3000, save_every=10, async_save="true")
    job = start_job(args)
    wait_for_line(job, "written in background")
    snap_dir = tmp_path / "snapshots"
    os.rename(snap_dir, tmp_path / "moved")
    snap_dir.write_text("the snapshot directory is now a file")  # every later write fails
    out, _ = job.communicate(timeout=120)
    assert job.returncode != 0
    assert "background snapshot save" in out and "failed" in out
    assert "done | step 3000" not in out


def ok_out(result) -> str:
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _epoch0_starts(trace_dir) -> list[int]:
    starts = []
    for name in os.listdir(trace_dir):
        for line in open(trace_dir / name):
            record = json.loads(line)
            if record["epoch"] == 0:
                starts += record["starts"]
    return starts


# 2 -> 1 is shown by the FSDP reshard (4 -> 2 -> 1), the S3 test and tensor parallelism's 2 -> 1.
@pytest.mark.parametrize("before, after", [(4, 2)])
def test_resume_at_another_world_size_sees_every_remaining_sample_once(
    before, after, shakespeare, tmp_path
):
    corpus = tmp_path / "small.txt"
    corpus.write_text(shakespeare.read_text()[:700])  # 598 training windows of 32: a short epoch
    n_windows, batch, first_leg = int(700 * 0.9) - 32, 4, 20
    consumed = first_leg * before * batch
    remaining_steps = (n_windows - consumed) // (
        before * batch
    )  # the global batch is kept: accumulation grows
    common = dict(eval_every=10_000, save_every=first_leg, trace_samples_path=tmp_path / "trace")
    first = run_main(tiny_overrides(corpus, tmp_path, max_steps=first_leg, **common), nproc=before)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_main(
        tiny_overrides(corpus, tmp_path, max_steps=first_leg + remaining_steps, **common),
        nproc=after,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert (
        f"resume | step {first_leg} | epoch 0 | {consumed} samples into the epoch | "
        f"saved at world size {before}, now {after}" in second.stdout
    )
    seen = _epoch0_starts(tmp_path / "trace")
    assert len(seen) == len(set(seen))  # nothing repeated
    assert f"global batch kept at {before * batch} windows" in second.stdout
    assert len(seen) == n_windows - (n_windows - consumed) % (
        before * batch
    )  # nothing skipped but the last partial batch
    # A later restart at the new size still keeps the global batch (the snapshot records it).
    third = run_main(
        tiny_overrides(corpus, tmp_path, max_steps=first_leg + remaining_steps + 3, **common),
        nproc=after,
    )
    assert f"global batch kept at {before * batch} windows" in ok_out(third)
