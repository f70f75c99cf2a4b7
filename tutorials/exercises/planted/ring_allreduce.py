"""Exercise 1, planted wrong: the reduce-scatter sends the chunk it is about to receive (an index
off by one), so the sums collect the wrong pieces. The equality check catches it."""

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(tensor.chunk(world))

    def exchange(send: int, recv: int) -> torch.Tensor:
        incoming = torch.empty_like(chunks[recv])
        requests = [dist.isend(chunks[send].clone(), right), dist.irecv(incoming, left)]
        for request in requests:
            request.wait()
        return incoming

    for step in range(world - 1):
        send = recv = (rank - step - 1) % world  # the bug: should send chunk (rank - step)
        chunks[recv] += exchange(send, recv)
    for step in range(world - 1):
        send, recv = (rank + 1 - step) % world, (rank - step) % world
        chunks[recv].copy_(exchange(send, recv))
