"""Causal ring attention built by hand from send/recv, with the load balancing that pairs an early
chunk of the sequence with a late one; checked against full causal attention.

    torchrun --standalone --nproc_per_node=2 tutorials/ring_attention_by_hand.py

Context parallelism splits the *sequence*: each of N ranks holds T/N of the tokens, their
queries, keys and values, so no rank ever holds the whole (T, T) score matrix or all of K and V.
Each query needs every earlier key, though, so the keys and values travel: in each of N steps a
rank attends its queries to the block of K and V it holds, while sending that block to its right
neighbour and receiving the next from its left (the send is started before the compute, so the
two overlap). After N-1 trips every rank has seen every block; each (K, V) block is sent N-1
times, by N ranks, and nothing else is sent: the output stays where its queries are.

The partial results are combined by the online-softmax rule. A block's output is normalised by
its own sum of exp(scores), kept as its log, lse; two blocks' outputs over disjoint keys merge
into the output over both by rescaling each to the common sum: lse = logaddexp(lse_a, lse_b),
out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b. The order of the blocks does not matter.

Load balancing. Under a causal mask token i attends to i + 1 keys, so a rank holding the last
T/N tokens has far more to compute than one holding the first, and each step of the ring waits
for its slowest rank. Cut the sequence into 2N chunks and give rank r chunks r and 2N-1-r: every
rank gets the same share of the causal score matrix, and at every step the same work.

Forward only: the trainable version, whose backward sends the gradients of K and V round the
ring too, is the project's mingpt_ddp/parallel/ring.py.
The grown-up version is mingpt_ddp/parallel/context.py (apply_cp) with ring.py: the ring
along the mesh's cp dimension, with its backward.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import finish, init, say, title

B, HEADS, HS = 2, 2, 8  # batch, heads, head size
C = HEADS * HS  # features
T = 32  # the whole sequence: 2N chunks of T/2N tokens for N = 2 or 4
TOLERANCE = 1e-5


def positions(rank: int, world: int, balanced: bool) -> torch.Tensor:
    """The T/N token positions a rank holds: chunks r and 2N-1-r of 2N, or chunk r of N."""
    if not balanced:
        return torch.arange(T).chunk(world)[rank]
    chunks = torch.arange(T).chunk(2 * world)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])


def spans(pos: torch.Tensor) -> str:
    """'0-7, 24-31': the contiguous runs of a rank's positions."""
    runs = []
    for p in pos.tolist():
        if runs and runs[-1][1] == p - 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ", ".join(f"{a}-{b}" for a, b in runs)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor):
    """q (B, HEADS, Tq, HS) over one block of keys and values (B, HEADS, Tk, HS); allowed
    (Tq, Tk) is the causal mask. Returns the block's output, normalised over this block only,
    and each query's log-sum-exp of its scores, (B, HEADS, Tq, 1)."""
    scores = q @ k.transpose(-2, -1) * HS**-0.5  # (B, HEADS, Tq, Tk)
    scores = scores.masked_fill(~allowed, float("-inf"))  # keys after the query: never seen
    lse = scores.logsumexp(-1, keepdim=True)  # -inf for a query that sees no key of the block
    # clamp: such a query's -inf - (-inf) would be nan; -inf - (-1e30) gives weights of 0
    weights = (scores - lse.clamp(min=-1e30)).exp()  # (B, HEADS, Tq, Tk)
    return weights @ v, lse  # (B, HEADS, Tq, HS), (B, HEADS, Tq, 1)


def merge(out, lse, block_out, block_lse):
    """The online-softmax rule: two outputs over disjoint keys, each normalised by its own sum
    exp(lse), rescaled to the sum over both; a block a query saw nothing of (lse -inf) adds 0."""
    new = torch.logaddexp(lse, block_lse)  # (B, HEADS, Tq, 1)
    return (lse - new).exp() * out + (block_lse - new).exp() * block_out, new


