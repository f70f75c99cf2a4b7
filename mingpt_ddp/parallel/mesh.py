"""The grid of ranks: every parallelism a named dimension of one DeviceMesh, built once.

The world's ranks are laid out as a grid with five dimensions, outermost first:

    pp            pipeline stages: a row of pp ranks runs the blocks one stage after another
    dp_replicate  data-parallel replicas: whole copies of what their group holds (DDP, HSDP)
    dp_shard      data-parallel shards: each holds 1/dp_shard of every parameter (FSDP)
    cp            context parallelism: each holds 1/cp of every window's tokens (ring attention)
    tp            tensor parallelism: each holds 1/tp of every block's matrices

Global rank = ((((pp_i * dp_replicate + r) * dp_shard + s) * cp + c) * tp + t): tp varies
fastest, so a tensor-parallel group is the closest ranks (one node, the fastest links: TP talks in
every layer), and pp the slowest (a pipeline hands on activations once per stage). Ranks that
differ only in dp_replicate and dp_shard read different windows; every other dimension's ranks
read the same windows (one replica of the model, spread over them).

Expert parallelism (mesh_config.ep) adds no dimension: its groups are data-parallel ranks side by
side, a second mesh over the same ranks (expert.py's expert_mesh).

Three views of the same ranks are flattened dimensions of the one mesh (DeviceMesh._flatten,
private in torch 2.13, as torchtitan uses it):
    dp           dp_replicate x dp_shard: who reads which data, and who averages the loss
    dp_shard_cp  dp_shard x cp: FSDP shards over it (cp's ranks hold the same parameters, so their
                 gradients are summed there too, as torchtitan folds cp into FSDP)
    dp_cp        dp_replicate x dp_shard x cp: every rank holding the same parameters of a stage,
                 with plain (not DTensor) parameters the group DDP averages over
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mingpt_ddp.config.mesh import data_degrees
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.parallel.expert import expert_mesh

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


@dataclass(frozen=True)
class ParallelDims:
    """The degree of each dimension; their product is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    """Expert parallelism: not a dimension of the grid, dp's ranks in groups of ep (expert.py)."""

    @classmethod
    def of(cls, world_size: int, degrees: dict[str, int], mesh_cfg, parallel: str) -> ParallelDims:
        """The grid for world_size ranks: degrees {"tp", "cp", "pp"} as asked, the data-parallel
        ranks what they leave (config/mesh.py's data_degrees). Refused, naming the keys, if they do
        not divide the world."""
        split = degrees["tp"] * degrees["cp"] * degrees["pp"]
        if world_size % split:
            named = " x ".join(f"mesh_config.{k}={v}" for k, v in degrees.items() if v > 1)
            raise ConfigError(
                f"the model-parallel degrees ({named} = {split} ranks) must divide the world size "
                f"{world_size}; launch a multiple of {split} processes or change the degrees"
            )
        replicate, shard = data_degrees(mesh_cfg, world_size // split, parallel)
        # Expert groups are data-parallel ranks side by side: within a shard group where FSDP
        # shards (HSDP's replica groups may sit on slower links), else among the replicas.
        within, name = (shard, "dp_shard") if shard > 1 else (replicate, "dp_replicate")
        if within % mesh_cfg.ep:
            raise ConfigError(
                f"mesh_config.ep={mesh_cfg.ep} must divide mesh_config.{name}={within}: its "
                "groups are data-parallel ranks side by side"
            )
        return cls(degrees["pp"], replicate, shard, degrees["cp"], degrees["tp"], mesh_cfg.ep)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many shares each global batch is cut into."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def shape(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DIMS}

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (row-major: tp varies fastest), and along dp."""
        found, shape = {}, self.shape()
        for name in reversed(DIMS):
            rank, found[name] = divmod(rank, shape[name])
        found["dp"] = found["dp_replicate"] * self.dp_shard + found["dp_shard"]
        return {name: found[name] for name in (*DIMS, "dp")}

    def build(self, device: torch.device) -> Grid:
        """The one DeviceMesh of the run, with its flattened views. Collective: every rank builds
        the same mesh (each dimension's process groups are created once, here)."""
        mesh = init_device_mesh(device.type, tuple(self.shape().values()), mesh_dim_names=DIMS)
        views = {name: mesh[dims]._flatten(name) for name, dims in FLATTENED.items()}
        if self.ep > 1:  # a second view of the same ranks, for the experts (expert.py)
            experts = expert_mesh(self, device.type)
            views.update(ep=experts["ep"], expert_dp=experts["expert_dp"], experts=experts)
        return Grid(mesh, views)


class Grid:
    """The mesh and its flattened views, each asked for by name: grid["tp"], grid["dp_cp"],
    grid["dp_replicate", "dp_shard_cp"] (HSDP's 2-D view)."""

    def __init__(self, mesh: DeviceMesh, views: dict[str, DeviceMesh]):
        self.mesh, self.views = mesh, views  # torch 2.13 asks that the flattened ones be kept

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str) and names in self.views:
            return self.views[names]
        if isinstance(names, str) or all(name in DIMS for name in names):
            return self.mesh[names]
        # A view mixing a dimension with a flattened one: torch 2.13 slices it from the root
        # mesh (and warns that a later version will not; torchtitan builds it with _unflatten).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return self.mesh[names]
