"""The model and optimizer state of any layout as plain dicts keyed by the whole model's names.

One format for every layout: {"model": {name: tensor}, "optimizer": {"state": {name: {...}},
"param_groups": [...]}}, the names those of the whole model ("blocks.3.mlp.fc.weight") and the
fused QKV rows in their standard order. A layout holds pieces of it: a pipeline stage its names,
a tensor-parallel or FSDP rank DTensor shards of each tensor. Written whole (one file, rank 0)
where every rank holds every tensor alike, else as DCP shards (every rank its pieces, each
written once); read back into any layout: whole tensors are cut to it (to_layout), DCP shards
are resharded by DCP itself into this layout's own state dict (load_target).
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from mingpt_ddp.optim import own_kernels
from mingpt_ddp.parallel.tensor import to_layout


def whole_names(modules: list, optimizers: list, standard, sharded: bool) -> dict:
    """Every module's (the model, or this rank's stages) model and optimizer state, merged under
    the whole model's names. sharded: written as DCP, without param_groups (each rank's lists
    name only its own stages' parameters; a run takes its groups from its own config)."""
    model, optim = {}, {"state": {}, "param_groups": []}
    for module, opts in zip(modules, optimizers):
        model_sd, optim_sd = get_state_dict(module, opts)  # keyed by name, DDP's prefix dropped
        model.update(standard(model_sd))
        optim["state"].update(standard(optim_sd)["state"])
        optim["param_groups"] = merge_groups(optim["param_groups"], optim_sd["param_groups"])
    if sharded:
        del optim["param_groups"]
    return {"model": model, "optimizer": optim}


def merge_groups(mine: list, more: list) -> list:
    """Two modules' param_groups as one list: the same groups (decay, no decay, Muon's), their
    parameter names together."""
    if not mine:
        return [dict(group) for group in more]
    for group, other in zip(mine, more):
        group["params"] = [*group["params"], *other["params"]]
    return mine


def load_target(state: dict, tied: bool) -> dict:
    """What DCP fills from a snapshot: this layout's own tensors (every key a name of the whole
    model), without param_groups, which older snapshots keyed another way (per name, a
    pipeline's; as lists, FSDP's) and which the run takes from its config anyway. A last stage's
    tied head is read under the name every snapshot has, the embedding's (pick reads it back)."""
    model, optim = dict(state["model"]), dict(state["optimizer"]["state"])
    for sd in (model, optim):
        if tied and "lm_head.weight" in sd and "wte.weight" not in sd:
            sd["wte.weight"] = sd.pop("lm_head.weight")
    return {"model": model, "optimizer": {"state": optim}}


def load(modules: list, optimizers: list, tensors: dict, order: torch.Tensor) -> None:
    """Put a snapshot's tensors (whole, or already in this layout's DTensors) into each module and
    its optimizers; each takes the names it holds, its own param_groups, and its own kernels."""
    for module, opts in zip(modules, optimizers):
        model_sd, optim_sd = get_state_dict(module, opts)
        model = {name: pick(tensors["model"], name) for name in model_sd}
        saved = tensors["optimizer"]["state"]
        optim = {
            "state": {name: pick(saved, name) for name in optim_sd["state"]},
            "param_groups": optim_sd["param_groups"],
        }
        with own_kernels(opts):  # not the snapshot's: another layout's may differ
            set_state_dict(
                module,
                opts,
                model_state_dict=to_layout(model, model_sd, order),
                optim_state_dict=to_layout(optim, optim_sd, order),
            )


# The tied embedding/head matrix has two names; a whole model's state dict keeps one of them
# (torch's get_state_dict drops the duplicate), while a pipeline's last stage knows it as the head.
TIED = {"lm_head.weight": "wte.weight", "wte.weight": "lm_head.weight"}


def pick(saved: dict, name: str):
    """saved[name], or the tied matrix under its other name."""
    return saved[name] if name in saved or name not in TIED else saved[TIED[name]]


def whole_model(module: nn.Module, standard, is_main: bool) -> dict | None:
    """Collective: the whole model's tensors, QKV rows in their order, on rank 0 (None
    elsewhere)."""
    sd = standard(get_model_state_dict(module))
    whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}
    return whole if is_main else None


def write_dcp(state: dict, folder: str) -> str:
    """Collective: every rank writes its shards (its own keys, or its part of a DTensor) of
    state into folder; a tensor several ranks hold alike is written once."""
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder))
    return folder
