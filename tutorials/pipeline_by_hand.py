"""A two-stage pipeline built by hand from send/recv: microbatches, GPipe and 1F1B, the bubble.

    torchrun --standalone --nproc_per_node=2 tutorials/pipeline_by_hand.py

Pipeline parallelism splits the model's *layers*: rank 0 (stage 0) holds blocks 1-2, rank 1
(stage 1) blocks 3-4, the head and the loss. A batch is cut into m microbatches so that both
stages can work at once, each on a different microbatch. Forward, rank 0 sends each
microbatch's activation to rank 1; backward, rank 1 sends back the gradient with respect to
that activation, and rank 0 finishes the backward of its half with it. Each loss is scaled by
1/m, so the gradients summed over microbatches are the whole batch's mean-loss gradients,
checked here against one process computing the whole model on the whole batch.

The bubble. Say every stage spends t_F on a microbatch's forward and t_B on its backward, and
sending costs nothing. In GPipe (all forwards, then all backwards) the last of p stages starts
(p-1) t_F late, and the first stage gets its first gradient (p-1) t_B after the last stage's
backwards begin: the step takes (m + p - 1)(t_F + t_B), of which each stage computes
m (t_F + t_B). The idle share is (p - 1) / (m + p - 1) whatever t_B / t_F is; what the formula
does assume is stages of equal cost, microbatches of equal cost, and free communication and
scheduling; the measured step is longer by what those leave out, and replay() splits the excess
between unequal op times and the rest. 1F1B runs the same bubble but starts backwards early, so
a stage holds at most p microbatches' activations instead of m.
docs/pipeline.md explains the output; torch.distributed.pipelining is the engine for real use.
The grown-up version is mingpt_ddp/parallel/pipeline.py: torch's schedules over the mesh's pp
dimension, each stage through the same ladder as a whole model (parallelize.py).
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import finish, init, say, title
from torch import nn

H = 768  # features between blocks: what crosses from stage 0 to stage 1
MICRO = 32  # rows per microbatch, the same at every m: every microbatch costs the same
BLOCKS = 2  # blocks per stage
CLASSES = 10
MS = (1, 2, 4, 8)
REPEATS = 5  # steps per (schedule, m); the fastest is shown (the least disturbed by others)
WIDTH = 80  # characters for a step's timeline
P = 2  # stages
TOLERANCE = 1e-5


def build_model() -> nn.Sequential:
    """The whole model, from the same seed on every rank: each keeps its half, and the whole one
    gives the one-process reference."""
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))
        for _ in range(P * BLOCKS)
    ]
    return nn.Sequential(*blocks, nn.Linear(H, CLASSES))


def make_batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """m microbatches' worth of data, the same on both ranks (rank 0 reads x, rank 1 y)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m * MICRO, H, generator=g)  # (m*MICRO, H)
    y = torch.randint(0, CLASSES, (m * MICRO,), generator=g)  # (m*MICRO,)
    return x, y


def gpipe(m: int, rank: int) -> list[tuple[str, int]]:
    """All forwards, then all backwards (in order 0..m-1, as ScheduleGPipe does)."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b(m: int, rank: int) -> list[tuple[str, int]]:
    """Stage r runs p-1-r forwards to fill the pipe, then alternates one forward, one backward,
    then drains the backwards left: a microbatch's activations are freed as soon as possible."""
    warmup = min(m, P - 1 - rank)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


class Stage:
    """One rank's half of the pipeline for one step: F(i) and B(i) for microbatch i, talking to
    the other stage by send/recv, noting when it computes and what it holds."""

    def __init__(self, rank: int, module: nn.Module, m: int):
        x, y = make_batch(m)
        self.first, self.module, self.m = rank == 0, module, m
        self.xs, self.ys = x.chunk(m), y.chunk(m)  # m x (MICRO, H), m x (MICRO,)
        self.held = {}  # microbatch -> (input, output): what its backward needs
        self.peak = 0  # most microbatches held at once: activation memory, in microbatches
        self.busy = []  # (kind, i, start, end) of each compute: the rest of the step is idle
        self.sends = []  # (isend work, its tensor): the tensor must live until the send is done
        self.loss = 0.0

    def recv(self, shape: tuple[int, ...], src: int) -> torch.Tensor:
        buf = torch.empty(shape)
        dist.recv(buf, src=src)  # blocks until the other stage's tensor has arrived
        return buf

    def forward(self, i: int) -> None:
        # rank 1 waits for rank 0's activation; requires_grad makes backward compute its gradient
        inp = self.xs[i] if self.first else self.recv((MICRO, H), 0).requires_grad_()
        t0 = time.perf_counter()
        out = self.module(inp)  # (MICRO, H) on rank 0, (MICRO, CLASSES) on rank 1
        if not self.first:
            out = F.cross_entropy(out, self.ys[i]) / self.m  # the mean over the whole batch
        self.busy.append(("F", i, t0, time.perf_counter()))
        self.held[i] = (inp, out)  # the autograd graph keeps every activation of this microbatch
        self.peak = max(self.peak, len(self.held))
        if self.first:  # isend: start the next forward while this activation travels
            self.sends.append((dist.isend(out.detach(), dst=1), out))
        else:
            self.loss += out.item()

    def backward(self, i: int) -> None:
        inp, out = self.held.pop(i)  # popping frees the activations once backward has run
        grad = self.recv((MICRO, H), 1) if self.first else None  # d loss / d activation
        t0 = time.perf_counter()
        out.backward(grad)  # accumulates into .grad: the sum over microbatches
        self.busy.append(("B", i, t0, time.perf_counter()))
        if not self.first:
            self.sends.append((dist.isend(inp.grad, dst=0), inp.grad))

    def finish(self) -> None:
        for work, _ in self.sends:
            work.wait()


