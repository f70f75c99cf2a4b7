"""What each dimension of the grid sends per step, from shapes alone: the one copy of the byte
formulas, which benchmarks/formulas.py applies to a built strategy and checks against the bytes
its runs count, and which the planner applies to any model and layout.

Bytes are what one rank sends in one training step under ring algorithms (ring_sent); fp32
activations and gradients, as the project communicates them on CPU (under bf16 autocast on a
GPU the activations a pipeline and tensor parallelism send are bf16: `act_bytes` says which).
A forward unit `act` is one microbatch's (b, s / cp, h) activation in bytes; L blocks; N the
size of the group an op runs on.
"""

from __future__ import annotations

import math

from mingpt_ddp.config.pipeline import V_SHAPED, ZERO_BUBBLE
from mingpt_ddp.parallel.mesh import ParallelDims
from mingpt_ddp.parallel.parallelize import data_parallel as data_parallel_wrapper
from mingpt_ddp.parallel.stages import block_ranges, placement
from mingpt_ddp.planner.shapes import Layout, Model


def ring_sent(kind: str, nbytes: float, n: int, is_root: bool = False) -> float:
    """Bytes one rank sends for one `kind` op with nbytes of input on n ranks: a ring all-reduce
    sends 2 (n - 1) / n of it (reduce-scatter, then all-gather), an all-gather the rank's piece
    to each of n - 1 others, a reduce-scatter (n - 1) / n."""
    per_kind = {
        "all_reduce": 2 * (n - 1) / n * nbytes,
        "all_gather": (n - 1) * nbytes,
        "reduce_scatter": (n - 1) / n * nbytes,
        "all_to_all": (n - 1) / n * nbytes,
        "broadcast": nbytes if is_root else 0,
        "scatter": (n - 1) / n * nbytes if is_root else 0,
        "gather": 0 if is_root else nbytes,
        "reduce": 0 if is_root else nbytes,
        "send": nbytes,
        "recv": 0,
        "barrier": 0,
    }
    return float(per_kind[kind])


def padded(shapes: list[tuple[int, ...]], n: int, itemsize: int = 4) -> int:
    """FSDP2's all-gather input, times N: each tensor padded to a multiple of N rows
    (_fsdp_common._get_dim0_padded_size), so that every rank's shard has the same size."""
    return sum(math.ceil(s[0] / n) * n * math.prod(s[1:]) * itemsize for s in shapes)


def fsdp(
    groups: list[list[tuple]], n: int, times: int = 1, resharded: bool = True
) -> tuple[float, float]:
    """FSDP2's (all-gather, reduce-scatter) bytes per rank and step over n shards: groups are
    each block's tensors (this rank's tensor-parallel pieces), then the root's, which stays
    gathered after forward (FSDPState._lazy_init). A block is gathered for each of `times`
    forwards (a pipeline's microbatches; the backwards after the first find it still gathered)
    and once more for backward, or once in all when not resharded after forward; every group's
    gradients reduce-scattered once."""
    *blocks, root = [padded(g, n) for g in groups]
    gathers = times + 1 if resharded else 1
    gather = sum(gathers * ring_sent("all_gather", b / n, n) for b in blocks)
    gather += ring_sent("all_gather", root / n, n)
    return gather, sum(ring_sent("reduce_scatter", g, n) for g in [*blocks, root])


def ddp(grad_bytes: float, n: int) -> float:
    """DDP: every gradient all-reduced once (bucket by bucket) over n replicas."""
    return ring_sent("all_reduce", grad_bytes, n)


def tensor(act: float, blocks: int, dense: int, times: int, tp: int, sp: bool, norms: int) -> float:
    """Tensor parallelism inside the blocks, per forward unit act: 2 all-reduces per attention
    and 2 per (dense: not MoE) MLP, forward and backward. With sequence parallelism each is an
    all-gather of a (b, s / tp, h) shard plus a reduce-scatter, two more gathers at the ends (the
    head's input; the embedding's output gradient), and the LayerNorms' partial gradients (norms
    elements in all) all-reduced."""
    if not sp:
        return (2 * blocks + 2 * dense) * times * ring_sent("all_reduce", act, tp)
    sent = 4 * blocks * times * ring_sent("all_gather", act / tp, tp)
    sent += 4 * blocks * times * ring_sent("reduce_scatter", act, tp)
    sent += 2 * times * ring_sent("all_gather", act / tp, tp)
    return sent + ring_sent("all_reduce", norms * 4, tp)


