"""Shared test fixtures: where the corpus is, the slow marker, and the servers a module shares.

The helpers that start and watch real processes (main.py, torchrun, free ports, tiny run settings,
killing a process tree) are benchmarks/common.py's, shared with the benchmark scripts; they are
re-exported here so that a test can still write `from conftest import run_main`.

What is slow: every test that starts a process of its own (a Python interpreter: main.py,
torchrun, a script, pip) or a server (moto_server, etcd, SLURM's daemons); `pytest -m "not slow"`
runs the rest, in process, in well under a minute. Test files mark themselves; a test that uses
a server fixture (s3, bucket, etcd) is marked here, and so are the process tests of files that
others own (PROCESS_TESTS). Cheap shell tools (bash -n, git ls-files, mount) do not count.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def share_the_cores() -> int:
    """CPU threads per job when pytest-xdist runs several test files at once: the cores divided
    among the workers (OMP_NUM_THREADS, which every job this session starts inherits, and this
    process's own torch). Without it each `python main.py` starts one OpenMP thread per core, and
    threads that outnumber the cores spin waiting for each other: three such runs at once on 2
    cores took 78 s and 150 CPU-seconds, with one thread each 19 s and 37 (gpu_check's CPU row).
    A serial run keeps torch's default; a value the caller set is kept."""
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (cores or 1) // workers))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return torch.get_num_threads()


share_the_cores()

from benchmarks.common import (  # noqa: E402 - needs REPO on sys.path first
    MAIN,
    RANKS,
    TINY,
    TINY_MODEL,
    Unavailable,
    descendants,
    free_port,
    job_env,
    kill_tree,
    main_command,
    run,
    run_main,
    run_python,
    start,
    start_main,
    sweep,
    sweep_jobs,
    sweep_overrides,
    tiny_gpt,
    tiny_overrides,
    wait_for_line,
    worker_pid,
)
from benchmarks.s3_local import MotoServer  # noqa: E402

__all__ = [
    "MAIN",
    "RANKS",
    "REPO",
    "TINY",
    "TINY_MODEL",
    "descendants",
    "free_port",
    "job_env",
    "kill_tree",
    "lose_a_node",
    "main_command",
    "run",
    "run_main",
    "run_python",
    "start",
    "start_main",
    "sweep",
    "sweep_jobs",
    "sweep_overrides",
    "tiny_gpt",
    "tiny_overrides",
    "wait_for_line",
    "worker_pid",
]

# Fixtures that start a server process: a test using one is slow.
SERVER_FIXTURES = {"s3", "bucket"}
# Process tests in files owned by others, who have not marked them (test names, without parameters).
PROCESS_TESTS = {
    "test_devices.py": {
        "test_the_job_line_says_which_precision_auto_picked_and_why",
        "test_keeping_freed_memory_stops_each_step_page_faulting_its_tensors_back",
        "test_the_job_line_says_the_allocator_setting_and_false_leaves_glibc_alone",
    },
}


def pytest_collection_modifyitems(items):
    for item in items:
        name = getattr(item, "originalname", item.name)
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) or name in PROCESS_TESTS.get(
            item.path.name, ()
        ):
            item.add_marker(pytest.mark.slow)


def _find_shakespeare() -> Path | None:
    for candidate in (
        os.environ.get("TINYSHAKESPEARE_PATH"),
        REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt",
        REPO / "data" / "tinyshakespeare" / "input.txt",
    ):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    path = _find_shakespeare()
    if path is None:
        pytest.skip(
            "tiny Shakespeare not found: set TINYSHAKESPEARE_PATH or run "
            "python data/fetch_shakespeare.py"
        )
    return path


@pytest.fixture(scope="session")
def ddp_reference(shakespeare, tmp_path_factory):
    """The uninterrupted reference run that resumed, async-saving and reducing-another-way runs are
    compared with (test_training_runs.py, test_resume.py): 30 steps at world size 2, saved and
    evaluated every 10, logged every step, with dropout (random numbers the RNG state must carry
    over a resume). Returns (the run: run_dir, stdout), its trainer settings and its extra
    overrides."""
    settings, extra = (
        dict(max_steps=30, save_every=10, log_every=1, eval_every=10),
        ["gpt_config.dropout=0.1"],
    )
    run_dir = tmp_path_factory.mktemp("ddp-reference")
    result = run_main(tiny_overrides(shakespeare, run_dir, **settings) + extra, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return SimpleNamespace(run_dir=run_dir, stdout=result.stdout), settings, extra


def parallelisms(out_dir: Path, only: str) -> tuple[dict, Path]:
    """benchmarks/parallelisms.py --quick (6 steps) on the layouts named in `only` (a comma list):
    its rows keyed by layout (exactly those, each with the grid's five degrees and ep, within 1e-4
    of one process's losses, and every rank sending the bytes its formula predicts), and the path of
    its JSON report (the markdown table beside it)."""
    out = out_dir / "parallelisms.json"
    script = str(REPO / "benchmarks" / "parallelisms.py")
    result = subprocess.run(
        [sys.executable, script, "--quick", "--steps", "6", "--out", str(out), "--only", only],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["layout"]: r for r in report["rows"]}
    assert sorted(rows) == sorted(only.split(",")) and report["hardware"]["device"]
    for r in rows.values():
        assert set(r["degrees"]) == {"dp_replicate", "dp_shard", "tp", "cp", "pp", "ep"}, r
        assert r["max_abs_loss_diff"] <= 1e-4, r
        assert r["sent_bytes_per_rank"] == r["sent_bytes_formula_per_rank"], r
    return rows, out


def assert_same_run(a: list[dict], b: list[dict], steps: int) -> None:
    """Two runs' metrics records step for step: the same steps 1..steps, and losses and gradient
    norms equal to float rounding (another layout of the same run)."""
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, steps + 1))
    for x, y in zip(a, b):
        assert abs(x["train_loss"] - y["train_loss"]) <= 1e-5, (x, y)
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-4 * max(1.0, x["grad_norm"]), (x, y)
        assert abs(x.get("val_loss", 0) - y.get("val_loss", 0)) <= 1e-5, (x, y)


