"""Exercise 1: the ring all-reduce, from send and recv. (README section 2; hint:
hints/ring_allreduce.md)

    python tutorials/exercises/grade.py ring_allreduce

Graded on 2 gloo ranks: the result must equal torch's dist.all_reduce, and the bytes each rank
sends must be the ring's 2 (N - 1) / N x the tensor's bytes (no collective allowed: send and
recv only, or isend and irecv).
"""

import torch


def ring_all_reduce(tensor: torch.Tensor) -> None:
    """Sum `tensor` (1-D, its length a multiple of the world size) over every rank, in place.

    Cut it in N chunks. Reduce-scatter: N - 1 times, send one chunk to the right neighbour, receive
    one from the left, add it to your own copy of that chunk; afterwards rank r holds the whole
    sum of one chunk. All-gather: N - 1 more times, pass the finished chunks round the ring.
    """
    raise NotImplementedError("write ring_all_reduce: a reduce-scatter, then an all-gather")