def ring_attention(act: float, blocks: int, times: int, cp: int, tp: int) -> float:
    """Ring attention per block and forward unit: K and V (this rank's heads, h / tp, of its
    s / cp tokens) passed on cp - 1 times forward, cp - 1 times backward with their gradients
    beside them, and the gradients' last hop home."""
    kv = 2 * act / tp
    return blocks * times * ((cp - 1) * kv + (cp - 1) * 2 * kv + kv)


def exchange(rows_out: float, rows_back: float, width: int, recomputed: bool) -> float:
    """One MoE block's forward under expert parallelism (parallel/expert.py): the rows it
    dispatches to other ranks' experts and the outputs it combines back to theirs (width wide,
    fp32), both again in backward, unless the forward is a recompute (activation
    checkpointing), which has no backward of its own."""
    return (1 if recomputed else 2) * (rows_out + rows_back) * width * 4


def expert_reductions(grads: float, counts: float, readers: int, replicas: int) -> dict:
    """A mixture of experts' own reductions each step: its tokens per expert (counts bytes)
    summed over the `readers` ranks that read different tokens (dp x cp: the routing bias), and,
    under expert parallelism, the experts' gradients (grads bytes) over the `replicas` ranks
    holding the same ones (expert_dp), which DDP and FSDP leave out."""
    return {
        "routing": ring_sent("all_reduce", counts, readers) if readers > 1 else 0.0,
        "dp": ring_sent("all_reduce", grads, replicas) if replicas > 1 else 0.0,
    }


