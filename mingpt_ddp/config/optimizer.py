"""The optimizers and their learning-rate schedule (config section `optimizer_config`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mingpt_ddp.errors import ConfigError

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")


@dataclass
class OptimizerConfig:
    """The optimizers and their learning-rate schedule (config section `optimizer_config`)."""

    optimizer: str = "adamw"
    """adamw: AdamW everywhere; muon: Muon for the blocks' weight matrices, AdamW for the rest
    (mingpt_ddp/optim.py)."""
    learning_rate: float = 1e-3
    """AdamW's peak learning rate, reached at the end of warmup."""
    min_lr: float = 1e-4
    """AdamW's learning rate at max_steps; the schedule decays from learning_rate to this (Muon's in
    proportion)."""
    warmup_steps: int = 100
    """Steps of linear warmup up to learning_rate (step s uses learning_rate * (s+1) /
    warmup_steps)."""
    schedule: str = "cosine"
    """cosine: decay from the peak right after warmup (nanoGPT); wsd: warmup-stable-decay, hold the
    peak, then decay linearly over the last decay_frac of the steps (the speedrun's)."""
    decay_frac: float = 0.3
    """wsd: the fraction of max_steps, at the end, over which the learning rate falls to min_lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay, on matrices and embeddings only (1-D gains and biases are not
    decayed)."""
    beta1: float = 0.9
    """AdamW's decay rate for the running mean of gradients."""
    beta2: float = 0.99
    """AdamW's decay rate for the running mean of squared gradients (0.99: nanoGPT's value for small
    data)."""
    muon_lr: float = 0.02
    """Muon's peak learning rate (its updates are orthogonalised, so its scale is not AdamW's)."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"optimizer_config.optimizer must be one of {', '.join(OPTIMIZERS)}, "
                f"got {self.optimizer!r}"
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"optimizer_config.schedule must be one of {', '.join(SCHEDULES)}, "
                f"got {self.schedule!r}"
            )
        if self.learning_rate <= 0 or self.min_lr < 0 or self.min_lr > self.learning_rate:
            raise ConfigError(
                "optimizer_config: need learning_rate > 0 and 0 <= min_lr <= learning_rate"
            )
        if (
            self.warmup_steps < 0
            or self.weight_decay < 0
            or self.grad_clip < 0
            or self.muon_lr <= 0
        ):
            raise ConfigError(
                "optimizer_config: warmup_steps, weight_decay and grad_clip must be >= 0, "
                "muon_lr > 0"
            )
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and 0 <= self.muon_momentum < 1):
            raise ConfigError("optimizer_config: beta1, beta2 and muon_momentum must be in [0, 1)")
        if not 0 < self.decay_frac <= 1:
            raise ConfigError(
                f"optimizer_config.decay_frac must be in (0, 1], got {self.decay_frac}"
            )

    def lr_scale(self, step: int, max_steps: int) -> float:
        """The schedule at a step, as a fraction of the peak (min_lr / learning_rate at the end)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        floor = self.min_lr / self.learning_rate
        if self.schedule == "wsd":
            decay_start = max(self.warmup_steps, max_steps - round(self.decay_frac * max_steps))
            progress = min(1.0, max(0, step - decay_start) / max(1, max_steps - decay_start))
            return 1.0 - progress * (1.0 - floor)
        progress = min(1.0, (step - self.warmup_steps) / max(1, max_steps - self.warmup_steps))
        return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - floor)

    def lr_at(self, step: int, max_steps: int) -> float:
        """AdamW's learning rate at a step."""
        return self.learning_rate * self.lr_scale(step, max_steps)
