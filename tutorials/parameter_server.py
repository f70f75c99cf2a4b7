"""Everything through rank 0 (a parameter server) next to the ring: why the ring wins as N grows.

    torchrun --standalone --nproc_per_node=4 tutorials/parameter_server.py

Parameter-server style: every rank sends its whole tensor to rank 0, rank 0 adds
them up and sends the sum back to each. Rank 0 moves 2(N-1) full tensors, so its
link is the bottleneck and the time grows with N. In the ring every rank moves
2(N-1)/N of a tensor: the load is spread evenly and stays nearly constant.
"""

import time

import torch
import torch.distributed as dist

from common import init, say, title
from ring_allreduce import ring_all_reduce


def parameter_server_all_reduce(t: torch.Tensor) -> int:
    """Sum t over all ranks through rank 0; returns the bytes this rank sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    size = t.numel() * t.element_size()
    if rank == 0:
        incoming = torch.empty_like(t)
        for src in range(1, world):
            dist.recv(incoming, src)
            t += incoming
        for dst in range(1, world):
            dist.send(t, dst)
        return (world - 1) * size
    dist.send(t, 0)
    dist.recv(t, 0)
    return size


if __name__ == "__main__":
    rank, world = init()
    x = torch.randn(1 << 20) + rank  # 4 MB
    title(f"{world} ranks, a 4 MB float32 tensor: bytes sent and time (mean of 5)")
    for name, fn in (("parameter server", parameter_server_all_reduce), ("ring", ring_all_reduce)):
        result = x.clone()
        sent = fn(result)
        reference = x.clone()
        dist.all_reduce(reference)
        assert torch.allclose(result, reference, rtol=1e-5, atol=1e-4), name
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(5):
            fn(x.clone())
        ms = 1e3 * (time.perf_counter() - t0) / 5
        say(f"{name:<17} sent {sent / 1e6:5.1f} MB  {ms:7.1f} ms")
    dist.destroy_process_group()
