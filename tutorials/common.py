"""Shared by the tutorials: join the process group, print each rank's line in rank order, leave."""

import os
import socket
import sys

import torch.distributed as dist


def init() -> tuple[int, int]:
    """Join the group torchrun describes (gloo: works on any CPU); returns (rank, world size)."""
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a rendezvous this script hosts
    (torchrun --standalone picks its own the same way)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def say(line: str) -> None:
    """Collect one line from every rank and print them on rank 0, in rank order.

    Ranks printing for themselves would interleave at random; gathering first is
    itself a collective (all_gather_object), and every rank must call it.
    """
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, f"[rank {dist.get_rank()}] {line}")
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)


def title(text: str) -> None:
    if dist.get_rank() == 0:
        print(f"\n== {text}", flush=True)


def finish(code: int = 0) -> None:
    """Leave the group together and exit with code.

    The barrier first: a rank tearing down while a peer still talks to it can abort gloo. Then
    os._exit, skipping the interpreter's shutdown: after a clean teardown, gloo's exit-time C++
    destructors still aborted some 2-rank runs here ("terminate called without an active
    exception", no Python frame: 8 in 55 of one tutorial), failing a finished run; main.py leaves
    the same way (exit_process in mingpt_ddp/runtime/distributed.py).
    """
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
