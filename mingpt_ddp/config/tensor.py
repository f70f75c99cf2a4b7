"""Tensor and sequence parallelism's settings (config section `tensor_config`): the code they
configure is mingpt_ddp/parallel/tensor.py."""

from __future__ import annotations

from dataclasses import dataclass

from mingpt_ddp.errors import ConfigError


@dataclass
class TensorConfig:
    """How each block's matrices are split over ranks (config section `tensor_config`). degree 1
    (the default) is no tensor parallelism; above 1, the ranks form a (dp, tp) grid: `degree`
    ranks share each block's matrices (Megatron's layout), world size / degree such groups are
    data-parallel (parallel=fsdp over them, or one group alone)."""

    degree: int = 1
    """Alias of mesh_config.tp. Ranks that split every block's matrices, heads and MLP columns
    (must divide the heads, the world size and 4 x n_embd). 1: no tensor parallelism."""
    sequence_parallel: bool = False
    """Also split the sequence between the split matmuls (LayerNorms, dropout and the residual
    stream on T / degree positions each): the same bytes sent as all-gather + reduce-scatter
    instead of all-reduce, and 1/degree of the activations there."""

    def __post_init__(self) -> None:
        if self.degree < 1:
            raise ConfigError(f"tensor_config.degree must be 1 or more, got {self.degree}")
