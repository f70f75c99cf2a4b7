"""Which training windows each rank sees, in which order, and how to resume mid-epoch.

An epoch visits every training window once, in a shuffled order. The order is a
*permutation* of the window indices 0..N-1, and every rank computes the same one
from the seed and the epoch number. Rank r then takes positions r, r+W, r+2W, ...
of it (W = world size): the ranks' shares are disjoint and together cover the
epoch. That is exactly what torch's DistributedSampler does (with drop_last);
the job as a whole walks through the permutation W*B windows per step.

DistributedSampler materialises the permutation with torch.randperm(N): 8 bytes
per window, every epoch, in every rank (1.6 GB and ~9 s per epoch for a 200 MB
corpus). Here the permutation is a *function* instead: a seeded bijection on
[0, N) (a Feistel network, see FeistelPermutation) evaluated only at the B
positions a step needs. Memory is O(1) in N and the first step costs what any
other step costs.

The position in that walk, counted in *global samples consumed*, is the only data
position a snapshot needs (DataCursor.state_dict): it means the same thing at any
world size, so a job snapshotted with 4 ranks can resume with 2 and still see
each remaining window of the epoch exactly once.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

_MASK32 = 0xFFFF_FFFF


class FeistelPermutation:
    """A seeded bijection on the integers [0, n), evaluated elementwise on int64 tensors.

    A Feistel network splits an index into a high part L and a low part R and
    applies rounds of  (L, R) -> (R, L xor F(R, key_i)).  Each round is
    invertible whatever F is (xor with F(R) undoes itself once R is known), so the
    network permutes [0, 2^bits), where bits is the width of n-1; F is a
    multiply-xorshift hash, so the output order looks random. (The halves may
    differ by one bit; they swap places every round, so an even number of rounds
    brings them back to their widths.) To permute [0, n) rather than [0, 2^bits),
    an output at or above n goes through the network again ("cycle walking")
    until it falls below n: a permutation's cycle that leaves [0, n) always comes
    back, so this is still a bijection, and as 2^bits < 2n (for n > 2; bits is at
    least 2) a value needs fewer than 2 passes on average.
    """

    ROUNDS = 4  # even: the halves end at their starting widths

    def __init__(self, n: int, seed: int, epoch: int = 0):
        if n <= 0:
            raise ValueError(f"a permutation needs n > 0, got {n}")
        bits = max(2, (n - 1).bit_length())
        if bits > 62:  # keeps every intermediate below 2^63: exact int64 arithmetic
            raise ValueError(f"n = {n} is above the 2^62 this permutation supports")
        self.n, self.seed, self.epoch = n, seed, epoch
        self.low_bits, self.high_bits = bits // 2, bits - bits // 2
        # Round keys: a hash of (seed, epoch), so the order depends on nothing else
        # (not torch's RNG, the machine, the world size or the rank).
        digest = hashlib.blake2b(
            f"mingpt-ddp/{seed}/{epoch}".encode(), digest_size=4 * self.ROUNDS
        ).digest()
        self.keys = [
            int.from_bytes(digest[4 * i : 4 * i + 4], "little") for i in range(self.ROUNDS)
        ]

    # _mix and _network take a Python int or an int64 tensor: the same operators work on both.
    @staticmethod
    def _mix(x, key: int):
        """A 32-bit hash of x (< 2^31) and key; products stay below 2^62, so nothing overflows."""
        x = (x ^ key) * 0x2C1B3C6D & _MASK32
        x ^= x >> 15
        x = x * 0x297A2D39 & _MASK32
        return x ^ (x >> 16)

    def _network(self, x):
        left_bits, right_bits = self.high_bits, self.low_bits
        left, right = x >> right_bits, x & ((1 << right_bits) - 1)
        for key in self.keys:
            # (L, R) -> (R, L xor F(R)); F(R) is cut to L's width, and the halves swap widths.
            left, right = right, left ^ (self._mix(right, key) & ((1 << left_bits) - 1))
            left_bits, right_bits = right_bits, left_bits
        return (left << right_bits) | right

    def at(self, position: int) -> int:
        """The permuted value of one position in [0, n): the per-step path (a few positions,
        where Python ints beat launching ~40 tiny tensor ops)."""
        out = self._network(position)
        while out >= self.n:  # cycle walking
            out = self._network(out)
        return out

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """The permuted value of each position in [0, n), vectorised (same values as at())."""
        out = self._network(positions.to(torch.int64))
        outside = (out >= self.n).nonzero().squeeze(1)
        while outside.numel():  # cycle walking, for the few values that left [0, n)
            walked = self._network(out[outside])
            out[outside] = walked
            outside = outside[walked >= self.n]
        return out


class DataCursor:
    """Where the job is in the data: the epoch, and the global samples consumed in it.

    next_starts(B) hands this rank its B window starts for the next micro-step and
    moves the cursor on by W*B (every rank takes B, so the job consumed W*B). When
    fewer than W*B windows are left in the epoch, the next epoch begins (the last
    partial global batch is dropped, as DistributedSampler's drop_last does).
    """

    # Saved in snapshots: resuming under another order would repeat or skip windows.
    ORDER = "feistel-v1"

    def __init__(self, num_windows: int, world_size: int, rank: int, seed: int):
        if num_windows <= 0:
            raise ValueError("no windows to sample from")
        self.num_windows, self.world_size, self.rank, self.seed = (
            num_windows,
            world_size,
            rank,
            seed,
        )
        self.epoch, self.samples_consumed = 0, 0
        self._permutation = FeistelPermutation(num_windows, seed, epoch=0)

    def permutation(self, epoch: int) -> FeistelPermutation:
        """The order of one epoch (built once per epoch: four round keys, nothing per window)."""
        if self._permutation.epoch != epoch:
            self._permutation = FeistelPermutation(self.num_windows, self.seed, epoch)
        return self._permutation

    def next_starts(self, batch_size: int) -> torch.Tensor:
        """This rank's window starts for one micro-step: (B,) int64."""
        W = self.world_size
        if W * batch_size > self.num_windows:
            raise ValueError(
                f"one global batch ({W} ranks x {batch_size}) is more than the "
                f"{self.num_windows} windows"
            )
        if self.samples_consumed + W * batch_size > self.num_windows:  # epoch exhausted
            self.epoch, self.samples_consumed = self.epoch + 1, 0
        first = (
            self.samples_consumed + self.rank
        )  # this rank's positions: first, first+W, first+2W, ...
        self.samples_consumed += W * batch_size
        order = self.permutation(self.epoch)
        return torch.tensor(
            [order.at(first + W * k) for k in range(batch_size)], dtype=torch.int64
        )  # (B,)

    def seek(self, micro_steps: int, batch_size: int) -> None:
        """Stand where micro_steps micro-steps of batch_size windows per replica leave the job (a
        torchft group healed to a later step: the steps it missed read none of its windows)."""
        per_epoch = self.num_windows // (self.world_size * batch_size)  # whole micro-steps
        self.epoch, done = divmod(micro_steps, per_epoch)
        self.samples_consumed = done * self.world_size * batch_size

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "samples_consumed": self.samples_consumed, "order": self.ORDER}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; it was counted in global samples, so the world size may
        differ."""
        self.epoch, self.samples_consumed = int(state["epoch"]), int(state["samples_consumed"])