def exchange(k: torch.Tensor, v: torch.Tensor):
    """Start sending this block's K and V to the right neighbour and receiving the next block
    from the left one; returns the requests to wait on and the buffers being filled."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    next_k, next_v = torch.empty_like(k), torch.empty_like(v)
    ops = [
        dist.P2POp(dist.isend, k, right),
        dist.P2POp(dist.isend, v, right),
        dist.P2POp(dist.irecv, next_k, left),
        dist.P2POp(dist.irecv, next_v, left),
    ]
    return dist.batch_isend_irecv(ops), next_k, next_v


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, balanced: bool):
    """Causal attention of this rank's queries over the whole sequence. q, k, v (B, HEADS,
    T/N, HS): this rank's tokens. Returns its output (B, HEADS, T/N, HS), the causal scores it
    computed at each step, and the bytes it sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q_pos = positions(rank, world, balanced)
    out = lse = None
    work, sent = [], 0
    for step in range(world):
        src = (rank - step) % world  # the rank whose tokens' K and V this rank holds now
        if step < world - 1:  # start the block's next trip first: it travels while we compute
            requests, next_k, next_v = exchange(k, v)
            sent += (k.numel() + v.numel()) * k.element_size()
        # the holder's positions, not sent: every rank knows the layout
        allowed = positions(src, world, balanced)[None, :] <= q_pos[:, None]  # (T/N, T/N)
        work.append(int(allowed.sum()))  # what a kernel that skips masked tiles computes
        if allowed.any():  # step 0 is the rank's own block: every query sees itself
            block = block_attention(q, k, v, allowed)
            out, lse = block if out is None else merge(out, lse, *block)
        if step < world - 1:
            for request in requests:
                request.wait()
            k, v = next_k, next_v
    return out, work, sent


def run_layout(q, k, v, ref, balanced: bool) -> tuple[bool, list, int]:
    """The ring on one layout of the tokens, checked against the whole sequence's attention."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pos = positions(rank, world, balanced)
    out, work, sent = ring_attention(q[:, :, pos], k[:, :, pos], v[:, :, pos], balanced)
    diff = (out - ref[:, :, pos]).abs().max().item()  # ref (B, HEADS, T, HS): its queries' rows
    ok = diff <= TOLERANCE
    total = T * (T + 1) // 2  # the causal score matrix: query i sees keys 0..i
    name = "balanced  " if balanced else "contiguous"
    say(
        f"{name} tokens {spans(pos)}: max |diff| {diff:.1e} -> {'pass' if ok else 'FAIL'}"
        f" | scores per step {work} = {sum(work)} of {total}, share {sum(work) / total:.3f}"
    )
    return ok, work, sent


def report_pace(works: list, world: int) -> None:
    """Rank 0: each step of the ring ends when its busiest rank is done; what that costs in all.
    works[r][step]: the scores rank r computed at that step."""
    slowest = [max(step) for step in zip(*works)]
    even = T * (T + 1) // 2 / world
    if dist.get_rank() == 0:
        print(
            f"  each step waits for its busiest rank: {slowest} = {sum(slowest)} scores' time,"
            f" {sum(slowest) / even:.2f} x an even split's {even:.0f}",
            flush=True,
        )


if __name__ == "__main__":
    rank, world = init()
    assert T % (2 * world) == 0, "run with 1, 2 or 4 ranks"
    torch.set_num_threads(1)  # one core per rank, as one GPU per rank
    g = torch.Generator().manual_seed(0)  # the same whole sequence on every rank
    q, k, v = torch.randn(3, B, HEADS, T, HS, generator=g)  # 3 x (B, HEADS, T, HS)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, HEADS, T, HS)
    title(
        f"causal ring attention on {world} ranks vs full causal attention on all {T} tokens"
        f" (tolerance {TOLERANCE:.0e})\n   B = {B}, {HEADS} heads of {HS}, C = {C},"
        f" T/N = {T // world} tokens a rank; scores: the (query, key) pairs a causal mask\n"
        "   lets through, per head, that a rank computes at each step of the ring"
    )
    ok = True
    for balanced in (False, True):
        layout_ok, work, sent = run_layout(q, k, v, ref, balanced)
        works = [None] * world
        dist.all_gather_object(works, work)
        report_pace(works, world)
        ok &= layout_ok
    formula = (world - 1) * 2 * (B * T // world * C * 4)
    title("bytes each rank sends per attention forward: K and V, N-1 times")
    say(f"sent {sent} bytes; (N-1) x 2 x (B x T/N x C x 4) = {formula}")
    ok &= sent == formula
    say(f"all checks passed: {ok}")
    finish(0 if ok else 1)
