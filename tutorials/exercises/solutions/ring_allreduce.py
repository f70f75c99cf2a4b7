"""Exercise 1, a reference solution: the ring all-reduce from isend / irecv."""

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(tensor.chunk(world))  # views: writing them writes tensor

    def exchange(send: int, recv: int) -> torch.Tensor:
        incoming = torch.empty_like(chunks[recv])
        # Post both before waiting: every rank sends and receives at once, none waits on another.
        requests = [dist.isend(chunks[send].clone(), right), dist.irecv(incoming, left)]
        for request in requests:
            request.wait()
        return incoming

    for step in range(world - 1):  # reduce-scatter: chunk (rank - step) travels right, summed
        send, recv = (rank - step) % world, (rank - step - 1) % world
        chunks[recv] += exchange(send, recv)
    for step in range(world - 1):  # all-gather: rank r now owns chunk (r + 1): pass them round
        send, recv = (rank + 1 - step) % world, (rank - step) % world
        chunks[recv].copy_(exchange(send, recv))
