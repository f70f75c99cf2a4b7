"""What each parallel layout should send and hold, from the model's shapes alone: the formulas
benchmarks/parallelisms.py prints beside what it counts, each dimension's bytes computed by the
planner's mingpt_ddp/planner/traffic.py (one copy) from the shapes of a built strategy. Bytes are
what one rank sends in one training step, under the ring algorithms of traffic.ring_sent; fp32
throughout.

Every layout is a point of the grid (mingpt_ddp/parallel/mesh.py: pp x dp_replicate x dp_shard x
cp x tp), and a rank's bytes are the sum of what each of its dimensions sends, each on its own
group, with the activations each one sees cut by the others: a forward unit is one microbatch
(a pipeline's: b / m windows; otherwise the replica's b windows) of T / cp tokens of width C.
Notation: b windows per replica per step, s tokens per window (T), h the width (C), L blocks
(of this rank's stages), N the size of the group an op runs on.
- pipeline: each microbatch's (mb, s / cp, h) activation forward and its gradient back at every
  hand-off, the tied matrix's gradient between first and last stage (this rank's piece of it).
- tensor parallel: 4 all-reduces of the forward unit per block (forward: after the attention and
  MLP output projections; backward: before the QKV and first MLP matmuls, for the input's
  gradient) on tp.
- sequence parallel: the same 4 x L as all-gather + reduce-scatter pairs (equal bytes), plus
  two (b, s / tp, h) all-gathers at the ends (before the head in forward; the embedding's output
  gradient in backward), and the LayerNorms' partial gradients all-reduced (2 L + 1 of them).
- context parallel: per block and forward unit, ring attention's K and V (b, s / cp, h / tp)
  each: (cp - 1) hops forward, (cp - 1) backward with their gradients beside them, one last hop
  home of the gradients, on cp.
- the norm: where the grid holds pieces (a pipeline, DTensor parameters), one number all-reduced
  over the world (mingpt_ddp/parallel/clip.py).
- data parallel, as the ladder chose it (parallelize.data_parallel): DDP, one all-reduce of every
  gradient over dp x cp; FSDP over dp_shard x cp (traffic.fsdp on comm_bytes.fsdp_groups, each
  rank's TP shards); HSDP the same within a shard group, then each group's reduce-scattered
  shard all-reduced over dp_replicate (traffic.hsdp). The experts expert parallelism shared out
  are not in it.
- expert parallel (expert_bytes), from the step's routing count matrix M (M[i][j]: rows rank i
  routed to rank j's experts, in one MoE forward): rank i sends sum_{j != i} M[i][j] rows
  (dispatch) and sum_{j != i} M[j][i] (combine) of width h, each twice (forward, and the
  gradient of the other direction in backward); the counts (E int64) before each dispatch,
  (ep - 1) / ep of them leaving; a forward that activation checkpointing recomputes in backward
  sends its rows once more; the experts' gradients all-reduced over expert_dp; the tokens
  per expert (MoE blocks x E fp32) all-reduced over dp x cp, for the routers' balance.
"""

from __future__ import annotations

import math

import torch

from benchmarks.comm_bytes import fsdp_groups, ring_sent_bytes
from mingpt_ddp.config.pipeline import ZERO_BUBBLE
from mingpt_ddp.planner import traffic
from mingpt_ddp.planner.traffic import TP_SPLIT


def bubble(layout: dict) -> float | None:
    """The pipeline's idle share: (p - 1) / (v m + p - 1); None for the zero-bubble schedules,
    which have no textbook formula (mingpt_ddp/planner/schedule.py: table_bubble)."""
    if layout["pp"] == 1 or layout["schedule"] in ZERO_BUBBLE:
        return None
    p, m = layout["pp"], layout["m"]
    v = layout.get("v", 1) if layout["schedule"] == "interleaved1f1b" else 1
    return (p - 1) / (v * m + p - 1)


def _whole(p) -> int:
    """Elements of a parameter as one process holds it."""
    return math.prod(p.shape)


