"""Context parallelism's settings (config section `context_config`): the code they configure is
mingpt_ddp/parallel/context.py."""

from __future__ import annotations

from dataclasses import dataclass

from mingpt_ddp.errors import ConfigError


@dataclass
class ContextConfig:
    """How each window's tokens are split over ranks (config section `context_config`). degree 1
    (the default) is none; above 1, the ranks form a (dp, cp) grid: `degree` ranks hold the
    same windows, each two of its 2 x degree chunks, and ring attention passes keys and values
    between them; world size / degree such groups are data-parallel."""

    degree: int = 1
    """Alias of mesh_config.cp. Ranks that split every window's tokens (2 x degree must divide
    the block size and the world size must be a multiple of it). 1: no context parallelism."""

    def __post_init__(self) -> None:
        if self.degree < 1:
            raise ConfigError(f"context_config.degree must be 1 or more, got {self.degree}")
