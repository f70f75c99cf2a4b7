"""DeepSpeed ZeRO's settings (config section `deepspeed_config`; parallel=zero1 | zero2 | zero3)."""

from __future__ import annotations

from dataclasses import dataclass

from mingpt_ddp.errors import ConfigError


@dataclass
class DeepSpeedConfig:
    """DeepSpeed ZeRO settings (config section `deepspeed_config`; used when
    trainer_config.parallel=deepspeed). Precision comes from trainer_config.use_amp and amp_dtype,
    the same switches as for DDP and FSDP."""

    zero_stage: int = 2
    """1: optimizer state split over ranks; 2: and gradients; 3: and parameters (like FSDP)."""
    offload_optimizer: bool = False
    """Keep the optimizer state (and its step) in CPU memory: for GPU jobs short of GPU memory."""
    offload_params: bool = False
    """Stage 3 only: keep parameter partitions in CPU memory between uses."""

    def __post_init__(self) -> None:
        if self.zero_stage not in (1, 2, 3):
            raise ConfigError(
                f"deepspeed_config.zero_stage must be 1, 2 or 3, got {self.zero_stage}"
            )
        if self.offload_params and self.zero_stage != 3:
            raise ConfigError(
                "deepspeed_config.offload_params=true needs zero_stage=3 (only stage 3 splits "
                "the parameters); set offload_params=false or zero_stage=3"
            )
