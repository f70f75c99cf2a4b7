"""Exercise 7: ring attention's forward, the sequence split over the ranks. (README section 9;
hint: hints/ring_attention.md)

    python tutorials/exercises/grade.py ring_attention

Graded on 2 gloo ranks: each rank's output rows must equal full causal attention's; the bytes:
N - 1 hops of this rank's keys and values (send/recv only).
"""

import torch
import torch.distributed as dist  # noqa: F401 - what you will need


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention for this rank's chunk of the sequence. q, k, v: (B, T / N, hs), positions
    r T / N .. (r + 1) T / N - 1 on rank r (contiguous chunks). Returns (B, T / N, hs): these rows
    of softmax(q k^T / sqrt(hs), causal) v over the whole sequence.

    Keep a running row maximum m, sum of exponentials and output o. N times: score your q
    against the keys you hold (masked where they come after your rows), rescale o and the sum
    to the new maximum, add this block's share; then pass keys and values to the right
    neighbour and take the left one's. The answer is o / sum.
    """
    raise NotImplementedError("write ring_attention: blocks of scores merged by a running max")
