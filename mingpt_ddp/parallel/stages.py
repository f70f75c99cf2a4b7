"""Cutting the GPT into pipeline stages, and where each stage and each replica lives.

The pipeline is the outermost dimension of the grid (mesh.py): global rank = pp_rank x (the ranks
of one stage) + the rank's place among them. A *row* (every pp_rank, the same place otherwise) is
one whole pipeline, one replica of the model (or its tp and cp ranks' share of one); a *column*
(one pp_rank) holds the same stage in every replica and goes through the same ladder as a whole
model would (parallelize.py: its tp, cp and data-parallel ranks). With 4 ranks, 2 stages x 2
replicas:

    stage 0: ranks 0, 1   (replica 0, replica 1)
    stage 1: ranks 2, 3

Every rank of a row reads the same windows (its replica's share of the global batch).

A stage is a copy of the model with the parts it does not hold set to None: blocks [lo, hi), the
token and position embeddings on the first stage, the final LayerNorm and the head on the last.
Every parameter keeps the name it has in the whole model ("blocks.3.mlp.fc.weight"), so a stage's
state dict is a piece of the whole model's and snapshots written by one cut load into another.
With tied embeddings the first and the last stage each hold a copy of the one tied matrix (as
"wte.weight" and "lm_head.weight", the names the whole model's state dict has for it too).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.moe import moe_layers


def block_ranges(n_layer: int, stages: int) -> list[range]:
    """The blocks of each stage, as even as whole blocks allow (the earlier stages take one more:
    the last stage also runs the head and the loss)."""
    if stages > n_layer:
        raise ConfigError(
            f"a pipeline of {stages} stages needs at least {stages} blocks, the model has "
            f"{n_layer}: lower pipeline_config.degree (or stages_per_rank), or raise "
            "gpt_config.n_layer"
        )
    size, extra = divmod(n_layer, stages)
    starts = [i * size + min(i, extra) for i in range(stages + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(stages)]


def cut(model: nn.Module, blocks: range, first: bool, last: bool) -> nn.Module:
    """A copy of model holding only `blocks` (with the embeddings if first, the final LayerNorm
    and the head if last), parameter names unchanged. Its forward is model.run: activations (or
    token ids) in, activations (or logits) out, which is what torch's PipelineStage passes on."""
    stage = copy.deepcopy(model)
    # A ModuleDict keyed by the block's number keeps the names "blocks.<i>." of the whole model.
    stage.blocks = nn.ModuleDict({str(i): stage.blocks[i] for i in blocks})
    if not first:
        stage.wte = stage.wpe = None
    if not last:
        stage.ln_f = stage.lm_head = None
    stage.forward = stage.run  # an instance attribute: nn.Module.__call__ finds it first
    return stage


def placement(degree: int, stages: int, v_shaped: bool) -> dict[int, int]:
    """Which rank of a row (0 .. degree - 1) holds each stage. Looped (every schedule but the
    V-shaped ones): stage i on rank i % degree, consecutive stages on consecutive ranks. V (zbv,
    dualpipev): down the ranks and back up, 2 stages a rank, so rank 0 holds the first stage and
    the last (the embedding and the head, tied, on one rank) and rank degree - 1 two neighbours
    (a hand-off with no send). torch's own map, which its schedules use to send and receive."""
    return generate_stage_to_rank_mapping(degree, stages, style="v" if v_shaped else "loop")


def stage_ids(pp_rank: int, rank_of: dict[int, int]) -> list[int]:
    """The stages a rank holds, in order."""
    return sorted(stage for stage, rank in rank_of.items() if rank == pp_rank)


