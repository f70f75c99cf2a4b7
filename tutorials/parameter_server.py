"""Everything through rank 0 (a parameter server) next to the ring: why the ring wins as N grows.

    torchrun --standalone --nproc_per_node=4 tutorials/parameter_server.py

Parameter-server style (a star): every rank sends its whole tensor (S bytes) to rank 0,
rank 0 adds them up and sends the sum back to each. Rank 0 receives N-1 full tensors one
after another, then sends N-1: its link carries (N-1) x S in each direction, so where that
link is the limit (a real network) its time grows with N. In the ring every rank sends
2(N-1)/N x S and receives as much, all ranks at once: no link carries more than about 2 x S,
whatever N. (The total over all links is the same, 2(N-1) x S: the ring spreads it, the star
piles it onto rank 0.)
"""

import time

import torch
import torch.distributed as dist
from common import finish, init, say, title
from ring_allreduce import ring_all_reduce

MiB = 1 << 20


def parameter_server_all_reduce(t: torch.Tensor) -> tuple[int, int]:
    """Sum t over all ranks through rank 0; returns (bytes sent, bytes received) by this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    size = t.numel() * t.element_size()
    if rank == 0:
        incoming = torch.empty_like(t)
        for src in range(1, world):
            dist.recv(incoming, src)
            t += incoming
        for dst in range(1, world):
            dist.send(t, dst)
        return (world - 1) * size, (world - 1) * size
    dist.send(t, 0)
    dist.recv(t, 0)
    return size, size


def ring(t: torch.Tensor) -> tuple[int, int]:
    """The ring, with the same (sent, received) answer: each rank receives what its neighbour
    sends."""
    sent = ring_all_reduce(t)
    return sent, sent


if __name__ == "__main__":
    rank, world = init()
    x = torch.randn(MiB) + rank  # 2^20 float32 = 4 MiB
    title(
        f"{world} ranks, a 4 MiB float32 tensor: what each rank sends and receives, "
        "and the time (mean of 5)"
    )
    for name, fn in (("parameter server", parameter_server_all_reduce), ("ring", ring)):
        result = x.clone()
        sent, received = fn(result)
        reference = x.clone()
        dist.all_reduce(reference)
        assert torch.allclose(result, reference, rtol=1e-5, atol=1e-4), name
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(5):
            fn(x.clone())
        ms = 1e3 * (time.perf_counter() - t0) / 5
        say(
            f"{name:<17} sent {sent / MiB:5.2f} MiB  "
            f"received {received / MiB:5.2f} MiB  {ms:7.1f} ms"
        )
    finish()
