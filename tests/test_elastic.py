"""Fault tolerance under torchrun: killed and failing workers, stalled ranks, and other launchers.

Real processes throughout: torchrun restarts the worker group, the trainer resumes from
the newest snapshot, and the job finishes at max_steps with every step recorded once.
"""

import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import (
    MAIN,
    REPO,
    free_port,
    start,
    start_main,
    tiny_overrides,
    wait_for_line,
    worker_pid,
)

from mingpt_ddp.metrics import MetricsLog

pytestmark = pytest.mark.slow
FAULTY = REPO / "tests" / "faulty_main.py"  # main.py with faults injected (FAULT=...)


def start_elastic(script, nproc, args, env=None) -> subprocess.Popen:
    """torchrun restarting the worker group up to 3 times, checking its workers every 0.5 s."""
    return start_main(
        args,
        nproc=nproc,
        env=env,
        script=script,
        torchrun_flags=("--max-restarts=3", "--monitor-interval=0.5"),
    )


def steps_logged(out: str) -> list[int]:
    return [int(s) for s in re.findall(r"^step +(\d+)/", out, flags=re.M)]


def assert_complete_history(run_dir, max_steps):
    assert [r["step"] for r in MetricsLog.read(str(run_dir / "metrics.jsonl"))] == list(
        range(1, max_steps + 1)
    )


def test_sigkill_of_a_random_rank_at_a_random_step_restarts_and_finishes(shakespeare, tmp_path):
    rng = random.Random(2024)  # seeded: the same rank and step every run
    kill_rank, kill_step = rng.randrange(2), rng.choice([s for s in range(12, 29) if s % 10])
    args = tiny_overrides(shakespeare, tmp_path, max_steps=40, save_every=10, log_every=1)
    job = start_elastic(MAIN, 2, args)
    before = wait_for_line(job, f"step {kill_step:>6}/40")
    victim = worker_pid(job.pid, kill_rank)
    assert victim, f"no worker with RANK={kill_rank}"
    os.kill(victim, signal.SIGKILL)
    rest, _ = job.communicate(timeout=180)
    out = "".join(before) + rest
    assert job.returncode == 0, out[-3000:]
    assert "restart | torchrun restarted the workers (TORCHELASTIC_RESTART_COUNT=1)" in out
    assert (
        f"rank {kill_rank} died without a word" in out
    )  # the killed rank left no note; its peer did
    # The ranks may run a few steps between rank 0's line and the kill (3 ms steps): the resume
    # point is the last snapshot the first attempt committed, at or after the one before the line.
    first = out.split("restart | torchrun restarted")[0]
    last_snapshot = int(re.findall(r"^snapshot \| step (\d+) ", first, flags=re.M)[-1])
    assert last_snapshot >= kill_step // 10 * 10
    assert f"resume | step {last_snapshot} |" in out
    steps = steps_logged(out)
    assert steps[-1] == 40 and sorted(set(steps)) == list(range(1, 41))  # none skipped
    redone = [s for s in range(1, 41) if steps.count(s) > 1]
    # exactly the steps since that snapshot were done twice
    assert redone == list(range(last_snapshot + 1, max(steps_logged(first)) + 1))
    assert_complete_history(tmp_path, 40)


def test_an_exception_on_one_rank_is_reported_after_the_restart(shakespeare, tmp_path):
    args = tiny_overrides(shakespeare, tmp_path, max_steps=20, save_every=5, log_every=1)
    job = start_elastic(FAULTY, 2, args, env={"FAULT": "raise:1:7"})
    out, _ = job.communicate(timeout=180)
    assert job.returncode == 0, out[-3000:]
    assert "rank 1: RuntimeError: injected failure" in out
    assert "resume | step 5 |" in out and "done | step 20" in out
    assert_complete_history(tmp_path, 20)


def test_a_stalled_rank_becomes_an_error_within_the_collective_timeout_and_the_group_restarts(
    shakespeare, tmp_path
):
    timeout_s = 5
    args = tiny_overrides(
        shakespeare,
        tmp_path,
        max_steps=20,
        save_every=5,
        log_every=1,
        collective_timeout_s=timeout_s,
    )
    job = start_elastic(FAULTY, 2, args, env={"FAULT": "stall:1:7"})
    wait_for_line(job, "fault | rank 1 | stall")
    stalled_at = time.monotonic()
    restarted = wait_for_line(job, "restart | torchrun restarted the workers", timeout=120)
    detected_in = time.monotonic() - stalled_at
    rest, _ = job.communicate(timeout=180)
    out = "".join(restarted) + rest
    assert job.returncode == 0, out[-3000:]
    # The healthy rank's collective gives up after timeout_s; the stuck rank, told to stop,
    # gives up after timeout_s too; then torchrun starts the new attempt (a few seconds).
    assert detected_in < 2 * timeout_s + 20
    assert "done | step 20" in out
    assert_complete_history(tmp_path, 20)


def test_a_launcher_that_only_sets_the_standard_variables_works(shakespeare, tmp_path):
    # What `accelerate launch`, deepspeed's launcher or a hand-written script do:
    # start N processes with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
    port, world = free_port(), 2
    args = tiny_overrides(shakespeare, tmp_path, max_steps=6, save_every=6)
    procs = [
        start(
            [sys.executable, MAIN, *args],
            env={
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
            },
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "world size 2 | backend gloo" in outs[0] and "done | step 6" in outs[0]
    # Only rank 0 prints (some torch versions' gloo logs its own connection lines; those are not
    # ours).
    assert [
        line for line in outs[1].splitlines() if line.strip() and not line.startswith("[Gloo]")
    ] == []
