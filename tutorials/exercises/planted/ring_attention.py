"""Exercise 7, planted wrong: each block's softmax computed on its own and the results averaged,
with no running maximum and sum to weigh them: the rows that see two blocks come out wrong, which
the equality check catches."""

import math

import torch
import torch.distributed as dist


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    n, outs = q.size(1), []
    for step in range(world):
        source = (rank - step) % world
        if source <= rank:
            scores = q @ k.transpose(1, 2) / math.sqrt(q.size(-1))
            if source == rank:
                future = torch.ones(n, n, dtype=torch.bool).triu(1)
                scores = scores.masked_fill(future, -math.inf)
            outs.append(torch.softmax(scores, -1) @ v)  # the bug: each block normalised alone
        if step < world - 1:
            k_in, v_in = torch.empty_like(k), torch.empty_like(v)
            requests = [dist.isend(k.contiguous(), right), dist.isend(v.contiguous(), right)]
            requests += [dist.irecv(k_in, left), dist.irecv(v_in, left)]
            for request in requests:
                request.wait()
            k, v = k_in, v_in
    return torch.stack(outs).mean(0)