def forward_through(
    stages: list[nn.Module], ids: list[int], row: list[int], x: torch.Tensor, rank_of: dict
) -> torch.Tensor | None:
    """Collective over one row: token ids x (B, T) through every stage in order, each stage's
    (B, T, C) output sent in fp32 from its rank to the next stage's (row: the row's global ranks
    in pp order; stages, ids: this rank's; rank_of: placement()). A plain forward of any batch
    shape, for evaluation; returns the logits (B, T, V) on the rank of the last stage, None on
    the others."""
    mine, h, n_stages = dict(zip(ids, stages)), x, len(rank_of)
    me, width = rank_of[ids[0]], stages[0].config.n_embd
    for i in mine:  # ascending: a rank's later stage comes after its earlier one's output
        if i > 0 and rank_of[i - 1] != me:
            h = torch.empty(*x.shape, width, device=x.device)  # (B, T, C)
            dist.recv(h, src=row[rank_of[i - 1]])
        h = mine[i](h)
        if i < n_stages - 1 and rank_of[i + 1] != me:  # (a V's turn stays on its rank)
            dist.send(h.float().contiguous(), dst=row[rank_of[i + 1]])
    return h if ids[-1] == n_stages - 1 else None


class Stage(PipelineStage):
    """torch's PipelineStage, its first-step shape inference kept away from DDP's gradient sync
    and from context parallelism's ring.

    On its first step the stage runs its module once to learn the shapes it will send
    (_forward_metadata_inference, torch 2.13): on the real input (first stage) or on uninitialised
    tensors built on its device from the shapes received (TensorMeta.to_tensor; real memory, not
    meta tensors), with gradients on and outside DDP's no_sync.
    DDP's forward then arms the reducer (prepare_for_backward), so the first real microbatch's
    backward, meant to accumulate locally, all-reduces and records every parameter for DDP's
    bucket rebuild; the last microbatch records them again. 1F1B survives it (the rebuild comes
    between, the extra average is harmless arithmetic), but under GPipe the next step's first
    forward fails DDP's check ("rebuilt parameter indices size is not same as original model
    parameters size ... 26 versus 52"). Run under no_sync, the inference arms nothing. The ring
    is off for it too: the local kernel gives the same shapes without sending uninitialised
    tensors around the ring (or counting them in its bytes). MoE blocks route no token for it:
    its tensors are uninitialised memory, not tokens to count or send to experts.
    Older torch (2.11 on an H200, docs/measured.md) has no such method: its _shape_inference runs
    the forward under no_grad, which arms nothing, and the pipeline tests passed there."""

    def __init__(self, *args, ring=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.ring = ring

    # Each action's compute as a named region of a profiler trace ("stage 1 F0": stage 1's forward
    # of microbatch 0; B a whole backward, I and W its input and weight halves), the same names
    # under every schedule: what benchmarks/timeline.py draws.
    def forward_one_chunk(self, chunk: int, *args, **kwargs):
        with record_function(f"stage {self.stage_index} F{chunk}"):
            return super().forward_one_chunk(chunk, *args, **kwargs)

    def backward_one_chunk(self, chunk: int, *args, full_backward: bool = True, **kwargs):
        with record_function(f"stage {self.stage_index} {'B' if full_backward else 'I'}{chunk}"):
            return super().backward_one_chunk(chunk, *args, full_backward=full_backward, **kwargs)

    def backward_weight_one_chunk(self, chunk: int, *args, **kwargs):
        with record_function(f"stage {self.stage_index} W{chunk}"):
            return super().backward_weight_one_chunk(chunk, *args, **kwargs)

    def _forward_metadata_inference(self, *args, **kwargs):
        quiet = self.submod.no_sync() if isinstance(self.submod, DDP) else nullcontext()
        active = self.ring is not None and self.ring.active
        if active:
            self.ring.active = False
        experts = moe_layers([self.submod])
        for layer in experts:
            layer.routing = False
        try:
            with quiet:
                return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            if active:
                self.ring.active = True
            for layer in experts:
                layer.routing = True


def check_microbatches(windows: int, microbatches: int) -> None:
    """A replica's step must cut into equal microbatches: the schedule averages their mean losses,
    which is the batch's mean only if they are the same size."""
    if windows % microbatches:
        raise ConfigError(
            f"a step's {windows} windows per pipeline (batch_size x grad_accum_steps) do not cut "
            f"into pipeline_config.microbatches={microbatches} equal pieces; make the "
            "microbatches divide them"
        )
