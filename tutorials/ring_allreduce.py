"""Ring all-reduce built from send/recv, checked against dist.all_reduce.

    torchrun --standalone --nproc_per_node=4 tutorials/ring_allreduce.py

The tensor is cut into N chunks (N = world size). Phase 1, scatter-reduce: in each
of N-1 steps every rank sends one chunk to its right neighbour and adds the chunk
arriving from its left; afterwards each rank owns one fully summed chunk. Phase 2,
all-gather: in N-1 more steps the finished chunks travel round the ring. Each rank
sends 2(N-1) chunks of size/N: 2(N-1)/N times the tensor, nearly constant as N
grows, which is why NCCL and gloo use rings (or trees) for all_reduce.
The grown-up use is mingpt_ddp/parallel/ddp.py (apply_ddp): DDP hands each gradient bucket
to the backend's all_reduce, a ring like this one (or a tree).
"""

import time

import torch
import torch.distributed as dist
from common import finish, init, say, title


def ring_all_reduce(t: torch.Tensor) -> int:
    """Sum t over all ranks, in place, with a ring of send/recv. Returns the bytes this rank
    sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(t.view(-1).tensor_split(world))  # views: writing a chunk writes t
    sent = 0

    def exchange(send_idx: int, recv_idx: int) -> torch.Tensor:
        nonlocal sent
        incoming = torch.empty_like(chunks[recv_idx])
        reqs = [dist.isend(chunks[send_idx].clone(), right), dist.irecv(incoming, left)]
        for r in reqs:
            r.wait()
        sent += chunks[send_idx].numel() * chunks[send_idx].element_size()
        return incoming

    for step in range(world - 1):  # scatter-reduce: chunk (rank - step) moves right, gathering sums
        send_idx, recv_idx = (rank - step) % world, (rank - step - 1) % world
        chunks[recv_idx] += exchange(send_idx, recv_idx)
    for step in range(world - 1):  # all-gather: the finished chunk (rank + 1 - step) moves right
        send_idx, recv_idx = (rank + 1 - step) % world, (rank - step) % world
        chunks[recv_idx].copy_(exchange(send_idx, recv_idx))
    return sent


if __name__ == "__main__":
    rank, world = init()
    ok = True
    title(f"ring all-reduce on {world} ranks vs dist.all_reduce")
    for dtype in (torch.int64, torch.float32):
        g = torch.Generator().manual_seed(rank)
        # 1003: chunks of unequal size
        x = torch.randint(-1000, 1000, (1003,), generator=g).to(dtype)
        if dtype.is_floating_point:
            x = x / 7.0
        ours, reference = x.clone(), x.clone()
        sent = ring_all_reduce(ours)
        dist.all_reduce(reference)
        same = (
            torch.equal(ours, reference)
            if not dtype.is_floating_point
            else torch.allclose(ours, reference, rtol=1e-5, atol=1e-4)
        )
        ok &= same
        formula = 2 * (world - 1) / world * x.numel() * x.element_size()
        verdict = (
            "exactly"
            if not dtype.is_floating_point and same
            else "within float tolerance"
            if same
            else "NO"
        )
        say(
            f"{str(dtype):<13} matches dist.all_reduce: {verdict}"
            f" | sent {sent} bytes, 2(N-1)/N x size = {formula:.0f}"
        )

    title("time for a 4 MiB float32 tensor (2^20 float32, mean of 5)")
    big = torch.randn(1 << 20)
    for name, fn in (
        ("ring from send/recv", ring_all_reduce),
        ("dist.all_reduce", dist.all_reduce),
    ):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(5):
            fn(big.clone())
        say(f"{name:<20} {1e3 * (time.perf_counter() - t0) / 5:.1f} ms")
    finish(0 if ok else 1)