def handoff_ms(rank: int, rounds: int = 50) -> float:
    """One activation's trip from rank to rank, in ms, with nothing else running: half a
    ping-pong round trip, the floor that each hand-off in the pipeline adds."""
    t = torch.zeros(MICRO, H)  # (MICRO, H): the activation that crosses the cut
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            dist.send(t, dst=1)
            dist.recv(t, src=1)
        else:
            dist.recv(t, src=0)
            dist.send(t, dst=0)
    return 1e3 * (time.perf_counter() - t0) / rounds / 2


def pipeline_step(rank: int, module: nn.Module, m: int, schedule) -> dict:
    """One training step (no optimizer) of the pipeline; returns what rank 0 reports."""
    module.zero_grad(set_to_none=True)
    stage = Stage(rank, module, m)
    dist.barrier()  # both stages start together, so the timeline shows the schedule only
    start = time.perf_counter()
    for kind, i in schedule(m, rank):
        stage.forward(i) if kind == "F" else stage.backward(i)
    stage.finish()
    # perf_counter is CLOCK_MONOTONIC on Linux, one clock for every process of a machine: the
    # two ranks' times can be drawn on one axis (across machines they could not)
    return dict(
        busy=stage.busy,
        span=(start, time.perf_counter()),
        peak=stage.peak,
        loss=stage.loss,
        grads=[p.grad.clone() for p in module.parameters()],
    )


def reference(model: nn.Sequential, module: nn.Module, m: int) -> tuple[float, list]:
    """One process, the whole model, the whole batch: the loss and this rank's half's grads."""
    model.zero_grad(set_to_none=True)
    x, y = make_batch(m)
    loss = F.cross_entropy(model(x), y)  # (m*MICRO, CLASSES) logits -> mean loss
    loss.backward()
    return loss.item(), [p.grad.clone() for p in module.parameters()]


def timeline(busy: list, start: float, span: float) -> str:
    """'F1==F2==....B1=====' : one character per span/WIDTH seconds, '.' where it computes
    nothing (waiting, sending, Python)."""
    cells = ["."] * WIDTH
    for kind, i, t0, t1 in busy:
        a = min(WIDTH - 1, int((t0 - start) / span * WIDTH))
        b = max(a + 1, int((t1 - start) / span * WIDTH))
        label = f"{kind}{i + 1}"
        for c in range(a, min(b, WIDTH)):
            cells[c] = label[c - a] if c - a < len(label) else "="
    return "|" + "".join(cells) + "|"


def check(name: str, rank: int, m: int, run: dict, ref: tuple[float, list]) -> bool:
    """Say how far the pipeline's step is from one process's, and how many microbatches'
    activations this stage held at once; True if both are as they should be."""
    ref_loss, ref_grads = ref
    grad_diff = max((g - r).abs().max().item() for g, r in zip(run["grads"], ref_grads))
    ok, line = grad_diff <= TOLERANCE, f"{name} m={m}: |diff| grads {grad_diff:.1e}"
    if rank == 1:  # the loss lives on the last stage
        loss_diff = abs(run["loss"] - ref_loss)
        ok &= loss_diff <= TOLERANCE
        line += f", loss {loss_diff:.1e}"
    expected = m if name == "GPipe" else min(m, P - rank)
    ok &= run["peak"] == expected
    say(f"{line} | held at peak: {run['peak']} of {m} microbatches")
    return ok


def mean_time(busy: list, kind: str) -> float:
    times = [t1 - t0 for k, _, t0, t1 in busy if k == kind]
    return sum(times) / len(times)


def step_span(ranks: list[dict]) -> tuple[float, float]:
    """(start, length) of a step: from the first rank's start to the last rank's end."""
    start = min(r["span"][0] for r in ranks)
    return start, max(r["span"][1] for r in ranks) - start


