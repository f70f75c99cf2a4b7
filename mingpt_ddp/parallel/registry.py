"""The parallel layouts by name (trainer_config.parallel): the grid, or an engine of its own.

none, ddp and fsdp, with any tensor, context and pipeline degrees (mesh_config), are one layout:
the grid (grid.py), every parallelism a dimension of one mesh, applied by one ladder. DeepSpeed
and Horovod bring engines of their own, and torchft's replica groups (torchft_config.groups > 0)
a manager around the grid's step. The modules are imported when first asked for, so a run imports
only its own (DeepSpeed's module imports DeepSpeed itself only when its engine is built).
"""

from __future__ import annotations

import importlib

import torch.nn as nn

from mingpt_ddp.errors import ConfigError

STRATEGIES = {
    "grid": "mingpt_ddp.parallel.grid:GridStrategy",  # parallel=none | ddp | fsdp
    "deepspeed": "mingpt_ddp.parallel.deepspeed:DeepSpeedStrategy",
    "horovod": "mingpt_ddp.parallel.horovod:HorovodStrategy",  # Horovod itself only when built
    # Not a value of trainer_config.parallel: chosen by torchft_config.groups > 0.
    "torchft": "mingpt_ddp.parallel.replica_groups:ReplicaGroupStrategy",
}


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def strategy_name(parallel: str, torchft_groups: int) -> str:
    """Which layout runs trainer_config.parallel (and torchft_config.groups)."""
    if torchft_groups:
        return "torchft"
    if parallel in ("none", "ddp", "fsdp"):
        return "grid"
    if parallel not in STRATEGIES:
        raise ConfigError(
            f"trainer_config.parallel={parallel} is not one of none, ddp, fsdp, deepspeed, horovod"
        )
    return parallel


def build_strategy(parallel: str, model: nn.Module, args):
    """The layout named by trainer_config.parallel, built around model (a strategy.Strategy)."""
    name = strategy_name(parallel, args.plan.torchft.groups)
    if model.config.n_experts and name != "grid":
        raise ConfigError(
            f"gpt_config.n_experts={model.config.n_experts} trains on the grid's layouts "
            f"(parallel=none, ddp or fsdp), not {name}: change one of them"
        )
    return _load(STRATEGIES[name])(model, args)
