"""The one set of helpers for starting and watching this project's processes, shared by the
benchmark scripts and the tests: free ports, the command that starts main.py (one process or under
torchrun), the job environment, starting and waiting for jobs, reading a job's output up to a line,
killing a launcher with everything under it, the tiny run settings and model, a real S3 server,
and the hardware a result was measured on (stored with it: machines of one kind differ).

Why here: the benchmarks are commands a user runs from a checkout (`python benchmarks/bench.py`,
no pytest), so the helpers cannot live under tests/; the tests import this file as
`benchmarks.common` (tests/conftest.py puts the repository first on sys.path), the scripts as
`common` (their own folder is on sys.path). Nothing here imports torch or pytest at import time.

Where the test servers live: S3 is MotoServer below (moto_server on loopback; snapshot_bench.py
times against it too), with the proxies that cut or throttle its line in tests/s3_server.py;
etcd is tests/etcd_server.py; the one-node SLURM cluster is tests/slurm_cluster.py. Those two are
for tests only (they skip when their system is not installed).
"""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(REPO, "main.py")
FAULTY = os.path.join(REPO, "tests", "faulty_main.py")  # main.py with one fault injected
RANKS = os.path.join(REPO, "benchmarks", "ranks.py")  # a job's ranks without torchrun's agent

# A model small enough that a real multi-process run takes seconds on 2 cores, as Hydra overrides.
TINY_MODEL = {
    "gpt_config.n_layer": "2",
    "gpt_config.n_head": "2",
    "gpt_config.n_embd": "32",
    "data_config.block_size": "32",
    "trainer_config.batch_size": "4",
    "trainer_config.eval_iters": "2",
}
# On the CPU even on a GPU machine: tests compare runs bit for bit (a resumed run against an
# uninterrupted one), which holds on CPU, while several CUDA kernels (atomic adds in embedding
# backward, among others) sum in a different order each run. In fp32: precision "auto" picks bf16
# on CPUs with AVX-512 BF16 or AMX and fp32 on others, and runs are compared on whatever CPU
# runs them.
TINY_RUN = {
    "trainer_config.sample_chars": "0",
    "trainer_config.device": "cpu",
    "trainer_config.use_amp": "false",
}
TINY = [f"{k}={v}" for k, v in {**TINY_MODEL, **TINY_RUN}.items()]


def tiny_overrides(data, run_dir, **trainer) -> list[str]:
    """Overrides for a tiny run of main.py on `data`, writing under run_dir (its snapshots/,
    metrics.jsonl and prepared/), with trainer_config settings given as keywords."""
    args = TINY + [
        f"data_config.path={data}",
        f"data_config.cache_dir={os.path.join(run_dir, 'prepared')}",
        f"trainer_config.run_dir={run_dir}",
    ]
    return args + [f"trainer_config.{k}={v}" for k, v in trainer.items()]


def tiny_gpt(vocab_size: int = 11, block_size: int = 8, **switches):
    """The tiny GPT the in-process tests build (2 layers, 2 heads, width 16), seeded."""
    import torch

    from model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            n_layer=2, n_head=2, n_embd=16, vocab_size=vocab_size, block_size=block_size, **switches
        )
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main_command(
    nproc: int,
    overrides: list[str],
    torchrun_flags: tuple[str, ...] = (),
    script: str = MAIN,
    torchrun: bool | None = None,
    agent: bool = True,
) -> list[str]:
    """`python SCRIPT OVERRIDES` for one plain process, or `torchrun --standalone --nproc_per_node=N
    --master_port P FLAGS SCRIPT OVERRIDES` (torchrun as `python -m torch.distributed.run`, the same
    program). torchrun defaults to nproc > 1 or any flags; a port of its own per job, so that jobs
    started at once never meet on torchrun's default port. agent=False (and no torchrun flags):
    the same ranks started by ranks.py, without torchrun's agent process (ranks.py says why)."""
    torchrun = nproc > 1 or bool(torchrun_flags) if torchrun is None else torchrun
    if not torchrun or (not agent and not torchrun_flags):
        ranks = [RANKS, str(nproc)] if torchrun else []
        return [sys.executable, *ranks, str(script), *overrides]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--master_port",
        str(free_port()),
        *torchrun_flags,
        str(script),
        *overrides,
    ]


def job_env(extra: dict | None = None) -> dict:
    """This process's environment for a child: its output unbuffered (read line by line as it
    comes), and this checkout first on its import path, so that `python -m mingpt_ddp...` run
    from any directory uses the code beside this file, whatever copy an editable install points
    at."""
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(extra or {})}


def start(cmd: list[str], env: dict | None = None, cwd=REPO) -> subprocess.Popen:
    """Start cmd with stdout and stderr together in one text pipe (wait_for_line reads it)."""
    return subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=job_env(env),
    )


