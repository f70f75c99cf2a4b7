"""The resumable sampler: same shards as DistributedSampler, and resumable at any world size."""

import torch
from torch.utils.data import DistributedSampler

from sampler import ResumableDistributedSampler


class Range(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def test_from_the_start_it_shards_exactly_like_distributed_sampler():
    ds = Range(103)
    for world in (1, 2, 3, 4):
        for rank in range(world):
            ours = ResumableDistributedSampler(ds, world, rank, seed=5)
            theirs = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=5, drop_last=True)
            ours.set_epoch(2)
            theirs.set_epoch(2)
            assert list(ours) == list(theirs)


def test_shards_are_disjoint_and_epochs_reshuffle():
    ds = Range(100)
    shards = [list(ResumableDistributedSampler(ds, 4, r, seed=0)) for r in range(4)]
    assert len(set().union(*shards)) == 100 and all(len(s) == 25 for s in shards)
    s = ResumableDistributedSampler(ds, 1, 0, seed=0)
    s.set_epoch(1)
    assert list(s) != shards[0] and sorted(s) == list(range(100))


def _consume(ds, world, batch, steps, start=0, epoch=0):
    """What `steps` global batches take, rank by rank, starting `start` samples into the epoch."""
    seen = []
    for rank in range(world):
        s = ResumableDistributedSampler(ds, world, rank, seed=3)
        s.set_epoch(epoch)
        s.set_start(start)
        seen += s.local_indices()[: steps * batch].tolist()
    return seen


def test_resuming_at_a_different_world_size_sees_the_rest_of_the_epoch_once():
    ds = Range(240)
    before = _consume(ds, world=4, batch=3, steps=7)  # 84 samples at world size 4
    after = _consume(ds, world=2, batch=3, steps=26, start=84)  # the remaining 156 at world size 2
    assert len(before) == 84 and len(after) == 156
    assert sorted(before + after) == list(range(240))
