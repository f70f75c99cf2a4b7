"""Start the ranks of a one-node job the way torchrun starts its workers, without torchrun's agent.

    python benchmarks/ranks.py NPROC SCRIPT [ARGS...]

The tests and benchmarks that are not about the launcher start main.py through this script
(benchmarks/common.py: main_command). torchrun's agent is a Python process that imports torch:
about 1.6 CPU-seconds per job on the 2-core machines CI runs on, a quarter of what a tiny 2-rank
job costs, and the suite starts a few hundred jobs. The tests of torchrun itself (restarts,
elastic membership, multi-node rendezvous, c10d and etcd, the README's commands) still use it.

What each rank gets is what a torchrun worker of a one-node job gets: RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT (rank 0 hosts the key-value
store that torchrun's agent would host), and OMP_NUM_THREADS=1 unless it is set. As torchrun does
without restarts: SIGTERM and SIGINT are passed on to every rank; when a rank fails, the others
are stopped (SIGTERM, then SIGKILL after 30 s); the exit status is 0 if every rank succeeded,
else 1. It imports nothing but the standard library.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

GRACE_S = 30  # a stopped rank's time to finish its step and snapshot before SIGKILL


def rank_env(rank: int, nproc: int, port: int) -> dict:
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def stop(running: dict[int, subprocess.Popen], sig: int = signal.SIGTERM) -> None:
    """sig to every rank still running; SIGKILL to those still running GRACE_S later."""
    for p in list(running.values()):
        p.send_signal(sig)

    def kill_the_rest() -> None:
        for p in list(running.values()):
            p.kill()

    timer = threading.Timer(GRACE_S, kill_the_rest)
    timer.daemon = True  # the launcher exits as soon as the last rank has
    timer.start()


def main(nproc: int, command: list[str]) -> int:
    with socket.socket() as s:  # a free port for rank 0's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen(command, env=rank_env(r, nproc, port)) for r in range(nproc)]
    running = {p.pid: p for p in ranks}  # reaped here, by os.wait, not by Popen
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stop(running, signum))
    failed = False
    while running:
        pid, status = os.wait()  # blocks until a rank ends (they are this process's only children)
        if running.pop(pid, None) is not None and os.waitstatus_to_exitcode(status) != 0:
            if not failed:
                stop(running)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), [sys.executable, *sys.argv[2:]]))
