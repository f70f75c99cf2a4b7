"""Which windows each rank sees, epoch after epoch: DistributedSampler, set_epoch, and two bugs.

    torchrun --standalone --nproc_per_node=2 tutorials/sampler_order.py

DistributedSampler shuffles with a generator seeded by `seed + epoch`, and every rank computes
the same permutation, then keeps every world-size-th index of it, starting at its rank: the
ranks' shares are disjoint and together cover the dataset once per epoch. Two ways to break it:
- never calling `sampler.set_epoch(epoch)` (note 003's loop): the epoch stays 0, so every epoch
  repeats the first one's order;
- giving each rank its own seed (`seed=rank`): the ranks shuffle differently, so their shares
  overlap (some samples trained twice an epoch) and leave gaps (others never).
main.py's DataCursor does what the sampler does, as a function of (seed, epoch, position), so a
snapshot resumes it mid-epoch at any world size (README, section 4).
"""

import torch.distributed as dist
from common import finish, init, say, title
from torch.utils.data import DistributedSampler

rank, world = init()
N = 12  # a dataset of 12 samples (the indices are all this tutorial needs)


def shares(seed: int, epoch: int | None) -> list[list[int]]:
    """Every rank's indices for one epoch (epoch None: set_epoch is never called), gathered so
    rank 0 can compare the ranks' shares."""
    sampler = DistributedSampler(range(N), num_replicas=world, rank=rank, shuffle=True, seed=seed)
    if epoch is not None:
        sampler.set_epoch(epoch)
    mine = list(sampler)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def coverage(everyone: list[list[int]]) -> None:
    """How the ranks' shares of one epoch cover the dataset (printed once, by rank 0)."""
    seen = [i for share in everyone for i in share]
    twice = sorted({i for i in seen if seen.count(i) > 1})
    never = sorted(set(range(N)) - set(seen))
    if rank == 0:
        print(f"all ranks: trained twice {twice or 'none'}, never {never or 'none'}", flush=True)


title("set_epoch(epoch) each epoch: a new order every epoch, every sample once")
for epoch in (0, 1):
    say(f"epoch {epoch}: {shares(seed=0, epoch=epoch)[rank]}")
coverage(shares(seed=0, epoch=1))

title("set_epoch never called (note 003): epoch 1 repeats epoch 0's order exactly")
for epoch in (0, 1):  # the loop counts epochs, but the sampler is never told
    say(f"epoch {epoch}: {shares(seed=0, epoch=None)[rank]}")

title("a seed per rank (seed=rank): the shares overlap and leave gaps")
everyone = shares(seed=rank, epoch=0)
say(f"epoch 0: {everyone[rank]}")
coverage(everyone)

finish()