def _tp_shape(p, tp: int) -> tuple:
    """A parameter's shape on one rank of tensor parallelism (before FSDP)."""
    shape = list(p.shape)
    mesh_dims = p.device_mesh.mesh_dim_names if hasattr(p, "device_mesh") else ()
    for name, placement in zip(mesh_dims, getattr(p, "placements", ())):
        if name == "tp" and placement.is_shard():
            shape[placement.dim] //= tp
    return tuple(shape)


def _tp_shard(tp: int):
    """What FSDP shards of a parameter on one tp rank: its TP piece's shape (a meta tensor)."""
    return lambda p: torch.empty(_tp_shape(p, tp), device="meta")  # shape and dtype only


def data_parallel_bytes(strategy, times: int) -> float:
    """The data-parallel reduction of this rank's modules (the model, or its pipeline stages), as
    the ladder wrapped them: DDP over dp x cp, FSDP over dp_shard x cp (gathers: times forwards
    per step, a pipeline's microbatches), HSDP: FSDP within, all-reduce across dp_replicate."""
    dims, how = strategy.dims, strategy.parts[0].data_parallel
    experts = {id(p) for p in strategy.moe.params}  # they average themselves (expert_bytes)
    if how == "ddp":
        params = {id(p): p for m in strategy.modules for p in m.parameters()}
        params = [p for i, p in params.items() if i not in experts]
        return traffic.ddp(sum(p.numel() * p.element_size() for p in params), dims.dp * dims.cp)
    if how not in ("fsdp", "hsdp"):
        return 0.0
    shards, tp_piece = dims.dp_shard * dims.cp, _tp_shard(dims.tp)
    local = lambda p: torch.empty(0, device="meta") if id(p) in experts else tp_piece(p)
    plan = strategy.pipeline.plan if strategy.pipeline is not None else strategy.plan
    sent, resharded = 0.0, plan.reshard_after_forward
    for module in strategy.modules:
        groups = fsdp_groups(module, local)
        sent += sum(traffic.fsdp(groups, shards, times, resharded))
        if how == "hsdp":  # each group's reduce-scattered shard, summed over the replicas
            sent += traffic.hsdp(groups, shards, dims.dp_replicate)
    return sent


def pipeline_bytes(layout: dict, strategy, act: float) -> float:
    """Activations forward and their gradients back (every microbatch, every hand-off this rank
    makes), and the tied matrix's gradient between first and last stage (this rank's piece: a
    shard under FSDP)."""
    pipeline, m = strategy.pipeline, layout["m"]
    n, away = pipeline.cfg.stages, lambda i: pipeline.rank_of[i] != pipeline.pp_rank
    # a hand-off to a stage on this rank (a V's turn) sends nothing
    sends = sum((i < n - 1 and away(i + 1)) + (i > 0 and away(i - 1)) for i in pipeline.ids)
    sent = traffic.handoffs(act, m, sends)
    if pipeline.tie_group is not None:
        for tied in pipeline.tied:
            tied = tied.to_local() if hasattr(tied, "to_local") else tied
            sent += ring_sent_bytes("all_reduce", tied.numel() * 4, 2)
    return sent


def tensor_bytes(layout: dict, strategy, act: float, blocks: int, times: int) -> float:
    """Tensor (and sequence) parallelism's activations and partial gradients inside the blocks
    (per forward unit act), and sequence parallelism's ends and LayerNorm gradients."""
    tp, sp = strategy.dims.tp, bool(layout.get("sp"))
    dense = sum(hasattr(b.mlp, "fc") for m in strategy.modules for b in m.blocks.children())
    norms = [p for m in strategy.modules for n, p in m.named_parameters() if "ln_" in n]
    return traffic.tensor(act, blocks, dense, times, tp, sp, sum(map(_whole, norms)))


def context_bytes(strategy, act: float, blocks: int, times: int) -> float:
    """Ring attention's keys and values (and their gradients), per block and forward unit: K and
    V are each this rank's heads (h / tp) of the unit's tokens."""
    return traffic.ring_attention(act, blocks, times, strategy.dims.cp, strategy.dims.tp)


