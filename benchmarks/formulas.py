"""What each parallel layout should send and hold, from the model's shapes alone: the formulas
benchmarks/parallelisms.py prints beside what it counts. Bytes are what one rank sends in one
training step, under the ring algorithms of comm_bytes.ring_sent_bytes; fp32 throughout.

Notation: b windows per replica per step, s tokens per window (T), h the width (C), L blocks,
N the size of the group an op runs on.
- data parallel (DDP): one all-reduce of every gradient over dp; FSDP: comm_bytes.fsdp_formula.
- pipeline: each microbatch's (mb, s, h) activation forward and its gradient back at every
  hand-off, the tied matrix's gradient between first and last stage, the norm over the stages.
- tensor parallel: 4 all-reduces of (b, s, h) per block per step (forward: after the attention
  and MLP output projections; backward: before the QKV and first MLP matmuls, for the input's
  gradient), the norm (one number over the world), and FSDP over dp of each rank's TP shards.
- sequence parallel: the same 4 x L as all-gather + reduce-scatter pairs (equal bytes), plus
  two (b, s / tp, h) all-gathers at the ends (before the head in forward; the embedding's output
  gradient in backward), and the LayerNorms' partial gradients all-reduced (2 L + 1 of them).
- context parallel: per block, ring attention's K and V (b, s / cp, h) each: (cp - 1) hops
  forward, (cp - 1) backward with their gradients beside them, one last hop home of the
  gradients; plus DDP's all-reduce of every gradient over dp x cp.
"""

from __future__ import annotations

import math

import torch

from benchmarks.comm_bytes import fsdp_formula, ring_sent_bytes


def bubble(layout: dict) -> float | None:
    """The pipeline's idle share: (p - 1) / (v m + p - 1)."""
    if layout["pp"] == 1:
        return None
    p, m = layout["pp"], layout["m"]
    v = layout.get("v", 1) if layout["schedule"] == "interleaved1f1b" else 1
    return (p - 1) / (v * m + p - 1)


def data_parallel_bytes(layout: dict, strategy) -> float:
    """DDP's all-reduce of every gradient, or FSDP's gathers and reduce-scatters, over dp."""
    dp = layout["dp"]
    if dp == 1:
        return 0.0
    if layout["parallel"] == "fsdp":
        whole = type(strategy.model)(strategy.model.config)  # unsharded shapes, padded
        gather, scatter = fsdp_formula(whole, dp)
        return gather + scatter
    params = sum(p.numel() * p.element_size() for p in strategy.model.parameters())
    return ring_sent_bytes("all_reduce", params, dp)


def pipeline_bytes(layout: dict, strategy, C: int, T: int, G: int) -> float:
    """Activations forward and their gradients back (every microbatch, every hand-off this rank
    makes), the tied matrix's gradient between first and last stage, the norm over the world,
    tensor parallelism's 4 all-reduces per block and microbatch inside a stage, and the
    data-parallel reduction of this rank's stages over the replicas."""
    dp, tp, m, n = layout["dp"], layout["tp"], layout["m"], strategy.cfg.stages
    act = G // dp // m * T * C * 4  # one microbatch's (mb, T, C) fp32 activations
    sent = sum(m * act * ((i < n - 1) + (i > 0)) for i in strategy.ids)
    if strategy.tie_group is not None:  # this rank's piece of the tied matrix (FSDP: a shard)
        tied = strategy.tied[0]
        tied = tied.to_local() if hasattr(tied, "to_local") else tied
        sent += ring_sent_bytes("all_reduce", tied.numel() * 4, 2)
    sent += ring_sent_bytes("all_reduce", 4, layout["pp"] * dp * tp)  # the squared norm
    blocks = sum(len(s.blocks) for s in strategy.stages)
    sent += 4 * blocks * m * ring_sent_bytes("all_reduce", act, tp) if tp > 1 else 0
    if layout["parallel"] == "fsdp" and dp > 1:
        return sent + sum(_fsdp_of_shards(s, tp, dp, times=m) for s in strategy.stages)
    params = {id(p): p for s in strategy.stages for p in s.parameters()}.values()
    return sent + ring_sent_bytes("all_reduce", sum(p.numel() * 4 for p in params), dp)


