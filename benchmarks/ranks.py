"""Start the ranks of a one-node job as torchrun starts its workers, for a fraction of the cost.

    python benchmarks/ranks.py NPROC SCRIPT [ARGS...]

The tests that are not about the launcher start main.py through this script (benchmarks/common.py:
main_command). A tiny job's cost is mostly start-up: torchrun's agent is a process that imports
torch, and each rank imports torch, Hydra and this package (about 1.6 and 2.5 CPU-seconds on the
2-core machines CI runs on), while its few training steps take a fraction of a second; the suite
starts a few hundred jobs. So this launcher imports all that once (the story module `main` and
what it imports) and forks each rank from itself: a rank then runs SCRIPT as `python SCRIPT ARGS`
would (runpy, as __main__), with the modules already loaded. The tests of torchrun itself
(restarts, elastic membership, multi-node rendezvous, c10d and etcd, the README's commands) still
use torchrun.

What each rank gets is what a torchrun worker of a one-node job gets: RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT (rank 0 hosts the key-value
store that torchrun's agent would host), and OMP_NUM_THREADS=1 unless it is set (before torch is
imported: OpenMP reads it once, as it loads). As torchrun does without restarts: SIGTERM and
SIGINT are passed on to every rank; when a rank fails, the others are stopped (SIGTERM, then
SIGKILL after 30 s); the exit status is 0 if every rank succeeded, else 1.
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import socket
import sys
import threading
import traceback

GRACE_S = 30  # a stopped rank's time to finish its step and snapshot before SIGKILL
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_env(rank: int, nproc: int, port: int) -> dict:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def run_rank(env: dict, script: str, args: list[str], path: list[str]) -> None:
    """In the forked child: this rank's environment, then SCRIPT; never returns."""
    os.environ.update(env)
    run_script([script, *args], path)


def run_script(argv: list[str], path: list[str]) -> None:
    """Run `python ARGV` (a script, or `-m MODULE`) in this process as the interpreter would, with
    the import path it would have (the script's folder first, then `path`), then exit with its
    status; never returns."""
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[:] = argv[1:], [os.getcwd(), *path]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[:] = argv, [os.path.dirname(os.path.abspath(argv[0])), *path]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)  # sys.exit("message"), as the interpreter prints it
    except BaseException:  # noqa: BLE001 - reported as python would, then a failed exit
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what the interpreter's exit would run (os._exit skips it)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def preload() -> None:
    """What every rank imports, imported once: torch, Hydra and the package (main), the grid's
    layouts (loaded by name when the strategy is built), and torch's compiler, which the first
    optimizer a rank builds imports (torch.optim's add_param_group is wrapped by
    _disable_dynamo). OMP_NUM_THREADS is read as OpenMP loads, with torch: set before."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import torch._dynamo  # noqa: F401

    import main  # noqa: F401
    import mingpt_ddp.parallel.grid  # noqa: F401


def stop(running: set[int], sig: int = signal.SIGTERM) -> None:
    """sig to every rank still running; SIGKILL to those still running GRACE_S later."""

    def send(signum: int) -> None:
        for pid in list(running):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:  # it ended meanwhile
                pass

    send(sig)
    timer = threading.Timer(GRACE_S, send, (signal.SIGKILL,))
    timer.daemon = True  # the launcher exits as soon as the last rank has
    timer.start()


def main(nproc: int, script: str, args: list[str]) -> int:
    path = sys.path[1:]  # without this script's folder
    preload()
    with socket.socket() as s:  # a free port for rank 0's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    running = set()
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            run_rank(rank_env(rank, nproc, port), script, args, path)
        running.add(pid)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stop(running, signum))
    failed = False
    while running:
        pid, status = os.wait()  # blocks until a rank ends (they are this process's only children)
        if pid in running:
            running.discard(pid)
            if os.waitstatus_to_exitcode(status) != 0 and not failed:
                failed = True
                stop(running)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2], sys.argv[3:]))
