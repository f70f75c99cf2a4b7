"""How the model-parallel exercises are graded (5-7: a pipeline schedule, tensor parallelism,
ring attention); graders.py holds 1-4 and what they share."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from checks import Check, Traffic, close, sent
from graders import all_close, only_p2p, seeded

from benchmarks.comm_bytes import ring_sent_bytes

MICROBATCHES = 4


# ------------------------------------------------------------------ 5. 1F1B
def stuck(orders: list[list]) -> str:
    """Run every stage's order on paper: "" if all finish, else where each one waits forever.
    Forward i of stage s needs forward i of stage s - 1, backward i needs backward i of s + 1."""
    done, at, last = set(), [0] * len(orders), len(orders) - 1
    moved = True
    while moved:
        moved = False
        for s, order in enumerate(orders):
            while at[s] < len(order):
                kind, i = order[at[s]]
                need = (s - 1, "F", i) if kind == "F" and s > 0 else None
                need = (s + 1, "B", i) if kind == "B" and s < last else need
                if need is not None and need not in done:
                    break
                done.add((s, kind, i))
                at[s], moved = at[s] + 1, True
    waits = [f"stage {s} at {order[at[s]]}" for s, order in enumerate(orders) if at[s] < len(order)]
    return "; ".join(waits)


def well_formed(order: list, m: int) -> str:
    """ "" if order runs forward then backward of each microbatch once, else what is wrong."""
    wanted = [(k, i) for i in range(m) for k in ("F", "B")]
    if sorted(map(tuple, order)) != sorted(wanted):
        return f"expected each of ('F', i) and ('B', i) once for i < {m}, got {order}"
    bad = [i for i in range(m) if order.index(("B", i)) < order.index(("F", i))]
    return f"backward before forward for microbatch {bad[0]}" if bad else ""


def stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(dist.get_world_size())]


def run_stage(order: list, part: nn.Module, xs: list, ys: list) -> int:
    """This rank's stage through `order`, activations and their gradients sent to the
    neighbours; returns the most microbatches it held at once (forward done, backward not)."""
    s, last = dist.get_rank(), dist.get_world_size() - 1
    saved, sends, held, most = {}, [], 0, 0
    for kind, i in order:
        if kind == "F":
            h = xs[i] if s == 0 else torch.empty(xs[i].shape)
            if s > 0:
                dist.recv(h, s - 1)
                h.requires_grad_()
            out = part(h)
            if s == last:
                out = F.mse_loss(out, ys[i]) / len(xs)
            else:
                sends.append(dist.isend(out.detach().contiguous(), s + 1))
            saved[i] = (h, out)
            held, most = held + 1, max(most, held + 1)
        else:
            h, out = saved.pop(i)
            grad = None if s == last else torch.empty(out.shape)
            if grad is not None:
                dist.recv(grad, s + 1)
            out.backward(grad)
            if s > 0:
                sends.append(dist.isend(h.grad.contiguous(), s - 1))
            held -= 1
    for request in sends:
        request.wait()
    return most


def one_f_one_b(code) -> list[Check]:
    s, world, m = dist.get_rank(), dist.get_world_size(), MICROBATCHES
    orders = [[tuple(op) for op in code.one_f_one_b(r, world, m)] for r in range(world)]
    wrong = well_formed(orders[s], m)
    wait = "" if wrong else stuck(orders)
    checks = [
        Check("each microbatch forward, then backward, once", not wrong, wrong or "yes"),
        Check("no stage waits forever", not wait, f"waits forever: {wait}" if wait else "none"),
    ]
    if wrong or wait:
        return checks
    gen = seeded(3)
    xs = [torch.randn(2, 8, generator=gen) for _ in range(m)]
    ys = [torch.randn(2, 8, generator=gen) for _ in range(m)]
    one = nn.Sequential(*stages())  # one process: every stage, every microbatch
    sum(F.mse_loss(one(x), y) / m for x, y in zip(xs, ys)).backward()
    part = stages()[s]
    most = run_stage(orders[s], part, xs, ys)
    pairs = [(n, p.grad, q.grad) for (n, p), q in zip(part.named_parameters(), one[s].parameters())]
    limit = world - s  # 1F1B: stage s holds at most (stages - s) microbatches
    return checks + [
        all_close("this stage's gradients equal one process's", pairs),
        Check(
            f"holds at most {limit} microbatches (stage {s})",
            most <= limit,
            f"held {most} of {m} at once",
        ),  # fmt: skip
    ]


# ------------------------------------------------------------------ 6. tensor parallelism
def tensor_parallel(code) -> list[Check]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = seeded(5)
    w1, b1 = torch.randn(32, 8, generator=gen) / 3, torch.randn(32, generator=gen)
    w2, b2 = torch.randn(8, 32, generator=gen) / 6, torch.randn(8, generator=gen)
    x, g = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    ref = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    y_ref = F.linear(F.gelu(F.linear(ref[0], ref[1], ref[2])), ref[3], ref[4])
    (y_ref * g).sum().backward()
    rows = slice(32 // world * rank, 32 // world * (rank + 1))  # this rank's hidden units
    mine = [x, w1[rows], b1[rows], w2[:, rows], b2]
    mine = [t.clone().requires_grad_() for t in mine]
    with Traffic() as traffic:
        h = code.column_parallel(mine[0], mine[1], mine[2])
        y = code.row_parallel(F.gelu(h), mine[3], mine[4])
        (y * g).sum().backward()
    formula = 2 * ring_sent_bytes("all_reduce", y_ref.numel() * 4, world)
    return [
        close("output equal to one process's", y, y_ref),
        close("input gradient equal to one process's", mine[0].grad, ref[0].grad),
        all_close(
            "weight gradients: this rank's slices of one process's",
            [
                ("column weight", mine[1].grad, ref[1].grad[rows]),
                ("row weight", mine[3].grad, ref[3].grad[:, rows]),
                ("row bias", mine[4].grad, ref[4].grad),
            ],
        ),  # fmt: skip
        sent(
            "bytes: one all-reduce forward, one backward",
            traffic,
            formula,
            "2 x 2 (N - 1) / N x output",
        ),  # fmt: skip
    ]


# ------------------------------------------------------------------ 7. ring attention
def ring_attention(code) -> list[Check]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = seeded(9)
    q, k, v = (torch.randn(2, 4 * world, 8, generator=gen) for _ in range(3))  # (B, T, hs)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rows = slice(4 * rank, 4 * rank + 4)
    with Traffic() as traffic:
        got = code.ring_attention(q[:, rows].clone(), k[:, rows].clone(), v[:, rows].clone())
    formula = (world - 1) * 2 * k[:, rows].numel() * 4
    return [
        close("equal to full causal attention", got, want[:, rows]),
        only_p2p(traffic),
        sent("bytes: keys and values, N - 1 hops", traffic, formula, "(N - 1) x (K + V)"),
    ]