def replay(step: list[dict], m: int, schedule) -> float:
    """How long the step would have taken if sends and Python cost nothing: each op, with the
    time it really took, starts once its rank is free and the op it waits for is done (F on
    rank 1 waits for F on rank 0, B on rank 0 for B on rank 1)."""
    took = [{(k, i): t1 - t0 for k, i, t0, t1 in r["busy"]} for r in step]
    orders = [schedule(m, rank) for rank in range(P)]
    ends, clock, pos = [{}, {}], [0.0] * P, [0] * P
    while pos != [len(order) for order in orders]:
        for rank, order in enumerate(orders):
            while pos[rank] < len(order):
                op = order[pos[rank]]
                needs = (rank == 1 and op[0] == "F") or (rank == 0 and op[0] == "B")
                if needs and op not in ends[1 - rank]:
                    break  # the other rank has not got there yet
                ready = ends[1 - rank][op] if needs else 0.0
                clock[rank] = ends[rank][op] = max(clock[rank], ready) + took[rank][op]
                pos[rank] += 1
    return max(clock)


def report_bubble(m: int, runs: list[list[dict]], schedule) -> None:
    """Rank 0 draws the fastest step of the repeats and sets its idle shares beside the formula,
    then splits the step's length into the formula's, unequal op times', and the rest's.
    runs[k][r]: repeat k as rank r saw it."""
    step = min(runs, key=lambda ranks: step_span(ranks)[1])
    start, span = step_span(step)
    idle = [1 - sum(t1 - t0 for _, _, t0, t1 in r["busy"]) / span for r in step]
    t_fs, t_bs = ([mean_time(r["busy"], kind) for r in step] for kind in "FB")  # per rank
    formula = (m + P - 1) * (sum(t_fs) + sum(t_bs)) / P  # stages of equal cost: the mean
    replayed = replay(step, m, schedule)
    print(
        f"m={m}: formula (p-1)/(m+p-1) = {P - 1}/{m + P - 1} = {(P - 1) / (m + P - 1):.3f};"
        f" measured idle: rank 0 {idle[0]:.3f}, rank 1 {idle[1]:.3f}"
    )
    for rank, r in enumerate(step):
        print(f"  rank {rank} {timeline(r['busy'], start, span)}")
    print(
        f"  step {1e3 * span:.1f} ms = {1e3 * formula:.1f} (m+p-1)(t_F+t_B)"
        f" {1e3 * (replayed - formula):+.1f} unequal op times"
        f" {1e3 * (span - replayed):+.1f} send/recv, Python, OS"
    )
    print(
        f"  t_F {1e3 * t_fs[0]:.1f}/{1e3 * t_fs[1]:.1f} ms,"
        f" t_B {1e3 * t_bs[0]:.1f}/{1e3 * t_bs[1]:.1f} ms on rank 0/1"
    )


def run_schedule(name: str, schedule, rank: int, module, refs: dict) -> bool:
    title(
        f"{name} vs one process on the whole batch: max |diff| of grads and loss (fp32),\n"
        "   and the activations each stage held at its peak, in microbatches"
    )
    ok, timings = True, {}
    for m in MS:
        runs = [pipeline_step(rank, module, m, schedule) for _ in range(REPEATS)]
        ok &= check(name, rank, m, runs[-1], refs[m])
        for run in runs:  # only the times travel to rank 0, not the gradients
            del run["grads"]
        gathered = [None] * P
        dist.all_gather_object(gathered, runs)
        timings[m] = [list(ranks) for ranks in zip(*gathered)]
    title(f"{name}: the bubble, measured (idle share of each stage) vs the formula, p = {P}")
    if rank == 0:
        for m in MS:
            report_bubble(m, timings[m], schedule)
    return ok


if __name__ == "__main__":
    rank, world = init()
    assert world == P, f"run with --nproc_per_node={P}"
    # one core per stage, as one GPU per stage: both stages must be able to compute at once
    torch.set_num_threads(1)
    model = build_model()
    module = model[:BLOCKS] if rank == 0 else model[BLOCKS:]  # this rank's half
    title(
        f"a pipeline of {P} stages: rank 0 holds blocks 1-{BLOCKS}, rank 1 blocks "
        f"{BLOCKS + 1}-{P * BLOCKS} + head + loss\n"
        f"   a block: Linear({H}, {2 * H}) GELU Linear({2 * H}, {H}); a microbatch: {MICRO} rows;"
        " 1 thread per rank"
    )
    refs = {m: reference(model, module, m) for m in MS}
    pipeline_step(rank, module, 2, gpipe)  # warm-up: gloo connects the pair on first use
    handoff = handoff_ms(rank)  # both ranks measure it; rank 0 prints
    if rank == 0:
        kib = MICRO * H * 4 // 1024
        print(
            f"   one hand-off of a ({MICRO}, {H}) activation ({kib} KiB), ranks otherwise idle:"
            f" {handoff:.2f} ms",
            flush=True,
        )
    ok = run_schedule("GPipe", gpipe, rank, module, refs)
    ok &= run_schedule("1F1B", one_f_one_b, rank, module, refs)
    say(f"all checks passed: {ok}")
    finish(0 if ok else 1)