def routing_bytes(strategy, width: int) -> float:
    """The rows expert parallelism exchanged in the last step's MoE forwards (each exchange's
    `last`, module docstring), dispatch and combine, forward and backward (traffic.exchange),
    and each forward's counts."""
    sent = 0.0
    for layer in strategy.moe.layers if strategy.dims.ep > 1 else []:
        me, log = layer.exchange.group.rank(), layer.exchange
        for to, came, recomputed in zip(*log.last):
            rows_out, rows_back = sum(to) - to[me], sum(came) - came[me]
            sent += traffic.exchange(rows_out, rows_back, width, recomputed)
            sent += ring_sent_bytes("all_to_all", len(layer.expert_bias) * 8, len(to))
    return sent


def expert_bytes(strategy) -> float:
    """Besides the rows (routing_bytes): the experts' own reductions (traffic.expert_reductions:
    mingpt_ddp/parallel/expert.py's ExpertStep.after_backward)."""
    dims, moe = strategy.dims, strategy.moe
    if not moe.layers:
        return 0.0
    grads = sum(p.to_local().numel() * 4 for p in moe.params)
    counts = len(moe.layers) * len(moe.layers[0].expert_bias) * 4
    readers = dims.dp * dims.cp
    return sum(traffic.expert_reductions(grads, counts, readers, readers // dims.ep).values())


def sent_bytes(layout: dict, strategy, size: dict) -> float:
    """What this rank should send in one step, for any point of the grid: the sum of each
    dimension's bytes on its own group (module docstring)."""
    dims, C, T, G = strategy.dims, size["n_embd"], size["T"], layout["G"]
    times = layout["m"] if strategy.pipeline is not None else 1  # forwards of each block
    act = G // dims.dp // times * (T // dims.cp) * C * 4  # one forward unit, (b, s / cp, h)
    blocks = sum(len(m.blocks) for m in strategy.modules)
    sent = pipeline_bytes(layout, strategy, act) if strategy.pipeline is not None else 0.0
    if dims.tp > 1:
        sent += tensor_bytes(layout, strategy, act, blocks, times)
    if dims.cp > 1:
        sent += context_bytes(strategy, act, blocks, times)
    if strategy.sharded and dims.world_size > 1:  # the squared norm, summed over the grid
        sent += ring_sent_bytes("all_reduce", 4, dims.world_size)
    return sent + data_parallel_bytes(strategy, times) + expert_bytes(strategy)


def param_bytes(layout: dict, strategy) -> float | None:
    """What a rank should hold of the parameters: the split matrices / tp, everything / the
    shards under FSDP or HSDP (dp_shard x cp; its padding aside). None for a pipeline (a stage's
    share depends on the cut)."""
    if layout["pp"] > 1:
        return None
    dims, how = strategy.dims, strategy.parts[0].data_parallel
    whole = type(strategy.model)(strategy.model.config)
    shards = dims.dp_shard * dims.cp if how in ("fsdp", "hsdp") else 1
    split = lambda name: layout["tp"] if name.endswith(TP_SPLIT) else 1
    experts = ("mlp.w1", "mlp.w2")  # expert parallelism's share: / ep, and no FSDP shards
    return sum(
        p.numel() * 4 / dims.ep if n.endswith(experts) and dims.ep > 1 else
        p.numel() * 4 / split(n) / shards
        for n, p in whole.named_parameters()
    )  # fmt: skip


def activation_bytes(layout: dict, one_process: float) -> float | None:
    """What a rank should save for backward, from one process's: / dp (its share of the batch),
    / cp (its share of each window), / tp with sequence parallelism (its share of the positions
    everywhere). None where no single ratio holds: tensor parallelism alone splits the
    attention and MLP insides but not the LayerNorms and the residual stream; a pipeline holds
    its stages' microbatches."""
    if layout["pp"] > 1 or (layout["tp"] > 1 and not layout.get("sp")) or layout.get("ac"):
        return None  # (activation checkpointing keeps a block's input only)
    return one_process / layout["dp"] / layout["cp"] / layout["tp"]
