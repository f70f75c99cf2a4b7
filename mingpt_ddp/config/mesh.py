"""The grid of ranks (config section `mesh_config`): one degree per parallelism, in one place.

The code they configure is mingpt_ddp/parallel/mesh.py (the one DeviceMesh) and
mingpt_ddp/parallel/parallelize.py (the ladder that applies each parallelism along its dimension).
Each parallelism's other settings stay in its own section (tensor_config.sequence_parallel,
pipeline_config.schedule, ...); their old `degree` keys are aliases of the keys here.
"""

from __future__ import annotations

from dataclasses import dataclass

from mingpt_ddp.errors import ConfigError

# The old keys, each an alias of one degree here: tensor_config.degree=2 is mesh_config.tp=2.
ALIASES = {
    "tp": "tensor_config.degree",
    "cp": "context_config.degree",
    "pp": "pipeline_config.degree",
}


@dataclass
class MeshConfig:
    """How many ranks along each dimension of the grid (config section `mesh_config`). Their
    product is the world size; -1 (the default of the two data-parallel degrees) takes the ranks
    the others leave, as torchtitan's dp_shard=-1 does."""

    dp_replicate: int = -1
    """Data-parallel ranks holding whole copies of what their group holds (DDP's replicas; with
    dp_shard > 1, HSDP's replica groups). -1: the rest of the world under parallel=ddp, 1 under
    parallel=fsdp."""
    dp_shard: int = -1
    """Data-parallel ranks each holding 1/dp_shard of the parameters, gradients and optimizer state
    (FSDP). -1: the rest of the world under parallel=fsdp, 1 under parallel=ddp."""
    tp: int = 1
    """Tensor parallelism: ranks splitting every block's matrices (Megatron's layout); alias
    tensor_config.degree."""
    cp: int = 1
    """Context parallelism: ranks splitting every window's tokens (ring attention); alias
    context_config.degree."""
    pp: int = 1
    """Pipeline parallelism: stages in a row (ranks per pipeline); alias pipeline_config.degree."""
    ep: int = 1
    """Expert parallelism: ranks sharing out every MoE block's experts (gpt_config.n_experts). Not
    a dimension of its own: its ranks are data-parallel ranks side by side, so it must divide
    dp_shard where FSDP shards (never spanning HSDP's replica groups), else dp_replicate."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard"):
            if getattr(self, name) == 0 or getattr(self, name) < -1:
                raise ConfigError(f"mesh_config.{name} must be -1 (the rest) or 1 or more")
        for name in ("tp", "cp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"mesh_config.{name} must be 1 or more, got {getattr(self, name)}"
                )


def model_degrees(mesh: MeshConfig, aliases: dict[str, int]) -> dict[str, int]:
    """{"tp", "cp", "pp"}: each degree from mesh_config, or from its old key (aliases: {"tp":
    tensor_config.degree, ...}); both set to different values is refused, naming them."""
    found = {}
    for name, key in ALIASES.items():
        new, old = getattr(mesh, name), aliases.get(name, 1)
        if new > 1 and old > 1 and new != old:
            raise ConfigError(
                f"mesh_config.{name}={new} and {key}={old} name the same degree: set one of them"
            )
        found[name] = max(new, old)
    return found


def data_degrees(mesh: MeshConfig, rest: int, parallel: str) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for the `rest` ranks the model-parallel degrees leave: -1 takes
    what the other leaves, by trainer_config.parallel (fsdp shards, every other mode replicates)."""
    replicate, shard = mesh.dp_replicate, mesh.dp_shard
    if shard == -1:
        shard = 1 if parallel != "fsdp" else -1
    if replicate == -1:
        replicate = 1 if shard == -1 else max(1, rest // shard)
    if shard == -1:
        shard = max(1, rest // replicate)
    if replicate * shard != rest:
        raise ConfigError(
            f"mesh_config.dp_replicate={replicate} x dp_shard={shard} must equal the {rest} "
            "data-parallel ranks the world leaves (world size / (tp x cp x pp)); set one to -1"
        )
    if shard > 1 and parallel != "fsdp":
        raise ConfigError(
            f"mesh_config.dp_shard={shard} shards parameters with FSDP2: set parallel=fsdp "
            f"(trainer_config.parallel={parallel} replicates; dp_shard=1 there)"
        )
    return replicate, shard
