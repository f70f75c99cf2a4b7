"""The smallest change that makes a training script distributed. Lines marked `# DDP` are the
change.

    python tutorials/single_to_ddp.py                                   # one process
    torchrun --standalone --nproc_per_node=2 tutorials/single_to_ddp.py # two: same script

Both runs fit y = 3x + 1 with the same global batch (32 samples a step) and land on it.
They are not the same run, though: the single process shuffles with the DataLoader's
random generator, the two ranks with DistributedSampler's seeded permutation, so the
batches differ and the final weights agree only approximately.

What every rank holds after the first step, printed by rank 0 in rank order:
- the samples (dataset indices) it trained on: under DDP each rank gets its own 32/N of the
  global batch, disjoint from the others' (DistributedSampler gives rank r every N-th index
  of one shuffled permutation, the same permutation on every rank);
- its local loss: different on every rank, since the samples differ;
- its gradient after backward(): identical on every rank, because DDP's backward replaced
  each rank's local gradient with the average over ranks (an all_reduce);
- its weights after opt.step(): identical too, since the same optimizer applied the same
  gradient to the same starting weights (DDP broadcast rank 0's when it wrapped the model).
Then each rank's fitted line after 20 epochs: the same on every rank, so any one can save it.
The grown-up version is mingpt_ddp/parallel/ddp.py (apply_ddp): the same DDP wrapper, over
the mesh's data-parallel ranks.
"""

import os
import sys

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


def report(line: str) -> None:
    """Every rank's line, printed by rank 0 in rank order (as tutorials/common.py's say())."""
    lines = [f"[rank {rank}] {line}"]
    if distributed:  # DDP: ranks printing for themselves would interleave at random
        lines = [None] * world
        dist.all_gather_object(lines, f"[rank {rank}] {line}")  # a collective: all ranks call it
    if rank == 0:
        print("\n".join(lines), flush=True)


torch.manual_seed(0)  # the same data and the same initial weights on every rank
x = torch.linspace(-1, 1, 256).unsqueeze(1)
# The index column is only there so that each rank can say which samples it trained on.
data = TensorDataset(torch.arange(len(x)), x, 3 * x + 1)
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
net = model.module if distributed else model  # DDP: the wrapped Linear holds the weights

if rank == 0:
    print(f"world size {world}: each step, every rank trains on {32 // world} of 32 samples")
for epoch in range(20):
    if sampler is not None:
        sampler.set_epoch(epoch)  # DDP: reshuffle each epoch
    for step, (idx, xb, yb) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()  # under DDP, this also averages the gradients over ranks
        opt.step()
        if epoch == 0 and step == 0:  # what every rank holds after its first step
            report(f"step 1 trained on samples {sorted(idx.tolist())}")
            report(f"step 1 local loss {loss.item():.6f}")
            # repr(): every digit of the float, so equal text means bit-for-bit equal values
            grads = f"weight {net.weight.grad.item()!r}, bias {net.bias.grad.item()!r}"
            report(f"step 1 gradient after backward: {grads}")
            report(
                f"step 1 after opt.step(): weight {net.weight.item()!r}, bias {net.bias.item()!r}"
            )

w, b = net.weight.item(), net.bias.item()
report(f"world size {world}: y = {w:.3f} x + {b:.3f} (target 3x + 1), last loss {loss.item():.5f}")
if distributed:
    # leave together: a rank tearing down while a peer still talks to it can abort gloo
    dist.barrier()
    dist.destroy_process_group()  # DDP: leave the group
    # Not part of the change: after that clean teardown, gloo's exit-time C++ destructors still
    # aborted 8 runs in 55 of this script here ("terminate called without an active exception",
    # no Python frame), failing a finished run. Skip them, as main.py does (exit_process in
    # mingpt_ddp/runtime/distributed.py).
    sys.stdout.flush()
    os._exit(0)
