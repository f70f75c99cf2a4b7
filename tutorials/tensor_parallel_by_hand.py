"""Tensor parallelism built by hand from plain tensors and collectives: Megatron's MLP, its
sequence-parallel variant, and which rows of a fused QKV weight each rank must hold.

    torchrun --standalone --nproc_per_node=2 tutorials/tensor_parallel_by_hand.py

Tensor parallelism splits each *weight matrix* over N ranks, so every rank computes part of every
layer, on the same tokens. A Linear's weight is (out, in). Column-parallel: rank r keeps rows
r*out/N.. of it and computes its slice of the output features from the whole input, sending
nothing forward; backward, each rank's gradient for the input is only its slice's share, so the
shares are summed by an all-reduce. Row-parallel: rank r keeps columns r*in/N.., takes its slice
of the input features, and its partial outputs are summed by an all-reduce forward; backward
sends nothing. Megatron's MLP chains the two (column, GELU, row): the hidden activation never
leaves its rank, and one all-reduce forward (g) plus one backward (f) is all a layer sends.

Sequence parallelism keeps the activations *between* such layers cut along the sequence (where
LayerNorm, dropout and the residual run on their own tokens): an all-gather rebuilds the whole
sequence before the column layer (reduce-scatter backward), and a reduce-scatter sums and cuts
it again after the row layer (all-gather backward). A ring sends the same bytes for those two as
for one all-reduce, and each rank holds 1/N of the activations in between.

Every step is checked against one process with the same full weights (one seed on every rank).
The bytes are what a ring sends for the tensors handed to each collective (2(N-1)/N S for an
all-reduce of S bytes, (N-1) s for an all-gather of shards s, (N-1)/N S for a reduce-scatter);
ring_allreduce.py counts such a ring's bytes for real. torch.distributed.tensor.parallel is the
engine for real use (DTensor, not used here).
The grown-up version is mingpt_ddp/parallel/tensor.py (apply_tp): the same column and row
layout on DTensor, along the mesh's tp dimension.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import finish, init, say, title
from torch import nn

B, T, C = 2, 16, 32  # batch, sequence, features
HIDDEN = 4 * C  # the MLP's inner width, split over the ranks
HEADS = 4
HS = C // HEADS  # head size
TOLERANCE = 1e-5
SENT = []  # (collective, bytes handed to it), in call order: the byte lines read it


def ring_bytes(kind: str, nbytes: int, world: int) -> float:
    """What one rank sends in a ring for a collective handed nbytes (a shard for all_gather)."""
    return {
        "all_reduce": 2 * (world - 1) / world * nbytes,
        "all_gather": (world - 1) * nbytes,
        "reduce_scatter": (world - 1) / world * nbytes,
    }[kind]


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    SENT.append(("all_reduce", t.numel() * t.element_size()))
    t = t.contiguous().clone()  # autograd's tensors are never summed into in place
    dist.all_reduce(t)
    return t


def all_gather_seq(t: torch.Tensor) -> torch.Tensor:
    """(B, T/N, ...) on each rank -> (B, T, ...) on every rank, rank 0's tokens first."""
    SENT.append(("all_gather", t.numel() * t.element_size()))
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=1)


def reduce_scatter_seq(t: torch.Tensor) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank -> (B, T/N, ...): the sum of rank r's tokens."""
    SENT.append(("reduce_scatter", t.numel() * t.element_size()))
    # Megatron keeps activations as (T, B, C) so that these chunks are slices of memory already
    parts = [p.contiguous() for p in t.chunk(dist.get_world_size(), dim=1)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts)
    return out


class CopyToParallel(torch.autograd.Function):
    """f: forward the whole input as is; backward, sum the ranks' partial input gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad)


class ReduceFromParallel(torch.autograd.Function):
    """g: sum the ranks' partial outputs; backward, every rank already has the whole gradient."""

    @staticmethod
    def forward(ctx, x):
        return all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class GatherSequence(torch.autograd.Function):
    """f under sequence parallelism: all-gather the tokens; backward, reduce-scatter."""

    @staticmethod
    def forward(ctx, x):
        return all_gather_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad)


