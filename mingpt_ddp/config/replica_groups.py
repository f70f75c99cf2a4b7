"""Per-step fault tolerance's settings (config section `torchft_config`): the code they configure
is mingpt_ddp/parallel/replica_groups.py."""

from __future__ import annotations

from dataclasses import dataclass

from mingpt_ddp.errors import ConfigError

SYNCS = ("step", "local_sgd", "diloco")  # how the replica groups meet (TorchftConfig.sync)


@dataclass
class TorchftConfig:
    """Replica groups under torchft (config section `torchft_config`). groups 0 (the default) is
    off; above 0, this torchrun job is one of `groups` replica groups that average their gradients
    through torchft's manager every step and keep training when one of them is lost."""

    groups: int = 0
    """Replica groups in the whole job (each its own torchrun job, here of one process). 0: off."""
    group: int = 0
    """This job's group: 0 .. groups - 1. It reads its own share of the data order (every
    groups-th window) and needs its own trainer_config.run_dir for its snapshots."""
    lighthouse: str = ""
    """The lighthouse's URL (http://host:port); empty: the TORCHFT_LIGHTHOUSE environment
    variable. Start one with: torchft_lighthouse --min_replicas 1 --bind [::]:29510."""
    hostname: str = ""
    """The name the peers reach this group's manager by; empty: this machine's hostname."""
    timeout_s: float = 60.0
    """How long a quorum, an all-reduce across groups or a heal may take before the step fails.
    60 s is torchft's own Manager default (its timeout, quorum_timeout and connect_timeout): in
    the first step the other groups wait in the all-reduce for a group still setting up NCCL or
    compiling (trainer_config.compile), which can take longer than 30 s."""
    sync: str = "step"
    """How the groups meet. "step": they average their gradients every step. "local_sgd" and
    "diloco" (semi-synchronous, for slow links between groups): each group trains alone for
    sync_every steps, then they average their weights (local SGD), or the change in their weights
    since the last meeting, applied by an outer Nesterov SGD (DiLoCo), through torchft's LocalSGD
    and DiLoCo. A lost group can lose up to sync_every steps of its own work."""
    sync_every: int = 1
    """Steps between meetings under local_sgd and diloco (H); 1 under "step"."""
    outer_lr: float = 0.7
    """DiLoCo's outer learning rate (the DiLoCo paper's 0.7, as torchft's tests use)."""
    outer_momentum: float = 0.9
    """DiLoCo's outer Nesterov momentum (the paper's 0.9)."""

    def __post_init__(self) -> None:
        if self.groups < 0 or (self.groups and not 0 <= self.group < self.groups):
            raise ConfigError(
                f"torchft_config.group must be 0 .. groups - 1 ({self.groups} groups), got "
                f"{self.group}; give each replica group's job its own number"
            )
        if self.timeout_s <= 0:
            raise ConfigError(f"torchft_config.timeout_s must be positive, got {self.timeout_s}")
        if self.sync not in SYNCS:
            raise ConfigError(
                f"torchft_config.sync must be one of {', '.join(SYNCS)}, got {self.sync!r}"
            )
        if self.sync_every < 1 or (self.sync == "step" and self.sync_every != 1):
            raise ConfigError(
                f"torchft_config.sync_every={self.sync_every}: groups that meet every step have "
                "sync_every=1; set torchft_config.sync=local_sgd or diloco to meet every H steps"
            )
