"""Note 004's pitfall, measured: `torch.distributed.barrier()` in every training step.

    torchrun --standalone --nproc_per_node=2 tutorials/barrier_every_step.py [STEPS [REPEATS]]

Note 004's loop calls `torch.distributed.barrier()` after the loss and before `backward()`,
"to wait for all GPUs". DDP's backward already waits: each gradient bucket is all-reduced, and an
all-reduce cannot finish on any rank before every rank has sent its part. So the barrier adds a
round trip per step and changes nothing in the numbers. Here the same small DDP loop runs with
and without it, several times each, in alternating order; rank 0 prints the time per step of
the slower rank and the losses. Then what a barrier is for: one rank waiting for another's side
effect that no collective carries, such as a file.
"""

import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from common import finish, init, say, title
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, REPEATS = [int(a) for a in sys.argv[1:3]] + [200, 5][len(sys.argv[1:3]) :]


def mlp() -> nn.Module:
    """x: (batch, 32) -> (batch, 1); seeded, so every run and every rank starts the same."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))


def train(barrier: bool) -> tuple[float, list[float]]:
    """STEPS steps of the MLP on this rank's fixed batch x: (16, 32), y: (16, 1).
    Returns the slowest rank's seconds for the loop and the loss of every step."""
    model = DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(16, 32, generator=batches), torch.randn(16, 1, generator=batches)
    losses = []
    dist.barrier()  # start the clock together (outside the timed loop)
    start = time.perf_counter()
    for _ in range(STEPS):
        loss = nn.functional.mse_loss(model(x), y)
        if barrier:
            dist.barrier()  # note 004's line: every rank waits here for every other
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients: a synchronisation point already
        opt.step()
        losses.append(loss.item())
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the job is as slow as its slowest rank
    return elapsed.item(), losses


def barriers_alone() -> float:
    """Microseconds per dist.barrier() with nothing else to do (the slowest rank's)."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(STEPS):
        dist.barrier()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item() * 1e6 / STEPS


def measure() -> None:
    title(f"dist.barrier() every step: {REPEATS} runs of {STEPS} steps each way, 2 ranks")
    n = sum(p.numel() for p in mlp().parameters())
    say(f"holds the same MLP (32 -> 64 -> 1, {n} parameters) and a batch (16, 32) of its own")
    train(False)  # warm-up, not timed: first-time allocations, gloo connections
    times, losses = {False: [], True: []}, {False: [], True: []}
    for rep in range(REPEATS):
        for barrier in (False, True) if rep % 2 == 0 else (True, False):  # no order bias
            seconds, run = train(barrier)
            times[barrier].append(seconds * 1000 / STEPS)
            losses[barrier].append(run)
    alone = statistics.median(barriers_alone() for _ in range(REPEATS))
    if dist.get_rank() != 0:
        return
    for barrier, label in ((False, "without barrier"), (True, "with barrier")):
        ms = times[barrier]
        print(
            f"{label + ':':17} {statistics.median(ms):.3f} ms/step (median of {REPEATS} runs; "
            f"min {min(ms):.3f}, max {max(ms):.3f}); final loss {losses[barrier][0][-1]:.6f}"
        )
    extra = statistics.median(times[True]) - statistics.median(times[False])
    print(
        f"with minus without: {extra * 1000:+.0f} us per step "
        f"({extra / statistics.median(times[False]):+.0%} of the step); "
        f"a barrier alone takes {alone:.0f} us"
    )
    same = all(run == losses[False][0] for runs in losses.values() for run in runs)
    print(f"losses of all {STEPS} steps identical in all {2 * REPEATS} runs: {same}")
    print("\n== Lesson: a barrier per step costs time and changes no number: DDP already syncs")


def what_it_is_for() -> None:
    title("what a barrier is for: rank 1 writes a file (after 0.3 s of work), rank 0 reads it")
    where = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)  # one directory, named by rank 0 (one machine here)
    for barrier in (False, True):
        path = os.path.join(where[0], f"result-{barrier}.txt")
        if dist.get_rank() == 1:
            time.sleep(0.3)  # the work that produces the file
            with open(path, "w") as f:
                f.write("written by rank 1")
        if barrier:
            dist.barrier()  # rank 0 passes only once rank 1 has written and arrived
        seen = open(path).read() if os.path.exists(path) else "no file yet"
        say(f"{'with' if barrier else 'without'} a barrier before reading: {seen!r}")
    dist.barrier()  # rank 0 deletes the directory only once rank 1 is done with it
    if dist.get_rank() == 0:
        shutil.rmtree(where[0])
    title("Lesson: a barrier orders what no collective carries: files, checkpoints, downloads")


if __name__ == "__main__":
    init()
    measure()
    what_it_is_for()
    finish()
