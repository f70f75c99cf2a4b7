"""The parallel modes by name (trainer_config.parallel), and the snapshot layouts they declare.

Adding a mode: write its module (the contract is strategy.py), then name it here. The modules
are imported when first asked for, so a run imports only its own mode (DeepSpeed's module
imports DeepSpeed itself only when its engine is built).
"""

from __future__ import annotations

import importlib

import torch.nn as nn

from mingpt_ddp.errors import ConfigError

STRATEGIES = {
    "none": "mingpt_ddp.parallel.single:Single",
    "ddp": "mingpt_ddp.parallel.ddp:DDPStrategy",
    "fsdp": "mingpt_ddp.parallel.fsdp:FSDPStrategy",
    "deepspeed": "mingpt_ddp.parallel.deepspeed:DeepSpeedStrategy",
    "horovod": "mingpt_ddp.parallel.horovod:HorovodStrategy",  # Horovod itself only when built
    # Not a value of trainer_config.parallel: chosen by pipeline_config.degree > 1, with its
    # replicas over ddp or fsdp (parallel=).
    "pipeline": "mingpt_ddp.parallel.pipeline:PipelineStrategy",
    # Likewise: tensor_config.degree > 1 (dp over fsdp), context_config.degree > 1 (dp over ddp).
    "tensor": "mingpt_ddp.parallel.tensor:TensorParallelStrategy",
    "context": "mingpt_ddp.parallel.context:ContextParallelStrategy",
    # Likewise: torchft_config.groups > 0, each replica group a torchrun job of its own.
    "torchft": "mingpt_ddp.parallel.replica_groups:ReplicaGroupStrategy",
}


KEYS = {"pp": "pipeline_config.degree", "tp": "tensor_config.degree", "cp": "context_config.degree"}


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def build_strategy(parallel: str, model: nn.Module, args):
    """The strategy named by trainer_config.parallel, built around model (a strategy.Strategy)."""
    split = [name for name, degree in args.plan.degrees().items() if degree > 1]
    if split == ["pp", "tp"]:  # tensor-parallel stages (pipeline.py)
        split = ["pp"]
    if len(split) > 1:
        raise ConfigError(
            f"{' x '.join(split)} is not built yet (pp x tp is): set "
            f"{' or '.join(f'{KEYS[k]}=1' for k in split)}"
        )
    if split:
        parallel = {"pp": "pipeline", "tp": "tensor", "cp": "context"}[split[0]]
    if args.plan.torchft.groups:
        if split:
            raise ConfigError(
                "torchft_config.groups > 0 runs each replica group as one process: set "
                f"{' and '.join(f'{KEYS[k]}=1' for k in split)}"
            )
        parallel = "torchft"
    if parallel not in STRATEGIES:
        raise ConfigError(
            f"trainer_config.parallel={parallel} is not one of {', '.join(STRATEGIES)}"
        )
    return _load(STRATEGIES[parallel])(model, args)


def file_layouts() -> dict:
    """{kind: FileLayout} of every mode whose snapshots are written by all ranks (for the store)."""
    layouts = (_load(path).layout for path in STRATEGIES.values())
    return {layout.kind: layout for layout in layouts if layout is not None}
