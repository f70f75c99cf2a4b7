"""Shared test fixtures: where the corpus is, tiny run settings, and helpers to run main.py for real."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _find_shakespeare() -> Path | None:
    for candidate in (os.environ.get("TINYSHAKESPEARE_PATH"),
                      REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt",
                      REPO / "data" / "tinyshakespeare" / "input.txt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    path = _find_shakespeare()
    if path is None:
        pytest.skip("tiny Shakespeare not found: set TINYSHAKESPEARE_PATH or run python data/fetch_shakespeare.py")
    return path


# A model small enough that a real multi-process run takes seconds on 2 cores. On the CPU even
# on a GPU machine: these tests compare runs bit for bit (a resumed run against an uninterrupted
# one), which holds on CPU, while several CUDA kernels (atomic adds in embedding backward, among
# others) sum in a different order each run. The CUDA paths have their own tests (test_cuda.py).
# In fp32: precision "auto" would pick bf16 on CPUs with AVX-512 BF16 or AMX and fp32 on others, and
# these tests compare numbers across runs on whatever CPU runs them (auto has its own tests).
TINY = ["gpt_config.n_layer=2", "gpt_config.n_head=2", "gpt_config.n_embd=32", "data_config.block_size=32",
        "trainer_config.batch_size=4", "trainer_config.eval_iters=2", "trainer_config.sample_chars=0",
        "trainer_config.device=cpu", "trainer_config.use_amp=false"]


def tiny_overrides(data: Path, run_dir: Path, **trainer) -> list[str]:
    """Hydra overrides for a tiny run writing under run_dir (its snapshots/, metrics.jsonl, prepared/)."""
    args = TINY + [f"data_config.path={data}", f"data_config.cache_dir={run_dir / 'prepared'}",
                   f"trainer_config.run_dir={run_dir}"]  # snapshots/ and metrics.jsonl go under it
    return args + [f"trainer_config.{k}={v}" for k, v in trainer.items()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "--master_port", str(free_port()), str(REPO / "main.py"), *args]


def run_main(args: list[str], nproc: int = 0, timeout: float = 240, cwd: Path = REPO,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run main.py in one process (nproc=0) or under torchrun; returns the finished process."""
    cmd = torchrun_cmd(nproc, *args) if nproc else [sys.executable, str(REPO / "main.py"), *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


def descendants(pid: int) -> list[int]:
    """All live descendants of pid, read from /proc (torchrun puts workers in their own sessions)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it: a power cut, as far as the job can tell."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def lose_a_node(survivor: subprocess.Popen, lost: subprocess.Popen, after: str) -> str:
    """Once the survivor agent prints `after`, SIGKILL the other agent and its workers (a node losing
    power); returns the survivor's whole output when it exits."""
    lines = wait_for_line(survivor, after, timeout=120)
    kill_tree(lost)
    rest, _ = survivor.communicate(timeout=240)
    return "".join(lines) + rest


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 180) -> list[str]:
    """Read proc's stdout until a line contains needle; returns the lines read."""
    lines, deadline = [], time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        if needle in line:
            return lines
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"{needle!r} not seen; output:\n{''.join(lines)}")


@pytest.fixture(scope="module")
def s3():
    """A real S3-compatible server (moto_server) on loopback, shared by a test module."""
    from s3_server import MotoServer

    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def bucket(s3, request, monkeypatch):
    """A fresh bucket named after the test, with the test credentials in the environment."""
    from s3_server import CREDENTIALS

    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    name = request.node.name.replace("_", "-")[:50].lower().strip("-")
    s3.client().create_bucket(Bucket=name)
    return name


@pytest.fixture(autouse=True)
def no_stray_processes():
    """After each test, kill what it left running (a job that timed out, a killed launcher's
    workers), so one failure cannot leave processes competing with the rest of the suite.
    Servers shared by a module's tests (moto_server) are left to their fixtures."""
    yield
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"moto_server" in f.read():
                    continue
            os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
