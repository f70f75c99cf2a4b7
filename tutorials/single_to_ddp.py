"""The smallest change that makes a training script distributed. Lines marked `# DDP` are the
change.

    python tutorials/single_to_ddp.py                                   # one process
    torchrun --standalone --nproc_per_node=2 tutorials/single_to_ddp.py # two: same script

Both runs fit y = 3x + 1 with the same global batch (32 samples a step) and land on it.
They are not the same run, though: the single process shuffles with the DataLoader's
random generator, the two ranks with DistributedSampler's seeded permutation, so the
batches differ and the final weights agree only approximately.
"""

import os

import torch
import torch.distributed as dist  # DDP
from torch.nn.parallel import DistributedDataParallel as DDP  # DDP
from torch.utils.data import (
    DataLoader,
    DistributedSampler,  # DDP: DistributedSampler
    TensorDataset,
)

distributed = "WORLD_SIZE" in os.environ  # DDP: set by torchrun
if distributed:
    dist.init_process_group("gloo")  # DDP: join the group
rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

torch.manual_seed(0)  # the same data and the same initial weights on every rank
x = torch.linspace(-1, 1, 256).unsqueeze(1)
data = TensorDataset(x, 3 * x + 1)
model = torch.nn.Linear(1, 1)
if distributed:
    model = DDP(model)  # DDP: gradients all-reduced
sampler = (  # DDP: a shard per rank
    DistributedSampler(data, shuffle=True, seed=0) if distributed else None
)
loader = DataLoader(  # same global batch
    data, batch_size=32 // world, sampler=sampler, shuffle=sampler is None
)
opt = torch.optim.SGD(model.parameters(), lr=0.5)

for epoch in range(20):
    if sampler is not None:
        sampler.set_epoch(epoch)  # DDP: reshuffle each epoch
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()  # under DDP, this also averages the gradients over ranks
        opt.step()

if rank == 0:  # DDP: print once
    w, b = (
        (model.module if distributed else model).weight.item(),
        (model.module if distributed else model).bias.item(),
    )
    print(
        f"world size {world}: y = {w:.3f} x + {b:.3f} (target 3x + 1), last loss {loss.item():.5f}"
    )
if distributed:
    # leave together: a rank tearing down while a peer still talks to it can abort gloo
    dist.barrier()
    dist.destroy_process_group()  # DDP: leave the group
