"""The collectives, one at a time: what every rank holds before and after.

    torchrun --standalone --nproc_per_node=4 tutorials/collectives.py

A collective is an operation every rank of the group calls together; each rank
passes in its own tensor and gets back a result that depends on all of them.
DDP uses all_reduce (gradients); FSDP uses all_gather (parameters) and
reduce_scatter (gradients); broadcast makes every replica start equal.
"""

import time

import torch
import torch.distributed as dist
from common import init, say, title

rank, world = init()

title("send / recv: point to point. Each rank passes its number to the next rank in a ring")
mine, got = torch.tensor([float(rank)]), torch.zeros(1)
# isend/irecv return at once; waiting on both afterwards avoids the deadlock of
# every rank blocking in send() while nobody is receiving yet.
reqs = [dist.isend(mine, (rank + 1) % world), dist.irecv(got, (rank - 1) % world)]
for r in reqs:
    r.wait()
say(
    f"sent {mine.tolist()} to rank {(rank + 1) % world}, "
    f"received {got.tolist()} from rank {(rank - 1) % world}"
)

title(
    "broadcast: rank 0's tensor is copied to everyone (how DDP gives all replicas the same start)"
)
t = torch.tensor([rank * 10.0, rank * 10.0 + 1])
before = t.tolist()
dist.broadcast(t, src=0)
say(f"before {before} -> after {t.tolist()}")

title("all_reduce (SUM): everyone gets the element-wise sum (how DDP averages gradients)")
t = torch.tensor([float(rank), 1.0])
before = t.tolist()
dist.all_reduce(t, op=dist.ReduceOp.SUM)
say(
    f"before {before} -> after {t.tolist()}   (sum of ranks = {sum(range(world))}, count = {world})"
)

title("all_gather: everyone gets everyone's tensor (how FSDP rebuilds a layer's full weights)")
t = torch.tensor([float(rank)] * 2)
out = [torch.zeros(2) for _ in range(world)]
dist.all_gather(out, t)
say(f"contributed {t.tolist()} -> holds {[o.tolist() for o in out]}")

title(
    "reduce_scatter (SUM): sum, then each rank keeps only its own slice (how FSDP shards gradients)"
)
t = torch.arange(world, dtype=torch.float32) + 100 * rank  # one number per destination rank
out = torch.zeros(1)
dist.reduce_scatter(out, list(t.chunk(world)))
say(f"contributed {t.tolist()} -> keeps slice {rank}: {out.tolist()}")

title("barrier: nobody leaves until everybody has arrived")
time.sleep(0.2 * rank)  # ranks finish their (simulated) work at different times...
arrived = time.monotonic()
dist.barrier()  # ...and leave together
say(
    f"arrived after {0.2 * rank:.1f} s of work, "
    f"waited {time.monotonic() - arrived:.2f} s at the barrier"
)

dist.destroy_process_group()
