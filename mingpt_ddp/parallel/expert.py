"""Expert parallelism (mesh_config.ep): each rank of an expert-parallel group holds n_experts / ep
of every MoE block's experts, and tokens travel to their experts and back by all-to-all.

In one process a MoE block (mingpt_ddp/moe.py) groups its token rows by expert and runs each
group through its expert. Here the experts are cut along their first dimension (a DTensor,
Shard(0) over "ep"), and `exchange` becomes ExpertExchange:

    1. counts    all_to_all of the per-expert counts (E,): now every rank knows how many rows
                 it will receive from each rank for each of its experts. The rows' all-to-all
                 needs those sizes before it starts (uneven splits), hence this exchange first.
    2. dispatch  all_to_all of the rows: to rank j the rows chosen for rank j's experts. Rows for
                 this rank's own experts stay here: an all-to-all sends nothing to itself.
    3. compute   the received rows, regrouped by expert, through this rank's experts.
    4. combine   all_to_all back: every output row returns to the rank its token came from.

Backward runs 2 and 4 in reverse (an all-to-all's gradient is the all-to-all with the splits
swapped): four exchanges of rows per MoE block per step, and one of counts.

Where the ranks come from: the ep ranks are data-parallel ranks (dp_replicate x dp_shard,
innermost first), which read different batches and so bring different tokens, as DeepSpeed-MoE
lays them out. (torchtitan borrows them from dp_shard x cp x tp instead: not built here.) The
ranks that hold the same experts, one per ep group (the "expert_dp" dimension: dp / ep x cp),
average the experts' gradients themselves (reduce_expert_gradients), so DDP and FSDP leave the
experts out. The divisor is dp x cp, not the group's size: each rank's experts already summed
the gradients of the ep ranks whose tokens they served.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.moe import MoE, moe_layers, recomputing

EXPERT_WEIGHTS = ("w1", "w2")


def expert_mesh(dims, device_type: str) -> DeviceMesh:
    """A second view of the world's ranks, (pp, tp, expert_dp, ep): "ep" the groups that share
    out the experts (dp ranks side by side), "expert_dp" the ranks holding the same experts.
    Collective: every rank builds it."""
    ranks = torch.arange(dims.world_size).view(
        dims.pp, dims.dp // dims.ep, dims.ep, dims.cp, dims.tp
    )  # the grid's order (mesh.py), dp cut into (dp / ep, ep)
    ranks = ranks.permute(0, 4, 1, 3, 2).reshape(dims.pp, dims.tp, -1, dims.ep)
    return DeviceMesh(device_type, ranks, mesh_dim_names=("ep_pp", "ep_tp", "expert_dp", "ep"))


class ExpertExchange:
    """MoE.exchange across an expert-parallel group (the module docstring's steps 1-4). Keeps,
    per forward, the rows sent to each rank and the rows received: the bytes and the load."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.size = group, dist.get_world_size(group)
        self.sent: list[list[int]] = []  # per forward: rows to each rank of the group
        self.received: list[list[int]] = []  # per forward: rows from each rank of the group
        self.recomputed: list[bool] = []  # per forward: run again in backward (checkpointing)
        self.last: tuple[list, list, list] = ([], [], [])  # the last step's three lists

    def end_step(self) -> int:
        """Keep this step's rows as `last`, start the next; the rows this rank computed."""
        self.last = (self.sent, self.received, self.recomputed)
        self.sent, self.received, self.recomputed = [], [], []
        return sum(sum(rows) for rows in self.last[1])

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, compute) -> torch.Tensor:
        ep, here = self.size, counts.numel() // self.size
        theirs = torch.empty_like(counts)  # (E,) -> from each rank, a count per expert of mine
        dist.all_to_all_single(theirs, counts, group=self.group)
        theirs = theirs.view(ep, here)  # (source rank, my expert)
        send = counts.view(ep, here).sum(1).tolist()  # rows to each rank
        recv = theirs.sum(1).tolist()  # rows from each rank
        got = funcol.all_to_all_single_autograd(rows, recv, send, self.group)  # (R, C)
        # Received rows come by source, then expert: regroup them by expert (sources in order).
        expert = torch.arange(here, device=rows.device).repeat(ep)
        order = torch.argsort(expert.repeat_interleave(theirs.flatten()), stable=True)
        out = compute(got[order], theirs.sum(0))  # (R, C)
        back = out[torch.argsort(order)]  # by source again
        if torch.is_grad_enabled():  # a training forward (evaluation's are not the step's)
            self.sent.append(send)
            self.received.append(recv)
            self.recomputed.append(recomputing())  # activation checkpointing, in backward
        return funcol.all_to_all_single_autograd(back, send, recv, self.group)