class ScatterSequence(torch.autograd.Function):
    """g under sequence parallelism: reduce-scatter the partial outputs; backward, all-gather."""

    @staticmethod
    def forward(ctx, x):
        return reduce_scatter_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad)


def mine(t: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's slice of a full tensor along dim, as a leaf of its own (a parameter)."""
    return t.detach().chunk(dist.get_world_size(), dim)[dist.get_rank()].clone().requires_grad_()


def part(t: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's slice of a reference tensor: what its shard should equal."""
    return t.chunk(dist.get_world_size(), dim)[dist.get_rank()]


def column_parallel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x (B, T, in) on every rank, w (out/N, in) -> (B, T, out/N): this rank's output features."""
    return F.linear(CopyToParallel.apply(x), w, b)


def row_parallel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x (B, T, in/N), w (out, in/N) -> (B, T, out), the same on every rank."""
    return ReduceFromParallel.apply(F.linear(x, w)) + b  # the bias once, after the sum


def build_mlp() -> nn.Sequential:
    torch.manual_seed(0)  # the same full weights on every rank
    return nn.Sequential(nn.Linear(C, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, C))


def reference(module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    """One process, full weights: the output and the input's gradient (the weights' in .grad)."""
    x = x.clone().requires_grad_()
    out = module(x)
    out.backward(grad_out)  # as if d loss / d out were grad_out
    return out.detach(), x.grad


def report(name: str, pairs: dict) -> bool:
    """One line per rank: the max |diff| of each (ours, reference) pair; True if all within."""
    diffs = {k: (a - b).abs().max().item() for k, (a, b) in pairs.items()}
    ok = all(d <= TOLERANCE for d in diffs.values())
    listed = ", ".join(f"{k} {d:.1e}" for k, d in diffs.items())
    say(f"{name}: max |diff| {listed} -> {'pass' if ok else 'FAIL'}")
    return ok


def check_column(x: torch.Tensor, grad_out: torch.Tensor) -> bool:
    """The MLP's first Linear, column-parallel: x (B, T, C) whole on every rank."""
    col = build_mlp()[0]
    ref, ref_dx = reference(col, x, grad_out)  # (B, T, HIDDEN)
    w, b, xs = mine(col.weight, 0), mine(col.bias, 0), x.clone().requires_grad_()
    out = column_parallel(xs, w, b)  # (B, T, HIDDEN/N): no communication forward
    out.backward(part(grad_out, -1))  # each rank's output slice gets its slice of the gradient
    ok = report(
        f"column-parallel Linear({C}, {HIDDEN})",
        dict(
            output=(out, part(ref, -1)),
            weight=(w.grad, part(col.weight.grad, 0)),
            bias=(b.grad, part(col.bias.grad, 0)),
            input=(xs.grad, ref_dx),
        ),
    )
    # Without f's all-reduce, x's gradient is only this rank's output features' share of it
    xs = x.clone().requires_grad_()
    F.linear(xs, w.detach(), b.detach()).backward(part(grad_out, -1))
    off = (xs.grad - ref_dx).abs().max().item()
    say(f"  without f's all-reduce backward, input grad off by {off:.1e}: a partial sum")
    return ok


def check_row(h: torch.Tensor, grad_out: torch.Tensor) -> bool:
    """The MLP's second Linear, row-parallel: each rank gets its slice of h's features."""
    row = build_mlp()[2]
    ref, ref_dh = reference(row, h, grad_out)  # (B, T, C)
    w, b, hs = mine(row.weight, 1), row.bias.detach().clone().requires_grad_(), mine(h, -1)
    out = row_parallel(hs, w, b)  # (B, T, C): the partial outputs summed by g's all-reduce
    out.backward(grad_out)  # the whole gradient on every rank: g's backward sends nothing
    return report(
        f"row-parallel Linear({HIDDEN}, {C})",
        dict(
            output=(out, ref),
            weight=(w.grad, part(row.weight.grad, 1)),
            bias=(b.grad, row.bias.grad),
            input=(hs.grad, part(ref_dh, -1)),
        ),
    )


def mlp_shards(mlp: nn.Sequential) -> dict:
    """This rank's parameters: rows of the first weight, columns of the second, the last bias."""
    return dict(
        w1=mine(mlp[0].weight, 0),  # (HIDDEN/N, C)
        b1=mine(mlp[0].bias, 0),  # (HIDDEN/N,)
        w2=mine(mlp[2].weight, 1),  # (C, HIDDEN/N)
        b2=mlp[2].bias.detach().clone().requires_grad_(),  # (C,): whole on every rank
    )


def tp_mlp(x: torch.Tensor, p: dict) -> torch.Tensor:
    """x (B, T, C) whole on every rank -> (B, T, C) whole on every rank."""
    h = F.gelu(column_parallel(x, p["w1"], p["b1"]))  # (B, T, HIDDEN/N): never leaves the rank
    return row_parallel(h, p["w2"], p["b2"])


def sp_mlp(x: torch.Tensor, p: dict) -> torch.Tensor:
    """x (B, T/N, C), this rank's tokens -> (B, T/N, C), the same tokens' output."""
    whole = GatherSequence.apply(x)  # (B, T, C): every token, for the column layer
    h = F.gelu(F.linear(whole, p["w1"], p["b1"]))  # (B, T, HIDDEN/N)
    return ScatterSequence.apply(F.linear(h, p["w2"])) + p["b2"]  # (B, T/N, C)


def check_mlp(x: torch.Tensor, grad_out: torch.Tensor, sequence: bool) -> tuple[bool, list, int]:
    """Megatron's MLP (sequence=False) or its sequence-parallel variant against one process;
    returns the check, the collectives its forward called, and the floats of its output."""
    mlp = build_mlp()
    ref, ref_dx = reference(mlp, x, grad_out)  # (B, T, C)
    p = mlp_shards(mlp)
    seq = (lambda t: part(t, 1)) if sequence else (lambda t: t)  # this rank's tokens under SP
    xs = seq(x).clone().requires_grad_()  # (B, T/N, C) under SP, else (B, T, C)
    SENT.clear()
    out = (sp_mlp if sequence else tp_mlp)(xs, p)
    sent = list(SENT)  # the forward's collectives only
    out.backward(seq(grad_out))
    if sequence:  # b2 saw this rank's tokens only: sum its gradient, as Megatron does for
        dist.all_reduce(p["b2"].grad)  # LayerNorm's and such weights in the sequence region
    ok = report(
        "sequence-parallel MLP" if sequence else "tensor-parallel MLP",
        dict(
            output=(out, seq(ref)),
            w1=(p["w1"].grad, part(mlp[0].weight.grad, 0)),
            b1=(p["b1"].grad, part(mlp[0].bias.grad, 0)),
            w2=(p["w2"].grad, part(mlp[2].weight.grad, 1)),
            b2=(p["b2"].grad, mlp[2].bias.grad),
            input=(xs.grad, seq(ref_dx)),
        ),
    )
    held = f"({', '.join(map(str, out.shape))})"
    say(f"  holds between layers: input and output {held} = {out.numel()} floats each")
    return ok, sent, out.numel()


def report_bytes(tp: tuple, sp: tuple, world: int) -> bool:
    """Rank 0 prints what each version's forward sends per rank and holds between layers; True
    if SP sends what TP does and holds 1/N of it. tp, sp: (collectives called, floats held)."""
    formula = dict(all_reduce="2(N-1)/N x", all_gather="(N-1) x", reduce_scatter="(N-1)/N x")
    size = B * T * C * 4  # S: the MLP's whole (B, T, C) output in fp32 bytes
    title(
        f"bytes each rank sends per MLP forward, N = {world}, S = B x T x C x 4 = {size} bytes\n"
        "   (a ring's, for the tensors handed to each collective; the same on every rank)"
    )
    totals, lines = {}, []
    for name, (sent, _) in (("TP", tp), ("SP", sp)):
        terms = [f"{k} {formula[k]} {n} = {ring_bytes(k, n, world):.0f}" for k, n in sent]
        totals[name] = sum(ring_bytes(k, n, world) for k, n in sent)
        lines.append(f"{name}: {'; '.join(terms)}; total {totals[name]:.0f} bytes")
    same = totals["TP"] == totals["SP"] == 2 * (world - 1) / world * size
    held = tp[1] == sp[1] * world
    lines.append(f"SP sends the same bytes as TP: {same}; holds {sp[1]} of TP's {tp[1]} floats")
    lines[-1] += f" between layers (1/N): {held}"
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)
    return same and held


