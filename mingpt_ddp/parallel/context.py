"""Context parallelism (mesh_config.cp, alias context_config.degree): ring attention over
sequence shards.

The cp ranks of a group read the same windows and each computes 2 of every window's 2 x cp chunks
of tokens (ring.balanced_positions), with their true positions for the position embeddings
(learned or rotary). Everything in a transformer but attention works on each token alone, so
only attention talks: its keys and values travel around the group's ring (ring.py). Activations
per rank fall as 1/cp, the way to train on windows too long for one device's memory.

Every rank of the group holds the same parameters, so their gradients are averaged over cp as
well as over the data-parallel ranks (parallelize.py: DDP over dp_cp, or FSDP over dp_shard_cp).
Each rank's loss is the mean over its own tokens and all hold as many, so that average is the
gradient of the whole batch's mean loss. Grown-up version of tutorials/ring_attention_by_hand.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.parallel.ring import RingAttention


def check_cp(model: nn.Module, degree: int) -> None:
    """Refuse a model the ring cannot run, naming the key."""
    cfg = model.config
    if cfg.block_size % (2 * degree):
        raise ConfigError(
            f"mesh_config.cp={degree} cuts each window into {2 * degree} chunks: "
            f"data_config.block_size={cfg.block_size} must be a multiple of {2 * degree}"
        )
    if cfg.attn_dropout:
        raise ConfigError(
            "ring attention has no attention dropout: set gpt_config.attn_dropout=0 with "
            "mesh_config.cp > 1"
        )


def apply_cp(model: nn.Module, mesh) -> RingAttention:
    """Every block's attention through the ring over the 1-D mesh "cp", and the model's forward
    handed this rank's positions while the ring is sharding (the whole model, or a pipeline
    stage: each is given (B, T / cp) tokens or activations). Returns the ring (its sharding()
    switches it on; sampling runs whole windows without it)."""
    check_cp(model, mesh.size())
    blocks = list(model.blocks.children())
    ring = RingAttention(mesh.get_group(), blocks[0].attn.attend)
    for block in blocks:
        block.attn.attend = ring
    inner = model.forward

    def forward(x: torch.Tensor, *args, positions: torch.Tensor | None = None):
        if ring.active and positions is None:  # (T / cp,): chunks from the middle and the end
            positions = ring.positions(x.size(1), ring.index, x.device)
        return inner(x, *args, positions=positions)

    model.forward = forward  # an instance attribute: nn.Module.__call__ finds it first
    return ring


def local_part(batch: tuple, ring: RingAttention) -> tuple:
    """This rank's chunks of each window: (x, y), (B, T / cp) each (the step's and evaluation's
    batches; the ring's forward then hands the model their positions)."""
    x, y = batch
    positions = ring.positions(x.size(1) // len(ring.ranks), ring.index, x.device)
    return x[:, positions], y[:, positions]