def check_ep(cfg, dims, sequence_parallel: bool = False) -> None:
    """Refuse an expert-parallel degree, or a mixture of experts, the grid cannot take, naming
    the key."""
    if cfg.n_experts and sequence_parallel and dims.tp > 1:
        raise ConfigError(
            "tensor_config.sequence_parallel=true is not built with gpt_config.n_experts (the "
            "MoE block would route a tp rank's sequence shard only): set it to false"
        )
    if cfg.n_experts and cfg.aux_loss_coef and dims.cp > 1:
        raise ConfigError(
            "gpt_config.aux_loss_coef > 0 takes each sequence's statistics, and mesh_config.cp "
            "splits sequences: set aux_loss_coef=0 and balance with gpt_config.bias_update_rate"
        )
    if dims.ep > 1 and not cfg.n_experts:
        raise ConfigError(
            f"mesh_config.ep={dims.ep} splits experts, and the model has none: set "
            "gpt_config.n_experts (a multiple of ep) or mesh_config.ep=1"
        )
    if cfg.n_experts % dims.ep:
        raise ConfigError(
            f"mesh_config.ep={dims.ep} must divide gpt_config.n_experts={cfg.n_experts}: each "
            "rank holds an equal share of the experts"
        )


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> None:
    """Cut every MoE block's experts over the 1-D mesh "ep" in place (each rank keeps its
    n_experts / ep, from the same initial weights on every rank) and route through all-to-all."""
    for moe in moe_layers([model]):
        for name in EXPERT_WEIGHTS:
            whole = getattr(moe, name)
            piece = distribute_tensor(whole.data, mesh, [Shard(0)], src_data_rank=None)
            setattr(moe, name, nn.Parameter(piece))
        moe.exchange = ExpertExchange(mesh.get_group())


def expert_params(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The experts' weights cut by apply_ep (DTensors over "ep"), which DDP and FSDP leave out."""
    return [
        getattr(moe, name)
        for moe in moe_layers(modules)
        for name in EXPERT_WEIGHTS
        if isinstance(getattr(moe, name), DTensor)
    ]


class ExpertStep:
    """A layout's MoE blocks (none: it does nothing), and what each step does for them beside
    the Trainer's step: the balance loss scaled as the step's loss is, the experts that ep
    shared out averaged over the ranks holding the same ones (DDP and FSDP average the rest),
    the routers' biases moved by the step's tokens per expert over every rank, and that balance
    for the log line."""

    def __init__(self, modules: list[nn.Module], dims, views: dict):
        self.layers, self.params, self.dims = moe_layers(modules), expert_params(modules), dims
        readers = dims.dp * dims.cp  # the ranks that read different tokens
        shared_out = self.params and readers > dims.ep
        self.replicas = views["expert_dp"].get_group() if shared_out else None
        self.readers = views["dp_cp"].get_group() if self.layers and readers > 1 else None
        self.routed: torch.Tensor | None = None  # the last step's tokens per expert (layers, E)
        self.received = 0  # the rows this rank's experts computed in the last step

    def scale_balance_loss(self, scale: float) -> None:
        """moe.AuxGradient's scale: what the step multiplies its loss by before backward."""
        for layer in self.layers:
            layer.aux_scale = scale

    def after_backward(self) -> None:
        if self.layers:
            reduce_expert_gradients(self.params, self.replicas, self.dims.dp * self.dims.cp)
            self.received, self.routed = end_step(self.layers), rebalance(self.layers, self.readers)

    def words(self, model: nn.Module, whole: bool) -> str:
        """For the start-up line: the experts, the parameters a token meets (whole: the model is
        not a pipeline stage, which holds some blocks only), and how ep shares them out."""
        if not self.layers:
            return ""
        E, ep = model.config.n_experts, self.dims.ep
        words = f", {E} experts top {model.config.top_k}"
        words += f" ({model.active_params() / 1e6:.2f}M parameters active)" if whole else ""
        if ep > 1:  # its ranks are the replicas
            words += f", expert parallel {ep} ({E // ep} of {E} experts each)"
        return words

    def record(self, record: dict, control) -> str:
        """Collective (log steps): the last step's tokens per expert and rows per rank into the
        metrics record; the words for the log line."""
        if self.routed is None:
            return ""
        received = control.gather(self.received) if self.dims.ep > 1 else []
        fields, words = load_words(self.routed, received)
        record.update(fields)
        return words


def reduce_expert_gradients(params: list, group: dist.ProcessGroup | None, divisor: int) -> None:
    """Average the experts' gradients over the data: summed over the ranks holding the same
    experts (group; None: there are none), divided by dp x cp (the module docstring)."""
    grads = [p.grad.to_local() for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])  # one all-reduce for every layer's experts
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat /= divisor
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


@torch.no_grad()
def rebalance(layers: list[MoE], group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """After a step: each layer's tokens per expert summed over the ranks that read different
    tokens (group: dp x cp; None: one process), each layer's routing bias moved by them (the
    same on every rank), the counts reset. Returns the counts (layers, E), or None."""
    routed = [layer.routed for layer in layers if layer.routed is not None]
    if not routed or len(routed) < len(layers):
        return None
    counts = torch.stack(routed).float()  # (layers, E)
    if group is not None:
        dist.all_reduce(counts, group=group)
    for layer, row in zip(layers, counts):
        layer.rebalance(row)
    return counts


def end_step(layers: list[MoE]) -> int:
    """The rows this rank's experts computed in the step just done (every MoE block's), each
    exchange's log kept as its `last` and started afresh."""
    return sum(layer.exchange.end_step() for layer in layers if hasattr(layer.exchange, "last"))


def load_words(routed: torch.Tensor, received: list[int]) -> tuple[dict, str]:
    """The step's balance as metrics and words: tokens per expert (layers x E, over all ranks),
    the experts' imbalance (max over mean, averaged over the blocks), and, under expert
    parallelism, the ranks' (the rows each computed: max over mean)."""
    experts = (routed.max(1).values / routed.mean(1).clamp(min=1e-9)).mean().item()
    fields = {"tokens_per_expert": routed.round().int().tolist(), "expert_load": round(experts, 3)}
    words = f" | experts max/mean {experts:.2f}"
    if len(received) > 1:
        ranks = max(received) / max(1e-9, sum(received) / len(received))
        fields["rank_load"] = round(ranks, 3)
        words += f", ranks {ranks:.2f}"
    return fields, words
