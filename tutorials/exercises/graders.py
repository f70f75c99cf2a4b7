"""How each exercise is graded, on every rank: seeded inputs, the reference computed as one
process would (on every rank, so none waits for another), your code run under the probes, and
the checks (checks.py). Each grader takes the module holding your code and returns this rank's
checks; grade.py merges the ranks' (a check holds only if it held on every rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from checks import Check, Traffic, close, sent, state_bytes

from benchmarks.comm_bytes import ring_sent_bytes


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def all_close(name: str, pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> Check:
    """One check over several tensors: the first that differs, named."""
    for what, got, want in pairs:
        check = close(name, got, want)
        if not check.passed:
            return Check(name, False, f"{what}: {check.found}")
    return Check(name, True, f"{len(pairs)} tensors, each to 1e-5")


def only_p2p(traffic: Traffic) -> Check:
    kinds = traffic.kinds() - {"send", "recv"}
    found = f"used {', '.join(sorted(kinds))}" if kinds else "send and recv only"
    return Check("no collective: send and recv only", not kinds, found)


def mlp() -> nn.Module:
    torch.manual_seed(0)  # the same weights in every copy
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8)
    )


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's global batch: 4 rows a rank."""
    gen = seeded(100 + step)
    return torch.randn(4 * world, 16, generator=gen), torch.randn(4 * world, 8, generator=gen)


# ------------------------------------------------------------------ 1. the ring all-reduce
def ring_allreduce(code) -> list[Check]:
    world = dist.get_world_size()
    x = torch.randn(6 * world, generator=seeded(dist.get_rank()))
    want = x.clone()
    dist.all_reduce(want)
    with Traffic() as traffic:
        code.ring_all_reduce(x)
    formula = ring_sent_bytes("all_reduce", x.numel() * 4, world)
    return [
        close("equal to torch's dist.all_reduce", x, want),
        only_p2p(traffic),
        sent("bytes: the ring's", traffic, formula, "2 (N - 1) / N x S"),
    ]


# ------------------------------------------------------------------ 2. DDP's buckets
def ddp_buckets(code) -> list[Check]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(0, world)
    one = mlp()
    F.mse_loss(one(x), y).backward()  # one process, the whole batch
    model = mlp()
    ddp = code.BucketedDDP(model, bucket_cap_bytes=2048)
    mine = slice(4 * rank, 4 * rank + 4)
    with Traffic() as traffic:
        F.mse_loss(model(x[mine]), y[mine]).backward()
        ddp.finish()
    pairs = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), one.parameters())]
    grads = sum(p.numel() * 4 for p in model.parameters())
    reduces = [op for op in traffic.ops if "allreduce" in op]
    calls = sum(traffic.ops[op].calls for op in reduces)
    early = sum("allreduce" in op for op in traffic.in_backward)
    return [
        all_close("every gradient equal to one process's", pairs),
        sent(
            "bytes: one all-reduce of every gradient",
            traffic,
            ring_sent_bytes("all_reduce", grads, world),
            "2 (N - 1) / N x gradients",
        ),  # fmt: skip
        Check(
            "overlap: all-reduces start while backward runs",
            early > 0,
            f"{early} of {calls} all-reduces started before backward ended",
        ),
    ]


# ------------------------------------------------------------------ 3. ZeRO-1
def zero1(code) -> list[Check]:
    rank, world = dist.get_rank(), dist.get_world_size()
    one, model = mlp(), mlp()
    reference = torch.optim.AdamW(one.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer = code.ZeroOneAdamW(list(model.parameters()), lr=1e-2, weight_decay=0.1)
    mine, traffic = slice(4 * rank, 4 * rank + 4), Traffic()
    for step in range(3):
        x, y = batch(step, world)
        F.mse_loss(one(x), y).backward()
        reference.step(), reference.zero_grad()
        F.mse_loss(model(x[mine]), y[mine]).backward()
        for p in model.parameters():  # the gradients averaged first, as the docstring says
            dist.all_reduce(p.grad)
            p.grad /= world
        with traffic:
            optimizer.step()
        model.zero_grad()
    pairs = [(n, p, q) for (n, p), q in zip(model.named_parameters(), one.parameters())]
    held, whole = state_bytes(optimizer), state_bytes(reference)
    together = torch.tensor([held])
    dist.all_reduce(together)
    owned = sum(p.numel() * 4 for i, p in enumerate(model.parameters()) if i % world == rank)
    return [
        all_close("every parameter equal to one process's AdamW after 3 steps", pairs),
        Check(
            "state split: the ranks hold one copy together",
            together.item() == whole and (world == 1 or held < whole),
            f"this rank holds {held:,} bytes of AdamW state, all ranks {together.item():,}; "
            f"one copy is {whole:,}",
        ),
        sent(
            "bytes: each parameter broadcast by its owner",
            traffic,
            3 * owned,
            "3 steps x this rank's parameters",
        ),  # fmt: skip
    ]


# ------------------------------------------------------------------ 4. one FSDP unit
def fsdp_layer(code) -> list[Check]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = seeded(7)
    weight = torch.randn(8 * world, 6, generator=gen)  # (out, in)
    x, y = (
        torch.randn(3 * world, 6, generator=gen),
        torch.randn(3 * world, 8 * world, generator=gen),
    )
    whole = weight.clone().requires_grad_()
    F.mse_loss(F.linear(x, whole), y).backward()  # one process: the mean over every rank's rows
    mine = slice(3 * rank, 3 * rank + 3)
    x_ref = x[mine].clone().requires_grad_()
    F.mse_loss(F.linear(x_ref, weight), y[mine]).backward()  # this rank's input gradient
    layer = code.ShardedLinear(weight.clone())
    held = sum(t.numel() for t in [*layer.parameters(), *layer.buffers()])
    x_mine = x[mine].clone().requires_grad_()
    with Traffic() as traffic:
        out = layer(x_mine)
        F.mse_loss(out, y[mine]).backward()
    shard = next(iter(layer.parameters()), None)
    formula = ring_sent_bytes("all_gather", weight.numel() * 4 / world, world)
    formula += ring_sent_bytes("reduce_scatter", weight.numel() * 4, world)
    return [
        close("output equal to x @ W^T", out, x[mine] @ weight.T),
        close("input gradient equal to one process's", x_mine.grad, x_ref.grad),
        close(
            "shard.grad: its rows of the averaged gradient",
            None if shard is None else shard.grad,
            whole.grad.chunk(world)[rank],
        ),  # fmt: skip
        Check(
            "holds 1/N of the weight",
            held == weight.numel() // world,
            f"holds {held} numbers of the weight's {weight.numel()}",
        ),  # fmt: skip
        sent(
            "bytes: an all-gather forward, a reduce-scatter backward",
            traffic,
            formula,
            "(N - 1) x shard + (N - 1) / N x weight",
        ),  # fmt: skip
    ]