def experts(model: Model, layout: Layout, blocks: int, times: int) -> dict[str, float]:
    """A mixture of experts' bytes for `blocks` MoE blocks run `times` forwards a step: "ep" the
    routed rows (exchange; an even spread assumed: of a forward unit's tokens x top_k rows,
    (ep - 1) / ep leave and as many come back), "routing" each forward's all-to-all of the
    per-expert counts (int64) and the expert_reductions' counts, "dp" their gradients'."""
    E, C, dp = model.n_experts, model.n_embd, layout.dp_replicate * layout.dp_shard
    if not E:
        return dict.fromkeys(("ep", "routing", "dp"), 0.0)
    readers, ep = dp * layout.cp, layout.ep
    local = blocks * 2 * E // ep * C * model.hidden * 4 if ep > 1 else 0.0
    found = {"ep": 0.0, **expert_reductions(local, blocks * E * 4, readers, readers // ep)}
    if ep == 1:
        return found
    tokens = layout.micro * (model.block // layout.cp)  # one forward unit
    away = tokens * model.top_k * (ep - 1) / ep  # rows for other ranks' experts
    recomputes = layout.ac == "full"  # each forward once more in backward
    rows = exchange(away, away, C, False) + recomputes * exchange(away, away, C, True)
    found["ep"] = blocks * times * rows
    counts = ring_sent("all_to_all", E * 8, ep)  # every forward's, a recompute's too
    found["routing"] += blocks * times * (1 + recomputes) * counts
    return found


def handoffs(act: float, microbatches: int, sends: int) -> float:
    """A pipeline rank's activations forward and gradients back: `sends` hand-offs to a stage on
    another rank (forward and backward counted apart), each microbatch's unit."""
    return microbatches * act * sends


def per_dimension(model: Model, layout: Layout, act_bytes: int = 4) -> dict[str, float]:
    """Bytes rank 0 sends per step, by dimension, for a GPT of these shapes (a pipeline's rank 0:
    its stages' hand-offs to stages on other ranks, and the tied matrix's gradient summed with
    the last stage's unless that stage is its own, as in a V)."""
    C, T, m = model.n_embd, model.block, layout.microbatches if layout.pp > 1 else 1
    act = layout.batch // m * (T // layout.cp) * C * act_bytes  # one forward unit
    stages = layout.stages
    rank_of = placement(layout.pp, stages, layout.schedule in V_SHAPED)
    mine = [i for i in range(stages) if rank_of[i] == 0]
    ranges = block_ranges(model.n_layer, stages)
    blocks = sum(len(ranges[i]) for i in mine)
    first, last = 0 in mine, stages - 1 in mine
    sent = dict.fromkeys(("pp", "tp", "cp", "ep", "routing", "dp", "norm"), 0.0)
    if layout.pp > 1:
        away = lambda i: rank_of[i] != 0  # noqa: E731
        sends = sum((i < stages - 1 and away(i + 1)) + (i > 0 and away(i - 1)) for i in mine)
        sent["pp"] = handoffs(act, m, sends)
        if not last:  # rank 0's piece of the tied matrix (torch.chunk's first)
            tied = math.ceil(model.vocab / shards_of(layout)) * C * 4
            sent["pp"] += ring_sent("all_reduce", tied, 2)
    if layout.tp > 1:
        norms = (2 * blocks + last) * 2 * C  # each LayerNorm's weight and bias
        dense = 0 if model.n_experts else blocks  # a MoE block's experts stay whole
        sent["tp"] = tensor(act, blocks, dense, m, layout.tp, layout.sp, norms)
    if layout.cp > 1:
        sent["cp"] = ring_attention(act, blocks, m, layout.cp, layout.tp)
    shared = {k: v for k, v in model.block_tensors().items() if k not in shared_out(layout)}
    block = list(local_shapes(shared, layout.tp).values())
    root = list(model.root_tensors(first, last).values())
    if first and last and layout.pp > 1:  # a V: the head's own copy of the tied matrix
        root.append((model.vocab, C))
    sent.update(experts(model, layout, blocks, m))
    sent["dp"] += data_parallel(layout, [block] * blocks + [root], m)
    sharded = layout.pp > 1 or layout.tp > 1 or layout.ep > 1
    sharded = sharded or wrapper(layout) in ("fsdp", "hsdp")
    if sharded and layout.gpus > 1:  # the squared norm, summed over the grid (clip.py)
        sent["norm"] = ring_sent("all_reduce", 4, layout.gpus)
    return sent


def shared_out(layout: Layout) -> tuple[str, ...]:
    """The block tensors expert parallelism shares out, which DDP and FSDP leave alone."""
    return ("mlp.w1", "mlp.w2") if layout.ep > 1 else ()


def data_parallel(layout: Layout, groups: list[list[tuple]], times: int) -> float:
    """The data-parallel reduction of these parameter groups (each block's, then the root's), as
    the ladder chooses it (wrapper): FSDP over dp_shard x cp, HSDP then each shard all-reduced
    over dp_replicate, DDP every gradient over dp x cp."""
    how, shards, replicas = wrapper(layout), shards_of(layout), layout.dp_replicate
    if how == "ddp":
        n = replicas * layout.dp_shard * layout.cp
        return ddp(sum(math.prod(s) * 4 for g in groups for s in g), n)
    if not how:
        return 0.0
    resharded = layout.pp == 1 or layout.schedule not in ZERO_BUBBLE
    sent = sum(fsdp(groups, shards, times, resharded)) if shards > 1 else 0.0
    return sent + (hsdp(groups, shards, replicas) if how == "hsdp" else 0.0)


def hsdp(groups: list[list[tuple]], shards: int, replicas: int) -> float:
    """HSDP's second half: each group's reduce-scattered shard all-reduced over the replicas."""
    return sum(ring_sent("all_reduce", padded(g, shards) / shards, replicas) for g in groups)


def wrapper(layout: Layout) -> str:
    """What averages the gradients, as the ladder chooses it (parallelize.data_parallel):
    "fsdp", "hsdp" (also DDP's replicas beside tensor parallelism), "ddp", or "" (one replica)."""
    degrees = {k: getattr(layout, k) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    return data_parallel_wrapper(ParallelDims(**degrees), layout.parallel, distributed=True)


def shards_of(layout: Layout) -> int:
    """The pieces each parameter is cut into by FSDP (dp_shard x cp; 1 under DDP)."""
    return layout.dp_shard * layout.cp if wrapper(layout) in ("fsdp", "hsdp") else 1


# The block tensors tensor parallelism splits (tensor.py's plan): columns of QKV and the first
# MLP matrix (their biases too), rows of the output projections; the rest every rank holds whole.
TP_SPLIT = (
    "attn.qkv.weight",
    "attn.qkv.bias",
    "attn.proj.weight",
    "mlp.fc.weight",
    "mlp.fc.bias",
    "mlp.proj.weight",
)
ROWS_SPLIT = ("attn.proj.weight", "mlp.proj.weight")  # split along dim 1 (the input features)


def local_shapes(tensors: dict[str, tuple], tp: int, split: bool = True) -> dict[str, tuple]:
    """Each tensor's shape on one tensor-parallel rank."""
    if tp == 1 or not split:
        return tensors
    local = {}
    for name, shape in tensors.items():
        if name.endswith(ROWS_SPLIT):
            local[name] = (shape[0], shape[1] // tp)
        elif name.endswith(TP_SPLIT):
            local[name] = (shape[0] // tp, *shape[1:])
        else:
            local[name] = shape
    return local
