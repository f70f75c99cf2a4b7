"""The collectives, one at a time: what every rank holds before and after.

    torchrun --standalone --nproc_per_node=4 tutorials/collectives.py

A collective is an operation every rank of the group calls together, each passing in
its own tensor; the result depends on all of them. send / recv are not collectives:
only the two ranks involved call them. Read in three parts, from the simplest traffic
pattern to the densest:

1. point to point: send / recv, one rank to one other (the ring of ring_allreduce.py);
2. one to all, all to one: broadcast and scatter start at one rank (src) and end on
   every rank; reduce and gather end at one rank (dst), the only one with a result;
3. all to all: all_reduce, all_gather, reduce_scatter and all_to_all, where every
   rank both contributes and receives; then barrier, which only synchronises.

DDP uses broadcast (every replica starts from rank 0's weights) and all_reduce
(gradients); FSDP uses all_gather (parameters) and reduce_scatter (gradients).
Every call here runs on gloo, CPU tensors, as written (torch 2.13): gloo implements
reduce, gather, scatter and all_to_all too (ProcessGroupGloo.hpp declares them; the
Backend base class would raise "does not support alltoall").
"""

import time

import torch
import torch.distributed as dist
from common import finish, init, say, title

rank, world = init()


def part(text: str) -> None:
    if rank == 0:
        print(f"\n######## {text}", flush=True)


part("1. point to point")
title(
    "send / recv: each rank passes its number to the next rank in a ring\n"
    "   in training: pipeline parallelism hands activations to the next stage this way"
)
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

part("2. one to all (broadcast, scatter), all to one (reduce, gather)")
title(
    "broadcast (src=0): rank 0's tensor is copied to everyone\n"
    "   in training: how DDP gives all replicas rank 0's weights when it wraps the model"
)
t = torch.tensor([rank * 10.0, rank * 10.0 + 1])
before = t.tolist()
dist.broadcast(t, src=0)
say(f"before {before} -> after {t.tolist()}")

title(
    "scatter (src=0): rank 0 hands slice r to rank r\n"
    "   in training: one rank read a batch or a checkpoint, and each rank needs only its piece"
)
# Only src holds the list; every other rank passes None and just receives.
pieces = list(torch.arange(world * 2, dtype=torch.float32).view(world, 2)) if rank == 0 else None
out = torch.zeros(2)
dist.scatter(out, pieces, src=0)
held = [p.tolist() for p in pieces] if pieces is not None else "nothing"
say(f"before {held} -> after {out.tolist()}")

title(
    "reduce (SUM, dst=0): only rank 0 gets the element-wise sum\n"
    "   in training: per-rank metrics (loss, token counts) summed on the rank that logs them"
)
t = torch.tensor([float(rank), 1.0])
before = t.tolist()
dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
# Only dst's tensor is defined afterwards. gloo (torch 2.13) used the others' tensors as
# scratch: each ends up with the sum over itself and the ranks above it, so never read them.
note = "the sum" if rank == 0 else "scratch, not the result"
say(f"before {before} -> after {t.tolist()}   ({note})")

title(
    "gather (dst=0): rank 0 gets everyone's tensor, in rank order\n"
    "   in training: evaluation outputs collected, or shards joined into one snapshot rank 0 writes"
)
t = torch.tensor([float(rank), rank * 10.0])
# Only dst passes a list to fill; the others pass None (they receive nothing).
out = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
dist.gather(t, out, dst=0)
held = [o.tolist() for o in out] if out is not None else "nothing"
say(f"contributed {t.tolist()} -> holds {held}")

part("3. all to all: every rank contributes and every rank receives")
title(
    "all_reduce (SUM): everyone gets the element-wise sum\n"
    "   in training: how DDP averages gradients (sum, divided by the world size)"
)
t = torch.tensor([float(rank), 1.0])
before = t.tolist()
dist.all_reduce(t, op=dist.ReduceOp.SUM)
say(
    f"before {before} -> after {t.tolist()}   (sum of ranks = {sum(range(world))}, count = {world})"
)

title(
    "all_gather: everyone gets everyone's tensor, in rank order\n"
    "   in training: how FSDP rebuilds a layer's full weights from the shards"
)
t = torch.tensor([float(rank)] * 2)
out = [torch.zeros(2) for _ in range(world)]
dist.all_gather(out, t)
say(f"contributed {t.tolist()} -> holds {[o.tolist() for o in out]}")

title(
    "reduce_scatter (SUM): sum, then each rank keeps only its own slice\n"
    "   in training: how FSDP leaves each rank the summed gradients of its own shard"
)
t = torch.arange(world, dtype=torch.float32) + 100 * rank  # one number per destination rank
out = torch.zeros(1)
dist.reduce_scatter(out, list(t.chunk(world)))
say(f"contributed {t.tolist()} -> keeps slice {rank}: {out.tolist()}")

title(
    "all_to_all: slice j of rank i goes to rank j, as its slice i (a transpose)\n"
    "   in training: how sequence (context) parallelism of the Ulysses kind trades sequence\n"
    "   slices for attention-head slices, and how mixture-of-experts sends tokens to the rank\n"
    "   of their expert and back"
)
t = torch.arange(world, dtype=torch.float32) + 10 * rank  # slice j is for rank j
out = [torch.zeros(1) for _ in range(world)]
dist.all_to_all(out, list(t.chunk(world)))
# all_to_all_single: the same exchange on one flat tensor, no lists (it can also take uneven
# split sizes); checked here to give the same answer.
flat = torch.zeros(world)
dist.all_to_all_single(flat, t)
say(
    f"sent {t.tolist()} -> received {torch.cat(out).tolist()} "
    f"(all_to_all_single agrees: {torch.equal(flat, torch.cat(out))})"
)

title(
    "barrier: nobody leaves until everybody has arrived\n"
    "   in training: main.py's ranks leave together, so none exits while rank 0 still writes\n"
    "   its last snapshot"
)
time.sleep(0.2 * rank)  # ranks finish their (simulated) work at different times...
arrived = time.monotonic()
dist.barrier()  # ...and leave together
say(
    f"arrived after {0.2 * rank:.1f} s of work, "
    f"waited {time.monotonic() - arrived:.2f} s at the barrier"
)

finish()
