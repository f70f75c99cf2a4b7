"""Replica groups and jobs for the fault-tolerance benchmarks: a process whose output lines are
timestamped as they arrive, torchft's lighthouse on a free port, and a replica group's torchrun
job (benchmarks/fault_tolerance.py, benchmarks/slow_links.py and their tests use them)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import FAULTY, MAIN, free_port, main_command, start

HEARTBEAT_MS = 2000  # the lighthouse's: how long a silent group stays in the quorum
STEP = re.compile(r"^step +(\d+)/")


class Stamped:
    """A process whose output lines are kept with the time each arrived (time.monotonic)."""

    def __init__(self, cmd: list, env: dict | None = None):
        self.proc = start(cmd, env)  # stdout and stderr in one text pipe
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return code

    def first(self, needle: str, after: float = 0.0) -> float | None:
        """When the first line containing needle (at or after `after`) arrived."""
        return next((t for t, line in self.lines if t >= after and needle in line), None)

    def wait_for(self, needle: str, after: float, timeout: float) -> float | None:
        """Poll until a line containing needle arrived after `after` (or the process ended)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if (t := self.first(needle, after)) is not None:
                return t
            time.sleep(0.1)
        return self.first(needle, after)

    def steps(self) -> list[tuple[float, int]]:
        return [(t, int(m.group(1))) for t, line in self.lines if (m := STEP.match(line))]

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def lighthouse_program() -> str:
    """torchft's `torchft_lighthouse`: beside this interpreter first (its venv's bin/, where pip put
    it, whether or not that is on PATH: as main_command runs torchrun with this interpreter), then
    on PATH; exits with the install command when it is in neither."""
    beside = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    found = beside if os.access(beside, os.X_OK) else shutil.which("torchft_lighthouse")
    if found is None:
        sys.exit(
            f"error: torchft_lighthouse is not beside {sys.executable} nor on PATH: "
            'pip install -e ".[torchft]" (Linux only)'
        )
    return found


class Lighthouse:
    """torchft's lighthouse on a free loopback port, for as long as the `with` lasts; with hosts
    (benchmarks/hosts.py), on host A's address, where the groups on both hosts reach it."""

    def __init__(self, heartbeat_ms: int = HEARTBEAT_MS, min_groups: int = 1, hosts=None):
        self.port, self.hosts = free_port(), hosts
        self.url = f"http://{hosts.addresses[0] if hosts else '127.0.0.1'}:{self.port}"
        flags = ["--min_replicas", str(min_groups), "--bind", f"[::]:{self.port}"]
        flags += ["--join_timeout_ms", "1000"]
        flags += ["--heartbeat_timeout_ms", str(heartbeat_ms), "--quorum_tick_ms", "100"]
        self.cmd = [lighthouse_program(), *flags]
        self.cmd = hosts.command(0, self.cmd) if hosts else self.cmd

    def __enter__(self) -> Lighthouse:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


def overrides(data: str, run_dir: Path, size: dict) -> list[str]:
    """The run both modes train: the default model (gpt-micro), fp32, a step logged each."""
    return [
        f"data_config.path={data}",
        f"data_config.cache_dir={run_dir.parent / 'prepared'}",
        f"trainer_config.run_dir={run_dir}",
        f"trainer_config.max_steps={size['steps']}",
        f"trainer_config.save_every={size['save_every']}",
        "trainer_config.log_every=1",
        f"trainer_config.eval_every={size['steps']}",
        "trainer_config.eval_iters=2",
        "trainer_config.sample_chars=0",
        "trainer_config.use_amp=false",
        f"trainer_config.batch_size={size['batch']}",
        "trainer_config.device=cpu",
    ]


def group(
    lighthouse: Lighthouse, g: int, args: list[str], fault: str | None = None, restarts: int = 1
) -> Stamped:
    """Replica group g of 2: a torchrun job of one process that may restart `restarts` times;
    on host g when the lighthouse runs on hosts, every address given explicitly (the hosts share
    one hostname): torchrun's store, gloo's interface, the name peers reach its manager by."""
    flags = (f"--max-restarts={max(restarts, 1)}", "--monitor-interval=0.5")
    ft = ["torchft_config.groups=2", f"torchft_config.group={g}"]
    env = {"TORCHFT_LIGHTHOUSE": lighthouse.url, "OMP_NUM_THREADS": "1"}
    if fault:
        env["FAULT"] = fault
    hosts = lighthouse.hosts
    if hosts:
        flags += (f"--local-addr={hosts.addresses[g]}",)
        ft.append(f"torchft_config.hostname={hosts.addresses[g]}")
        env["GLOO_SOCKET_IFNAME"] = hosts.nics[g]
    cmd = main_command(1, args + ft, flags, FAULTY if fault else MAIN, torchrun=True)
    return Stamped(hosts.command(g, cmd) if hosts else cmd, env)