def run_faulty(args: list[str], fault: str, nproc: int = 2) -> str:
    """main.py with a fault injected (tests/faulty_main.py, FAULT=kind:rank:step) under torchrun
    --max-restarts=1: its whole output, once the restarted job exited 0."""
    job = start_main(
        args,
        nproc=nproc,
        script=REPO / "tests" / "faulty_main.py",
        env={"FAULT": fault},
        torchrun_flags=("--max-restarts=1", "--monitor-interval=0.5"),
    )
    out, _ = job.communicate(timeout=240)
    assert job.returncode == 0, out[-3000:]
    return out


def lose_a_node(survivor, lost, after: str) -> str:
    """Once the survivor agent prints `after`, SIGKILL the other agent and its workers (a node
    losing power); returns the survivor's whole output when it exits."""
    lines = wait_for_line(survivor, after, timeout=120)
    kill_tree(lost)
    rest, _ = survivor.communicate(timeout=240)
    return "".join(lines) + rest


@pytest.fixture(scope="session")
def s3():
    """A real S3-compatible server (moto_server) on loopback, shared by the whole session (each
    test gets its own bucket)."""
    try:
        server = MotoServer()
    except Unavailable as e:
        pytest.skip(str(e))
    yield server
    server.stop()


_buckets = itertools.count()


@pytest.fixture
def bucket(s3, request, monkeypatch):
    """A fresh bucket named after the test, with the test credentials in the environment."""
    from s3_server import CREDENTIALS

    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    # The server outlives the module: a number keeps two tests' names from meeting in one bucket.
    name = (
        re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40].strip("-") + f"-{next(_buckets)}"
    )
    s3.client().create_bucket(Bucket=name)
    return name


@pytest.fixture(autouse=True)
def no_stray_processes():
    """After each test, kill what it left running (a job that timed out, a killed launcher's
    workers), so one failure cannot leave processes competing with the rest of the suite.
    Servers shared by several tests (moto_server) are left to their fixtures, and the fork server
    (benchmarks/forkserver.py) to the end of the session."""
    yield
    from benchmarks.forkserver import server_pid

    for pid in set(descendants(os.getpid())) - {server_pid()}:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"moto_server" in f.read():
                    continue
            os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
