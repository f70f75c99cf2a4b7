"""Shared by the tutorials: join the process group and print each rank's line in rank order."""

import torch.distributed as dist


def init() -> tuple[int, int]:
    """Join the group torchrun describes (gloo: works on any CPU); returns (rank, world size)."""
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


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
