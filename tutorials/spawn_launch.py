"""Launching without torchrun: torch.multiprocessing.spawn, and what a launcher really does.

    python tutorials/spawn_launch.py --nproc 2  # main.py's training, 2 ranks
    python tutorials/spawn_launch.py --nproc 2 trainer_config.max_steps=100  # with overrides

A launcher's whole job is to start N copies of the training code and tell each one
who it is. torchrun does that with environment variables (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and, given --max-restarts
(0 by default), restarts them all when one fails. mp.spawn starts N processes on this
machine and passes each its index as the first argument; here each child turns that
index into the same variables and calls main.run(), so main.py cannot tell the difference.
What you give up compared with torchrun: restarts (--max-restarts), elastic
membership, and multi-node rendezvous. What you get: no separate command; the parent
waits for all N children and, if one fails, stops the others and re-raises its error.

Not for notebooks as such: the children are fresh interpreters ("spawn"), and mp.spawn
sends them the worker function by name, so they must be able to import it. A worker
defined in a notebook cell lives in the notebook's __main__, which a child cannot
import ("Can't get attribute 'worker' on <module '__main__' (built-in)>"). Define the worker in
a .py file, as here, and import it from the notebook.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch.multiprocessing as mp
from common import free_port  # tutorials/common.py

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(local_rank: int, nproc: int, port: int, overrides: list[str]) -> None:
    """Runs in each child process; mp.spawn passes local_rank = 0 .. nproc-1."""
    # One machine: the global rank is the local rank. These are the variables torchrun sets.
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    sys.path.insert(0, REPO)
    import main

    # The config main.py would compose from these overrides (schema, groups, YAML): a typo is
    # refused here too, with Hydra's message, not silently ignored.
    job = main.to_job(main.compose(overrides))  # the parent checked these overrides already
    main.exit_process(main.run(job).code)  # a non-zero exit makes mp.spawn raise in the parent


def main() -> int:
    parser = argparse.ArgumentParser(
        description="Train main.py's model with torch.multiprocessing.spawn."
    )
    parser.add_argument(
        "--nproc", type=int, default=2, help="processes (ranks) to start on this machine"
    )
    parser.add_argument(
        "overrides", nargs="*", help="config overrides, as for main.py (section.key=value)"
    )
    args = parser.parse_args()
    sys.path.insert(0, REPO)
    import main as training  # (imported here, so no RANK is set yet: it prints as the parent)

    try:  # refuse a bad config once, here, rather than in every child at once
        training.to_job(training.compose(args.overrides))
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors and ConfigError, one line each
        cause = (
            f" ({str(e.__cause__).splitlines()[0]})" if e.__cause__ else ""
        )  # Hydra's reason, e.g. the key
        print(f"error: {str(e).splitlines()[0]}{cause}", file=sys.stderr)
        return 1
    port = free_port()  # for the rendezvous (torchrun --standalone does the same)
    try:
        # join=True: wait for all children; if one fails, the others are terminated and this raises.
        mp.spawn(worker, args=(args.nproc, port, args.overrides), nprocs=args.nproc, join=True)
    except (
        mp.ProcessExitedException,
        mp.ProcessRaisedException,
    ) as e:  # a child exited non-zero, or raised
        print(f"error: rank {e.error_index} failed; see its message above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