def heads(found: set) -> str:
    lo, hi = min(found, default=0), max(found, default=0)  # contiguous here
    return "none" if not found else f"head {lo}" if lo == hi else f"heads {lo}-{hi}"


def describe(rows: torch.Tensor) -> str:
    """'rows 0-15, 32-47: q heads 0-1, k heads 0-1' for rows of the fused (3C, C) weight."""
    rows, runs, found = rows.tolist(), [], {}
    for r in rows:  # contiguous runs of row numbers
        if runs and runs[-1][1] == r - 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
        found.setdefault("qkv"[r // C], set()).add(r % C // HS)  # row r: q, k or v; its head
    whole = set.intersection(*(found.get(p, set()) for p in "qkv"))  # heads with q, k and v
    where = ", ".join(f"{a}-{b}" for a, b in runs)
    what = ", ".join(f"{p} {heads(h)}" for p, h in found.items())
    return f"rows {where}: {what} | can compute: {heads(whole)}"


def check_attention(x: torch.Tensor) -> bool:
    """Head-parallel causal self-attention: the fused QKV Linear column-parallel by heads, the
    output projection row-parallel; forward only, against one process."""
    world = dist.get_world_size()
    torch.manual_seed(1)
    qkv, proj = nn.Linear(C, 3 * C), nn.Linear(C, C)  # weights (3C, C): q rows, k rows, v rows
    with torch.no_grad():
        q, k, v = qkv(x).view(B, T, 3, HEADS, HS).permute(2, 0, 3, 1, 4)  # 3 x (B, HEADS, T, HS)
        ref_y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, HEADS, T, HS)
        ref = proj(ref_y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)
        say(f"a plain split of the rows: {describe(part(torch.arange(3 * C), 0))}")
        rows = part(torch.arange(3 * C).view(3, HEADS, HS), 1).reshape(-1)  # this rank's heads
        say(f"its heads' q, k, v rows:   {describe(rows)}")
        local = F.linear(x, qkv.weight[rows], qkv.bias[rows])  # (B, T, 3C/N)
        q, k, v = local.view(B, T, 3, HEADS // world, HS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, HEADS/N, T, HS)
        y = y.transpose(1, 2).reshape(B, T, C // world)  # (B, T, C/N): its heads' features
        out = row_parallel(y, part(proj.weight, 1), proj.bias)  # (B, T, C)
    return report(
        f"head-parallel attention, {heads(set(part(torch.arange(HEADS), 0).tolist()))}",
        dict(heads=(y, part(ref_y.transpose(1, 2).reshape(B, T, C), -1)), output=(out, ref)),
    )


if __name__ == "__main__":
    rank, world = init()
    assert HEADS % world == 0 and T % world == 0, "run with 1, 2 or 4 ranks"
    torch.set_num_threads(1)  # tiny tensors: threads would only contend for the 2 cores
    g = torch.Generator().manual_seed(2)  # the same data on every rank
    x = torch.randn(B, T, C, generator=g)  # (B, T, C)
    h = torch.randn(B, T, HIDDEN, generator=g)  # (B, T, HIDDEN): the row layer's input
    grad_hidden = torch.randn(B, T, HIDDEN, generator=g)  # d loss / d hidden, as if from a loss
    grad_out = torch.randn(B, T, C, generator=g)  # d loss / d output
    title(f"one Linear split over N = {world} ranks vs nn.Linear (tolerance {TOLERANCE:.0e})")
    ok = check_column(x, grad_hidden) & check_row(h, grad_out)
    title("Megatron's MLP: f, column-parallel, GELU, row-parallel, g; vs one process")
    tp_ok, *tp = check_mlp(x, grad_out, sequence=False)
    title("the sequence-parallel MLP: all-gather, column, GELU, row, reduce-scatter")
    sp_ok, *sp = check_mlp(x, grad_out, sequence=True)
    ok &= tp_ok & sp_ok & report_bytes(tp, sp, world)
    title(f"attention: the fused QKV weight ({3 * C}, {C}) as (3, {HEADS} heads, {HS}) rows")
    ok &= check_attention(x)
    say(f"all checks passed: {ok}")
    finish(0 if ok else 1)
