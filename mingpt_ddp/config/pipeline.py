"""Pipeline parallelism's settings (config section `pipeline_config`): the code they configure is
mingpt_ddp/parallel/pipeline.py."""

from __future__ import annotations

from dataclasses import dataclass

from mingpt_ddp.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


@dataclass
class PipelineConfig:
    """How the model is cut into stages (config section `pipeline_config`). degree 1 (the default)
    is no pipeline; above 1, the ranks form a (pp, dp) grid: `degree` stages in a row, and
    world size / degree such rows, data-parallel over trainer_config.parallel (ddp or fsdp)."""

    degree: int = 1
    """Alias of mesh_config.pp. Pipeline stages in a row (ranks per pipeline); must divide the
    world size. 1: no pipeline."""
    schedule: str = "1f1b"
    """gpipe (all forwards, then all backwards), 1f1b (one forward, one backward once the pipe is
    full: at most `degree` microbatches' activations held), interleaved1f1b (several stages per
    rank, a smaller bubble)."""
    microbatches: int = 4
    """Pieces each step's batch (batch_size x grad_accum_steps windows per pipeline) is cut into;
    more shrink the bubble, (degree - 1) / (microbatches + degree - 1) for gpipe and 1f1b."""
    stages_per_rank: int = 2
    """interleaved1f1b only: stages each rank holds (rank r holds stages r, r + degree, ...)."""

    def __post_init__(self) -> None:
        if self.degree < 1 or self.microbatches < 1 or self.stages_per_rank < 1:
            raise ConfigError(
                "pipeline_config.degree, microbatches and stages_per_rank must be positive, got "
                f"{self.degree}, {self.microbatches}, {self.stages_per_rank}"
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"pipeline_config.schedule must be {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        if self.degree > 1 and self.schedule != "gpipe" and self.microbatches < self.degree:
            raise ConfigError(
                f"pipeline_config.schedule={self.schedule} needs at least as many microbatches as "
                f"stages in a row: raise pipeline_config.microbatches to {self.degree} or more"
            )
        # torch's interleaved schedule runs the microbatches in rounds of `degree` and needs
        # whole rounds (ScheduleInterleaved1F1B's check: microbatches % number_of_rounds == 0).
        rounds = max(1, self.microbatches // self.degree)
        if self.schedule == "interleaved1f1b" and self.microbatches % rounds:
            raise ConfigError(
                f"pipeline_config.schedule=interleaved1f1b runs {self.microbatches} microbatches "
                f"in {rounds} equal rounds (microbatches // degree), which they do not fill: make "
                f"pipeline_config.microbatches a multiple of {self.degree}, or below "
                f"{2 * self.degree}"
            )

    @property
    def stages(self) -> int:
        """Stages in the whole pipeline."""
        return self.degree * (self.stages_per_rank if self.schedule == "interleaved1f1b" else 1)
