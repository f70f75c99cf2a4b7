"""Which training windows each rank sees, in which order, and how to resume mid-epoch.

A DistributedSampler gives every rank a different shard of the data: all ranks
draw the same permutation (seeded with seed + epoch, which is why the trainer
calls set_epoch) and rank r keeps positions r, r+W, r+2W, ... of it. The job as
a whole therefore walks through the permutation W*B windows per step.

The position in that walk, counted in *global samples consumed*, is the only
data position a snapshot needs: it means the same thing at any world size, so a
job snapshotted with 4 ranks can resume with 2 and still see each remaining
window of the epoch exactly once.
"""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start mid-epoch, at a position counted in global samples.

    Like its parent (shuffle=True, drop_last=True) it draws one permutation per
    epoch from seed + epoch and gives rank r the positions r, r+W, r+2W, ...;
    set_start(n) skips the first n positions of that permutation, whatever the
    world size was when they were consumed.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.start = 0

    def set_start(self, global_samples_consumed: int) -> None:
        self.start = global_samples_consumed

    def local_indices(self) -> torch.Tensor:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)  # same permutation on every rank
        perm = torch.randperm(len(self.dataset), generator=g)
        per_rank = (len(perm) - self.start) // self.num_replicas  # equal shares, remainder dropped
        return perm[self.start + self.rank : self.start + per_rank * self.num_replicas : self.num_replicas]

    def __iter__(self):
        return iter(self.local_indices().tolist())

    def __len__(self) -> int:
        return (len(self.dataset) - self.start) // self.num_replicas
