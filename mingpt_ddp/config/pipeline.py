"""Pipeline parallelism's settings (config section `pipeline_config`): the code they configure is
mingpt_ddp/parallel/pipeline.py."""

from __future__ import annotations

from dataclasses import dataclass

from mingpt_ddp.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "interleavedzb", "zbv", "dualpipev")
LOOPED = ("interleaved1f1b", "interleavedzb")  # stages_per_rank stages a rank: r, r + degree, ...
V_SHAPED = ("zbv", "dualpipev")  # 2 stages a rank in a V: rank r holds r and 2 degree - 1 - r
# Backward split in two (the input's gradient first, the weights' later, to fill the bubble).
ZERO_BUBBLE = ("interleavedzb", "zbv", "dualpipev")


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
    rank, a smaller bubble); zero bubble, each backward split into the input's gradient and the
    weights' (done later, in what would be the bubble): interleavedzb (placed as
    interleaved1f1b), zbv and dualpipev (2 stages a rank in a V; dualpipev needs at least
    2 x degree microbatches). Zero-bubble schedules run one pipeline, no data-parallel replicas
    (pipeline.check_schedule says why)."""
    microbatches: int = 4
    """Pieces each step's batch (batch_size x grad_accum_steps windows per pipeline) is cut into;
    more shrink the bubble, (degree - 1) / (microbatches + degree - 1) for gpipe and 1f1b."""
    stages_per_rank: int = 2
    """interleaved1f1b and interleavedzb only: stages each rank holds (rank r holds stages r,
    r + degree, ...); zbv and dualpipev always hold 2."""

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
        if self.schedule in LOOPED and self.microbatches % rounds:
            raise ConfigError(
                f"pipeline_config.schedule={self.schedule} runs {self.microbatches} microbatches "
                f"in {rounds} equal rounds (microbatches // degree), which they do not fill: make "
                f"pipeline_config.microbatches a multiple of {self.degree}, or below "
                f"{2 * self.degree}"
            )

        if self.schedule == "dualpipev" and self.degree > 1 and self.microbatches < 2 * self.degree:
            raise ConfigError(  # ScheduleDualPipeV's own check, said before the ranks start
                f"pipeline_config.schedule=dualpipev needs at least 2 x degree = {2 * self.degree}"
                f" microbatches: raise pipeline_config.microbatches"
            )

    @property
    def stages(self) -> int:
        """Stages in the whole pipeline."""
        per_rank = self.stages_per_rank if self.schedule in LOOPED else 1
        return self.degree * (2 if self.schedule in V_SHAPED else per_rank)
