"""DeepSpeed ZeRO's state in the one snapshot format (state.py), and back.

ZeRO keeps each parameter three ways: the model's copy (bf16 or fp32; under stage 3 only a
partition of it), an fp32 master copy split over the ranks, and the optimizer's moments, split
alike, inside flat buffers that join many parameters. None of that is a whole model's state dict,
so ZeRO's own checkpoint files resume only at the stage and world size that wrote them.
deepspeed.utils gives each parameter back whole, by name:

    safe_get_full_fp32_param(p)              the fp32 master weight, whole (collective)
    safe_get_full_optimizer_state(p, key)    its exp_avg or exp_avg_sq, whole (collective)
    safe_set_full_fp32_param(p, value)       each rank keeps its part of value
    safe_set_full_optimizer_state(p, value, key)

The getters all-reduce (stages 1 and 2) or all-gather (stage 3) over the ranks, so every rank
calls them in the same order, and every rank ends up holding the whole state for a moment, as a
DDP rank always does. That is fine for the models of this project; a model too large for one
rank's memory would write DCP shards of each rank's partitions instead.

Two things deepspeed.utils does not do are done here through DeepSpeed's internals (0.19.8):
- the optimizer's moments exist only after the first step (torch's AdamW makes them lazily), so
  a resume makes them first (blank_moments) over the flat fp32 partitions ZeRO's optimizer steps
  (stage 3: fp32_partitioned_groups_flat; stages 1-2: single_partition_of_fp32_groups);
- stages 1-2 point each parameter at its slice of the moments once, after the first group's first
  step (_lazy_init_hp_params_optimizer_state), too early for the second group: link_moments
  links them again.
AdamW's step count, one per flat buffer, is the same for every parameter.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mingpt_ddp.parallel.state import pick

# DeepSpeed is an extra: it is imported inside the functions below, which run only once a run
# chose it (and deepspeed.py's import_deepspeed told it the accelerator).

MOMENTS = ("exp_avg", "exp_avg_sq")  # torch AdamW's state besides its step


def flat_partitions(zero) -> list[torch.Tensor]:
    """The fp32 buffers ZeRO's optimizer steps: this rank's partition of each group's parameters."""
    flats = getattr(zero, "fp32_partitioned_groups_flat", None)  # stage 3
    return list(flats if flats is not None else zero.single_partition_of_fp32_groups)


def whole_state(zero, model: nn.Module, groups: list[list[str]]) -> dict:
    """Collective: {"model", "optimizer"} keyed by the whole model's names, as state.py writes for
    every layout (on the CPU). groups: the parameter names of each of the optimizer's groups."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    named = list(model.named_parameters())  # the tied matrix once, as the embedding
    whole = {id(p): safe_get_full_fp32_param(p).cpu() for _, p in named}
    # the model's names as its state_dict has them: the tied matrix under both
    weights = {name: whole[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    inner = zero.optimizer  # torch's AdamW, stepping the flat partitions
    steps = [inner.state[flat]["step"] for flat in flat_partitions(zero) if flat in inner.state]
    moments = {}
    if steps:  # no moments before the first step
        link_moments(zero)
        for name, p in named:
            moments[name] = {"step": steps[0].detach().cpu().clone()}
            for key in MOMENTS:
                moments[name][key] = safe_get_full_optimizer_state(p, key).cpu()
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": names}
        for group, names in zip(inner.param_groups, groups)
    ]
    return {"model": weights, "optimizer": {"state": moments, "param_groups": param_groups}}


def blank_target(shapes: dict[str, torch.Size]) -> dict:
    """Whole tensors, zero, for DCP to fill from a sharded snapshot (state.load_target's shape)."""
    moments = {
        name: {"step": torch.zeros(()), **{key: torch.zeros(shape) for key in MOMENTS}}
        for name, shape in shapes.items()
    }
    return {
        "model": {n: torch.zeros(s) for n, s in shapes.items()},
        "optimizer": {"state": moments},
    }


def load_whole_state(zero, model: nn.Module, tensors: dict) -> None:
    """Put whole tensors (any layout's snapshot) into the model's copy, the fp32 master copy and
    the optimizer's moments; each rank keeps its part."""
    from deepspeed.runtime.zero import GatheredParameters
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    named = list(model.named_parameters())
    device = next(iter(flat_partitions(zero))).device
    weights = {name: pick(tensors["model"], name).to(device) for name, _ in named}
    # The model's copy: under stage 3 gathered whole, changed on every rank alike, and split again
    # as the context exits (a no-op for stages 1-2, whose ranks hold it whole).
    with torch.no_grad(), GatheredParameters([p for _, p in named], modifier_rank=0):
        for name, p in named:
            p.copy_(weights[name])
    for name, p in named:
        safe_set_full_fp32_param(p, weights[name])
    saved = tensors["optimizer"]["state"]
    if not saved:
        return  # written before the first step
    blank_moments(zero, float(next(iter(saved.values()))["step"]))
    for name, p in named:
        for key in MOMENTS:
            safe_set_full_optimizer_state(p, pick(saved, name)[key].to(device), key)


def blank_moments(zero, step: float) -> None:
    """AdamW's state for every flat partition, as its first step would make it, at `step`; then
    linked to the parameters (stages 1-2) so that safe_set_full_optimizer_state finds it."""
    inner = zero.optimizer
    fused = any(g.get("fused") or g.get("capturable") for g in inner.param_groups)
    for flat in flat_partitions(zero):
        # AdamW keeps its step on the CPU unless fused or capturable (torch/optim/adamw.py)
        where = flat.device if fused else torch.device("cpu")
        inner.state[flat] = {
            "step": torch.tensor(step, dtype=torch.float32, device=where),
            **{key: torch.zeros_like(flat) for key in MOMENTS},
        }
    link_moments(zero)


def link_moments(zero) -> None:
    """Stages 1-2: point each parameter at its slice of the moments, which safe_get/set_full_
    optimizer_state read. DeepSpeed 0.19.8 links them once, right after the first group's first
    step, before the other groups (AdamW's no-decay group) have any: linked again here, they
    are found. Stage 3 finds them in the optimizer's state on each call."""
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
