"""Activation checkpointing (trainer_config.activation_checkpointing): memory bought with compute.

Backward needs what forward computed. Each block keeps its LayerNorm outputs, queries, keys and
values, the attention output, the MLP's 4C-wide hidden layer and more, some twenty (B, T, C)-sized
tensors, alive from the block's forward until its backward: the bulk of a step's memory. A
checkpointed block keeps only its input; when backward reaches it, its forward runs again to
rebuild the rest, which its backward uses and frees at once. The price is that second forward of
each checkpointed block. benchmarks/activation_memory.py measures both: at the default model and
batch (fp32, 2 CPU cores), full checkpointing brings the peak down to 35% for a step 37% slower.

Which blocks, for every-K: the first and every K-th after it (0, K, 2K, ...), not the K-th,
2K-th... (torchtitan's ac_freq). Backward visits the blocks last to first, so a block's recompute
happens while the blocks before it still hold what they saved: checkpointing the last block
rebuilds its activations beside everything else, and the peak hardly falls (every-2 on gpt-micro:
78% of none), where checkpointing the first of each pair leaves half the blocks holding theirs
(57%).

How: torch.utils.checkpoint.checkpoint with use_reentrant=False, put in place of each chosen
block's forward on the instance (block.forward), nothing else changed:
- Non-reentrant checkpointing works through saved-tensor hooks (it packs a handle, and recomputes
  on the first unpack in backward), so gradients flow through the one ordinary autograd graph:
  DDP's gradient hooks fire once per parameter, in order (the reentrant variant runs a backward
  inside backward, which DDP tolerates only with static_graph, and it gives parameters no
  gradients when no input requires one); FSDP2's hooks stay on the block's __call__, outside the
  region, so its pre-backward all-gather has put the parameters in place before the recompute
  (torchtitan's arrangement); and torch.compile traces it as one tagged region whose insides
  AOTAutograd's partitioner recomputes in backward (gpt-micro, full: the compiled forward hands
  backward 4.8 MB instead of 21.9).
- The module tree and every parameter name stay as they are, so state dicts, snapshots and the
  optimizers' parameter names are the same with and without it, and a run resumes across the
  switch. torch's checkpoint_wrapper would put each block inside a wrapper module, inserting
  `_checkpoint_wrapped_module.` into every parameter name (its state_dict hooks strip it from
  state_dict(), not from named_parameters()); the composable torch.distributed._composable
  .checkpoint keeps names, through forward hooks, but under torch.compile (torch 2.13) its
  recompute fails ("Recomputed values ... have different metadata").
- The RNG state is saved with each region (preserve_rng_state), so dropout draws the same masks
  when the block is recomputed: losses and gradients equal those without checkpointing.

model.py knows nothing of this: the strategies call apply_activation_checkpointing while they wrap
the model, first, before compile and before DDP or FSDP wrap it (torchtitan's order: TP, AC,
compile, FSDP), or DeepSpeed's engine takes it (under ZeRO-3 the recompute runs its per-layer
gathering hooks again, inside backward: it trains the same losses as DDP without checkpointing).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from mingpt_ddp.config.trainer import checkpoint_every


def checkpointed(forward, *args, **kwargs):
    """forward(*args, **kwargs) as a checkpointed region, where a backward is to come."""
    if not torch.is_grad_enabled():  # evaluation and sampling save nothing: plain forward
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def apply_activation_checkpointing(model: nn.Module, spec: str) -> int:
    """Checkpoint the blocks of model.blocks that spec names (none, full, every-K), in place;
    returns how many are checkpointed. Applying it twice checkpoints no block twice."""
    every = checkpoint_every(spec)
    # By the block's number in the whole model (a pipeline stage's blocks keep theirs as names).
    chosen = [b for name, b in model.blocks.named_children() if every and int(name) % every == 0]
    for block in chosen:
        if getattr(block.forward, "func", None) is not checkpointed:
            # An instance attribute: nn.Module.__call__ finds it before the class's forward.
            block.forward = functools.partial(checkpointed, block.forward)
    return len(chosen)


def checkpointing_words(checkpointed_blocks: int, blocks: int) -> str:
    """What the start-up line says of it (nothing when off)."""
    if not checkpointed_blocks:
        return ""
    return f" + activation checkpointing ({checkpointed_blocks} of {blocks} blocks)"