def run(
    cmd: list[str], env: dict | None = None, cwd=REPO, timeout: float = 240
) -> subprocess.CompletedProcess:
    """Run cmd to the end, its stdout and stderr captured apart."""
    return subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=job_env(env),
    )


def run_main(
    args: list[str],
    nproc: int = 0,
    timeout: float = 240,
    cwd=REPO,
    env: dict | None = None,
    script: str = MAIN,
    agent: bool = False,
) -> subprocess.CompletedProcess:
    """Run main.py (or a stand-in script) in one process (nproc=0) or as a job of nproc ranks:
    started by ranks.py, or with agent=True under torchrun (for what tests torchrun itself).
    Without the agent the job is forked from this process's fork server (run_python)."""
    command = main_command(nproc, args, script=script, torchrun=nproc > 0, agent=agent)
    return run_python(command, env=env, cwd=cwd, timeout=timeout)


def run_python(
    cmd: list, env: dict | None = None, cwd=REPO, timeout: float = 240
) -> subprocess.CompletedProcess:
    """run(cmd), forked from this process's fork server if it is a `python SCRIPT ARGS` whose
    PYTHON* variables are the server's (forkserver.py says why)."""
    sys.path += [] if REPO in sys.path else [REPO]
    from benchmarks.forkserver import run_forked

    forked = run_forked(cmd, job_env(env), cwd, timeout, job_env())
    return forked if forked is not None else run(cmd, env=env, cwd=cwd, timeout=timeout)


def sweep(
    args: list[str], sweep_dir, env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`python main.py --multirun ARGS` with its jobs under sweep_dir; returns the finished
    process."""
    return run(
        [sys.executable, MAIN, "--multirun", f"hydra.sweep.dir={sweep_dir}", *args],
        env=env,
        timeout=timeout,
    )


def sweep_overrides(data, root, **trainer) -> list[str]:
    """tiny_overrides for a sweep: each job writes in its own directory, so no run_dir; the
    prepared corpus under root, shared by the jobs."""
    return [
        a
        for a in tiny_overrides(data, root, **trainer)
        if not a.startswith("trainer_config.run_dir=")
    ]


def sweep_jobs(sweep_dir) -> dict:
    """Each job directory of a finished sweep with its metrics records, in name order."""
    import json
    from pathlib import Path

    return {
        p.parent: [json.loads(line) for line in p.read_text().splitlines()]
        for p in sorted(Path(sweep_dir).glob("*/metrics.jsonl"))
    }


def start_main(
    args: list[str],
    nproc: int = 0,
    env: dict | None = None,
    script: str = MAIN,
    torchrun_flags: tuple[str, ...] = (),
    agent: bool = False,
) -> subprocess.Popen:
    """Start main.py (or a stand-in script) like run_main, without waiting: its output in one
    pipe. torchrun_flags imply torchrun's agent."""
    command = main_command(nproc, args, torchrun_flags, script, torchrun=nproc > 0, agent=agent)
    return start(command, env=env)


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 180) -> list[str]:
    """Read proc's stdout until a line contains needle; returns the lines read. Fails when proc ends
    first, or when a line arrives after the deadline."""
    lines, deadline = [], time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        if needle in line:
            return lines
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"{needle!r} not seen; output:\n{''.join(lines)}")


def descendants(pid: int) -> list[int]:
    """All live descendants of pid, read from /proc (torchrun puts workers in their own sessions,
    so a process group would miss them): the stacks command's own walk."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from mingpt_ddp.runtime.stacks import children

    return children(pid)


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the worker with global rank `rank` under a launcher (torchrun's workers carry RANK
    in their environment; the agent, `torch.distributed.run` itself, is skipped)."""
    for pid in descendants(launcher_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"torch.distributed.run" not in cmdline:
            return pid
    return None


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it: a power cut, as far as the job can tell."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


class Unavailable(RuntimeError):
    """A system a helper needs is not installed here (tests skip on it, saying which)."""


def hardware() -> dict:
    """The device this process computes on, in words: the GPU's name, or the CPU's model with the
    instruction sets that decide its speed here (AVX-512, native bf16: AVX-512 BF16 and AMX). Like
    every script here, its caller has put REPO on sys.path."""
    import torch

    from mingpt_ddp.parallel.plan import cpu_flags

    if torch.cuda.is_available():
        return {
            "device": torch.cuda.get_device_name(0),
            "gpus": torch.cuda.device_count(),
            "torch": torch.__version__,
        }
    model, flags = platform.processor(), cpu_flags()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                model,
            )
    extras = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "device": f"{model} ({', '.join(extras) or 'no AVX-512'})",
        "cores": cores,
        "torch": torch.__version__,
    }