def tensor_bytes(layout: dict, strategy, C: int, T: int, G: int) -> float:
    """Tensor (and sequence) parallelism's activations and partial gradients, the norm, and
    FSDP over dp of each rank's shards."""
    tp, dp, world = layout["tp"], layout["dp"], layout["tp"] * layout["dp"]
    model = strategy.model
    act = G // dp * T * C * 4  # (b, s, h) fp32: one replica's activations between blocks
    L = model.config.n_layer
    if layout.get("sp"):
        # Per block, forward and backward: 4 all-gathers of a (b, s / tp, h) shard and 4
        # reduce-scatters of (b, s, h), where tensor parallelism alone all-reduces 4 times.
        sent = 4 * L * ring_sent_bytes("all_gather", act / tp, tp)
        sent += 4 * L * ring_sent_bytes("reduce_scatter", act, tp)
        sent += 2 * ring_sent_bytes("all_gather", act / tp, tp)  # the head's input, embedding
        norms = [p for n, p in model.named_parameters() if "ln_" in n]
        sent += sum(ring_sent_bytes("all_reduce", _whole(p) * 4, tp) for p in norms)
    else:
        sent = 4 * L * ring_sent_bytes("all_reduce", act, tp)
    sent += ring_sent_bytes("all_reduce", 4, world)  # the squared norm
    if dp > 1:
        sent += _fsdp_of_shards(model, tp, dp)
    return sent


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


def _fsdp_of_shards(model, tp: int, dp: int, times: int = 1) -> float:
    """FSDP2 over dp of each rank's TP shards: comm_bytes.fsdp_formula on the shard shapes (meta
    tensors). In a pipeline the later microbatches' backwards find the blocks still gathered:
    torch's PipelineStage sets set_reshard_after_backward(False) until the last (counted: m + 1
    gathers of each block per step)."""
    shard = lambda p: torch.empty(_tp_shape(p, tp), device="meta")  # shape and dtype only
    return sum(fsdp_formula(model, dp, local=shard, times=times))


def context_bytes(layout: dict, strategy, C: int, T: int, G: int) -> float:
    """Ring attention's keys and values (and their gradients) per block, and DDP's all-reduce of
    every gradient over dp x cp."""
    cp, dp = layout["cp"], layout["dp"]
    kv = 2 * (G // dp) * (T // cp) * C * 4  # K and V: (b, s / cp, h) fp32 each
    L = strategy.model.config.n_layer
    sent = L * ((cp - 1) * kv + (cp - 1) * 2 * kv + kv)  # forward; backward K, V + grads; home
    params = sum(p.numel() * p.element_size() for p in strategy.model.parameters())
    return sent + ring_sent_bytes("all_reduce", params, dp * cp)


# The parameters tensor parallelism splits (the rest, embeddings, LayerNorms, the head and the
# row-parallel layers' biases, every rank holds whole).
TP_SPLIT = (
    "attn.qkv.weight",
    "attn.qkv.bias",
    "attn.proj.weight",
    "mlp.fc.weight",
    "mlp.fc.bias",
    "mlp.proj.weight",
)


def param_bytes(layout: dict, model) -> float | None:
    """What a rank should hold of the parameters: the split matrices / tp, everything / dp under
    FSDP (its padding aside). None for a pipeline (a stage's share depends on the cut)."""
    if layout["pp"] > 1:
        return None
    whole = type(model)(model.config)
    fsdp = layout["dp"] if layout["parallel"] == "fsdp" else 1
    split = lambda name: layout["tp"] if name.endswith(TP_SPLIT) else 1
    return sum(p.numel() * 4 / split(n) / fsdp for n, p in whole.named_parameters())


def activation_bytes(layout: dict, one_process: float) -> float | None:
    """What a rank should save for backward, from one process's: / dp (its share of the batch),
    / cp (its share of each window), / tp with sequence parallelism (its share of the positions
    everywhere). None where no single ratio holds: tensor parallelism alone splits the
    attention and MLP insides but not the LayerNorms and the residual stream; a pipeline holds
    its stages' microbatches."""
    if layout["pp"] > 1 or (layout["tp"] > 1 and not layout.get("sp")):
        return None
    return one_process / layout["dp"] / layout["cp"] / layout["tp"]


def sent_bytes(layout: dict, strategy, size: dict) -> float:
    """What this rank should send in one step, for any layout."""
    C, T, G = size["n_embd"], size["T"], layout["G"]
    if layout["pp"] > 1:
        return pipeline_bytes(layout, strategy, C, T, G)
    if layout["tp"] > 1:
        return tensor_bytes(layout, strategy, C, T, G)
    if layout["cp"] > 1:
        return context_bytes(layout, strategy, C, T, G)
    return data_parallel_bytes(layout, strategy)
