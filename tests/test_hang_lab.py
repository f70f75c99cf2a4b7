"""When a job hangs: the stall report (mingpt_ddp/runtime/stall.py) names the rank that holds the
others up, in process and on a SIGSTOPped rank of main.py; tutorials/hang_lab.py's every hang is
named by its tool, and the job ends (the lab kills it; no test waits for a collective timeout)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, kill_tree, start_main, tiny_overrides, wait_for_line, worker_pid

from mingpt_ddp.runtime.distributed import DistContext
from mingpt_ddp.runtime.stall import SILENT_S, StallWatch

sys.path.insert(0, str(REPO / "tutorials"))


def watches(store, world: int = 3) -> list[StallWatch]:
    cpu = torch.device("cpu")
    ctxs = [DistContext(rank=r, local_rank=r, world_size=world, device=cpu) for r in range(world)]
    return [StallWatch(60.0, ctx, "unused", store) for ctx in ctxs]


def test_the_rank_behind_is_the_one_with_fewest_collectives_then_the_lowest_step():
    store = dist.HashStore()
    rank0, *_ = watches(store)
    beats = {0: [5, 12, 40], 1: [5, 12, 39], 2: [5, 12, 40]}  # counter, step, collectives
    for r, beat in beats.items():
        store.set(str(r), json.dumps(beat))
    rank0.seen = {r: (5, time.monotonic()) for r in beats}  # every heartbeat fresh
    assert rank0.behind() == "rank 1 behind: collectives entered 39, others more"
    store.set("1", json.dumps([5, 11, 40]))
    assert rank0.behind() == "rank 1 behind: step 11, others more"
    rank0.seen[2] = (5, time.monotonic() - 10)  # rank 2's counter has not moved for 10 s
    assert rank0.behind().startswith("rank 2 silent for 10 s: stopped or frozen")


@pytest.mark.slow
def test_the_stall_report_names_a_sigstopped_rank_within_the_configured_time(shakespeare, tmp_path):
    after = 3.0
    args = tiny_overrides(
        shakespeare, tmp_path, max_steps=100000, log_every=1, stall_report_s=after
    )  # fmt: skip
    # Under torchrun: the report finds the ranks by the RANK in each one's /proc environ, which a
    # rank forked by ranks.py does not show (it sets RANK after the fork, not at exec).
    job = start_main(args + ["trainer_config.collective_timeout_s=60"], nproc=2, agent=True)
    try:
        wait_for_line(job, "step      5/", timeout=120)
        os.kill(worker_pid(job.pid, 1), signal.SIGSTOP)
        stopped = time.monotonic()
        line = wait_for_line(job, "stall |", timeout=60)[-1]
        took = time.monotonic() - stopped
    finally:
        kill_tree(job)  # SIGKILL reaches a stopped process too
    assert "| rank 1 silent for" in line and "stopped or frozen" in line, line
    # Rank 0 waits up to SILENT_S more for a just-stopped rank to look silent; 1 s periods.
    assert took < after + SILENT_S + 3, took
    where = (tmp_path / "stall" / "rank_0.txt").read_text()
    assert "collectives entered" in where and "_train_loop" in where, where[:2000]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["skip", "shape", "order", "raise", "slow", "stopped", "rendezvous"]
)
def test_every_hang_of_the_lab_is_named_by_its_tool_and_the_job_ends(name, tmp_path):
    import hang_lab

    if name == "slow":
        can_read_stacks()
    row = hang_lab.run(name, str(tmp_path), budget_s=45)
    assert row["named"], row
    assert row["seconds"] < 45
    assert not left_running(f"LAB_DIR={tmp_path}".encode()), "the lab left a worker running"


def test_a_hang_whose_tool_is_not_installed_says_what_to_install_in_one_line(
    tmp_path, monkeypatch, capsys
):
    """No py-spy beside the interpreter nor on PATH: the "slow" hang is not started (it would run
    out its budget and print NOT FOUND); its line names the extra that brings py-spy."""
    import hang_lab

    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "argv", ["hang_lab.py", "--hang", "slow"])
    assert hang_lab.main() == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("hang | slow | seen: ")
    assert line.endswith(
        "python -m mingpt_ddp.runtime.stacks: not run: py-spy is not installed: "
        'pip install -e ".[debug]" | 0.0 s'
    )
    pyproject = (REPO / "pyproject.toml").read_text()  # the extra named is the one with py-spy
    assert re.search(rf'^{hang_lab.PY_SPY_EXTRA} = \["py-spy[>=<]', pyproject, re.M)
    # in a venv used by its path (its bin/ not on PATH), py-spy beside its python is found
    beside = tmp_path / "venv" / "bin" / "py-spy"
    beside.parent.mkdir(parents=True)
    beside.write_text("#!/bin/sh\n")
    beside.chmod(0o755)
    assert hang_lab.py_spy() == str(beside) and hang_lab.missing_tool("slow") is None


def left_running(marker: bytes) -> list[int]:
    """Processes whose environment holds marker (orphans too: torchrun's workers are in sessions
    of their own, and outlive a torchrun that was killed alone)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def can_read_stacks() -> None:
    """Skip unless py-spy is installed and may attach (ptrace: root, or ptrace_scope 0)."""
    if shutil.which("py-spy") is None:
        pytest.skip('py-spy is not installed: pip install -e ".[debug]"')
    sleeper = "import time; print('ready', flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", sleeper], stdout=subprocess.PIPE)
    child.stdout.readline()  # the interpreter is up: py-spy can find it
    try:
        dump = subprocess.run(["py-spy", "dump", "--pid", str(child.pid)], capture_output=True)
    finally:
        child.kill()
        child.wait()
    if dump.returncode != 0:
        pytest.skip(f"py-spy cannot attach here (ptrace?): {dump.stderr.decode()[-200:]}")
