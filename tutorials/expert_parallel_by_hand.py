"""Expert parallelism built by hand: route tokens to experts, send them to the ranks that hold
those experts with all_to_all, compute, send the outputs back, and check it all against one
process holding every expert.

    torchrun --standalone --nproc_per_node=2 tutorials/expert_parallel_by_hand.py   # 2-4 ranks

A mixture-of-experts layer replaces one MLP by E smaller ones (experts) and a router: a Linear
that scores every token against every expert; each token goes through its top k. With the
experts split over N ranks (E / N each), a token's experts usually live elsewhere, so a layer
makes four moves:

    counts    all_to_all of how many rows each rank will send to each expert. The rows' own
              all_to_all has uneven splits: a rank must know how many rows will arrive from
              each peer before they arrive. (The bug zoo's missing step: skip it, and the
              receiver guesses the sizes.)
    dispatch  all_to_all of the rows, each to its expert's rank. Rows for a rank's own experts
              never leave it.
    compute   the arrived rows, regrouped by expert, through this rank's experts.
    combine   all_to_all back, the reverse splits: each output returns to its token's rank,
              where the top-k outputs are weighted by the router's scores and summed.

Every rank holds different tokens (a data-parallel rank) and the same router. The check: the
layer's output and every gradient, on every rank, equal one process running all ranks' tokens
through all experts. The grown-up version is mingpt_ddp/parallel/expert.py (ExpertExchange) with
mingpt_ddp/moe.py, where the all-to-alls carry autograd (torch's functional collectives).
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from common import finish, init, say, title

TOKENS, C, H = 12, 8, 16  # tokens per rank, width, an expert's hidden width
EXPERTS, TOP_K = 4, 2
TOLERANCE = 1e-5


def weights() -> tuple[torch.Tensor, ...]:
    """The same router and experts on every rank (one seed), and every rank's tokens."""
    gen = torch.Generator().manual_seed(0)
    router = torch.randn(C, EXPERTS, generator=gen)
    w1 = torch.randn(EXPERTS, C, H, generator=gen) / C**0.5
    w2 = torch.randn(EXPERTS, H, C, generator=gen) / H**0.5
    tokens = torch.randn(dist.get_world_size(), TOKENS, C, generator=gen)  # (ranks, N, C)
    return router, w1, w2, tokens


def route(x: torch.Tensor, router: torch.Tensor):
    """Each token's top-k experts and their weights: (N, k) each; the rows grouped by expert."""
    scores = torch.softmax(x @ router, dim=-1)  # (N, E)
    weight, chosen = scores.topk(TOP_K, dim=-1)  # (N, k)
    order = torch.argsort(chosen.flatten(), stable=True)  # (N k,): by expert, token order kept
    counts = torch.bincount(chosen.flatten(), minlength=EXPERTS)  # (E,)
    return weight, order, counts


def experts(rows: torch.Tensor, counts: list[int], w1, w2) -> torch.Tensor:
    """Each group of rows through its expert: (M, C) -> (M, C)."""
    groups = rows.split(counts)
    return torch.cat([F.gelu(g @ w1[e]) @ w2[e] for e, g in enumerate(groups)])


def combine(out: torch.Tensor, order, weight) -> torch.Tensor:
    """The outputs back in (token, choice) places, weighted and summed per token: (N, C)."""
    placed = torch.zeros_like(out).index_copy(0, order, out)
    return (placed.view(-1, TOP_K, C) * weight.unsqueeze(-1)).sum(1)


def one_process(x, router, w1, w2) -> torch.Tensor:
    """Every expert here: route, compute, combine."""
    weight, order, counts = route(x, router)
    rows = x[order // TOP_K]
    return combine(experts(rows, counts.tolist(), w1, w2), order, weight)


def expert_parallel(x, router, w1, w2, rank: int, world: int) -> tuple[torch.Tensor, list]:
    """This rank's experts only (E / world of them): the four moves of the docstring. Returns
    the output and the rows sent to each rank."""
    here = EXPERTS // world
    mine = slice(rank * here, (rank + 1) * here)
    weight, order, counts = route(x, router)
    # counts: from each rank, how many rows it sends to each of my experts: (world, here)
    theirs = torch.empty_like(counts)
    dist.all_to_all_single(theirs, counts)
    theirs = theirs.view(world, here)
    send = counts.view(world, here).sum(1).tolist()  # rows to each rank
    recv = theirs.sum(1).tolist()  # rows from each rank
    rows = x[order // TOP_K]  # (M, C) by expert: so rank 0's experts' rows come first
    got = funcol.all_to_all_single_autograd(rows, recv, send, dist.group.WORLD)  # dispatch
    # got holds rank 0's rows (by my expert), then rank 1's...: regroup by expert
    expert_of_row = torch.arange(here).repeat(world).repeat_interleave(theirs.flatten())
    by_expert = torch.argsort(expert_of_row, stable=True)
    out = experts(got[by_expert], theirs.sum(0).tolist(), w1[mine], w2[mine])
    back = out[torch.argsort(by_expert)]  # by source rank again
    out = funcol.all_to_all_single_autograd(back, send, recv, dist.group.WORLD)  # combine
    return combine(out, order, weight), send


def main() -> None:
    rank, world = init()
    if EXPERTS % world:
        raise SystemExit(f"{world} ranks cannot share {EXPERTS} experts: use 2 or 4 ranks")
    router, w1, w2, tokens = weights()
    title(f"{EXPERTS} experts, top {TOP_K}, over {world} ranks ({EXPERTS // world} each)")
    # One process: all ranks' tokens through all experts; the loss sums every rank's outputs.
    ref = [t.clone().requires_grad_() for t in (router, w1, w2)]
    full = one_process(tokens.flatten(0, 1), *ref)  # (ranks x N, C)
    full.square().sum().backward()
    # Expert parallel: this rank's tokens, its experts; the same loss, its part of the sum.
    mine = [t.clone().requires_grad_() for t in (router, w1, w2)]
    y, send = expert_parallel(tokens[rank], *mine, rank, world)
    y.square().sum().backward()
    grads = [mine[0].grad.clone()]
    dist.all_reduce(grads[0])  # the router is on every rank: its gradient sums over the ranks
    here = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    diffs = {
        "output": (y - full.view(world, TOKENS, C)[rank]).abs().max().item(),
        "router": (grads[0] - ref[0].grad).abs().max().item(),
        "w1": (mine[1].grad[here] - ref[1].grad[here]).abs().max().item(),
        "w2": (mine[2].grad[here] - ref[2].grad[here]).abs().max().item(),
    }
    passed = all(d <= TOLERANCE for d in diffs.values())
    pairs = " ".join(f"{k} {v:.1e}" for k, v in diffs.items())
    say(f"expert-parallel MoE layer: max |diff| {pairs} -> {'pass' if passed else 'FAIL'}")
    away = sum(send) - send[rank]
    say(f"rows sent to other ranks: {away} of {sum(send)} (the rest stay for my own experts)")
    verdicts = [None] * world
    dist.all_gather_object(verdicts, passed)
    say(f"all checks passed: {all(verdicts)}")
    finish(0 if all(verdicts) else 1)


if __name__ == "__main__":
    main()
