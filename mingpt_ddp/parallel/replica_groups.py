"""torchft_config.groups > 0: replica groups with per-step fault tolerance (torchft).

Data parallelism over torchrun's process group stops at the first lost rank: torchrun restarts
every rank and each reloads the last snapshot (mingpt_ddp/snapshots/), so the steps since that
snapshot are trained again. Here each replica group is a torchrun job of its own, and the groups
meet through torchft every step instead of through one process group:

- a *lighthouse* (a small server, `torchft_lighthouse`) forms a *quorum* of the groups that are
  alive at the start of each step: a group that stops heartbeating for longer than the
  lighthouse's --heartbeat_timeout_ms is left out of the next quorum;
- the gradients are averaged over the groups in the quorum (the manager's all-reduce, over a
  process group it rebuilds whenever the quorum changes), and each group applies the step only if
  all of its own ranks saw no error (should_commit: a vote inside one group; groups may decide
  differently): a step not committed is not applied by that group, and is trained again;
- a group that comes back (its torchrun restarted it) *heals*: in its first quorum the manager
  sees it behind and copies the model, the optimizer state and the step from a live peer, over
  the same process group (PGTransport), and it trains on at the current step. No snapshot is read.

Each group is one process here: torchft 0.2.0's DDP wrapper runs a dummy process group inside a
group, so a group of several ranks would need its own gradient reduction composed with the
manager's. The data order survives a loss: group g reads every groups-th window of the one order
(the position is a function of the step), so while a group is missing its windows of those steps
are skipped, the survivors' steps average over fewer windows, and every window is trained at most
once. With torchft_config.sync = local_sgd or diloco the groups meet every sync_every steps
instead, for slow links between them (semi_sync.py). Each group writes its own snapshots (its
own run_dir, one lease each); they matter only if every group is lost at once.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.nn as nn

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.parallel.grid import GridStrategy
from mingpt_ddp.parallel.semi_sync import SemiSync
from mingpt_ddp.parallel.strategy import StrategyArgs, check_no_foreign_options
from mingpt_ddp.runtime.distributed import print0


def import_torchft():
    """torchft, or a one-line error naming the extra to install. Its Rust half logs every quorum
    and vote at INFO (about 6 lines a step, which bury the project's): warnings only, unless
    RUST_LOG says otherwise (RUST_LOG=info shows them)."""
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
        from torchft.checkpointing.pg_transport import PGTransport
    except ImportError as e:
        raise ConfigError(
            'torchft_config.groups > 0 needs torchft: pip install -e ".[torchft]" (Linux wheels '
            f"only) ({e})"
        ) from e
    return torchft, PGTransport


def heal_transport(transport: type, pg, timeout: timedelta):
    """How a healing group receives its peer's state: over the groups' Gloo process group, through
    host memory. Gloo's all-reduce takes CUDA tensors, but its send and recv hand the tensor's
    pointer to the TCP transport as it is: on an H200, a CUDA tensor sent so failed with "writev:
    Bad address" (docs/measured.md), so a heal on GPUs would fail and no step would commit. heal()
    copies the received CPU tensors into the model and optimizer on their own device."""
    return transport(pg, timeout=timeout, device=torch.device("cpu"))


@contextmanager
def lighthouse_named(cfg):
    """torchft's failure to reach the lighthouse, as one line naming the setting (it is otherwise a
    RuntimeError and a traceback, whose cause a learner has to dig out)."""
    try:
        yield
    except RuntimeError as e:
        if "failed to connect" not in str(e):
            raise
        where = cfg.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "(unset)")
        raise ConfigError(
            f"no torchft lighthouse answered at {where} within {cfg.timeout_s:g} s: start one "
            "(torchft_lighthouse --min_replicas 1 --bind [::]:29510) or set "
            "torchft_config.lighthouse (or TORCHFT_LIGHTHOUSE) to its address"
        ) from None


class ReplicaGroupStrategy(GridStrategy):
    """One process of one replica group: the local step of single.py, the gradients averaged over
    the groups of this step's quorum, the update applied only when the quorum commits."""

    def __init__(self, model: nn.Module, args: StrategyArgs):
        super().__init__(model, args)
        torchft, PGTransport = import_torchft()
        cfg = self.cfg = args.plan.torchft
        timeout = timedelta(seconds=cfg.timeout_s)
        pg = torchft.ProcessGroupGloo(timeout=timeout)
        with lighthouse_named(cfg):
            self.manager = torchft.Manager(
                pg=pg,
                min_replica_size=1,  # one survivor keeps training
                load_state_dict=self.heal,
                state_dict=self.peer_state,
                use_async_quorum=False,  # heal before the step draws its batch, not during it
                timeout=timeout,
                quorum_timeout=timeout,
                connect_timeout=timeout,
                lighthouse_addr=cfg.lighthouse or None,
                replica_id=f"group{cfg.group}",
                hostname=cfg.hostname or socket.gethostname(),
                checkpoint_transport=heal_transport(PGTransport, pg, timeout),
            )
        self.healed, self.joined, self.peer_step, self.calls = False, False, 0, 0
        self.sent_bytes = 0  # what this group handed to the all-reduces between groups
        self.manager.allreduce = self._counted(self.manager.allreduce)
        semi = cfg.sync != "step"
        self.semi = SemiSync(cfg, self.manager, self.model, self.optimizers[0]) if semi else None

    def _counted(self, allreduce):
        """The manager's all-reduce, counting the bytes each call hands over (the payload: a
        ring all-reduce over n groups puts 2 (n - 1) / n times that on each group's link)."""

        def counted(tensor: torch.Tensor, *args, **kwargs):
            self.sent_bytes += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)

        return counted

    @classmethod
    def check(cls, args: StrategyArgs) -> None:
        plan = args.plan
        if "MASTER_ADDR" not in os.environ:  # torchft's process group reads torchrun's variables
            raise ConfigError(
                "each torchft replica group is a torchrun job of its own: launch it with "
                "torchrun --nproc_per_node=1 main.py torchft_config.group=G ..."
            )
        if args.ctx.world_size > 1:
            raise ConfigError(
                "each torchft replica group is one process here (torchft 0.2.0 runs no reduction "
                "inside a group): launch each group with torchrun --nproc_per_node=1"
            )
        if plan.parallel not in ("ddp", "none"):
            raise ConfigError(
                f"torchft_config.groups > 0 averages whole gradients between groups, not "
                f"parallel={plan.parallel}: set trainer_config.parallel=ddp"
            )
        check_no_foreign_options(plan)
        if any(degree > 1 for degree in plan.degrees().values()):
            raise ConfigError(
                "torchft_config.groups > 0 runs each replica group as one process: set "
                "mesh_config.tp, cp and pp to 1"
            )
        if plan.use_amp and plan.amp_dtype == "fp16":
            raise ConfigError(
                "fp16 under torchft would need GradScaler's skipped steps in the quorum's commit "
                "vote: use trainer_config.amp_dtype=bf16 or use_amp=false"
            )
        if plan.torchft.sync != "step" and args.optim.optimizer != "adamw":
            raise ConfigError(
                f"torchft_config.sync={plan.torchft.sync} hooks one optimizer, and "
                f"optimizer={args.optim.optimizer} steps two: use optimizer_config.optimizer=adamw"
            )

    # ------------------------------------------------------------ the step
    def begin_step(self, step: int, n_micro: int) -> int | None:
        """Join this step's quorum (healing first if this group is behind); returns the step a
        heal moved the group to, None if it stays. Once per step: the Trainer joins before it
        resumes (Trainer.start), and the first step then trains in that same quorum, as the
        other groups expect (a second quorum would leave them waiting in their all-reduce).
        Under local_sgd and diloco the groups meet after steps, not before: _begin_semi."""
        if self.semi is not None:
            return self._begin_semi(step)
        if self.joined:
            return None
        if self.manager.current_step() != step:  # a resumed snapshot: the quorum must know it
            done = self.manager.batches_committed()
            self.manager.load_state_dict({"step": step, "batches_committed": done})
        self.healed, self.joined = False, True
        self.manager.start_quorum()
        moved = self.healed and self.manager.current_step() != step
        return self.manager.current_step() if moved else None

    def _begin_semi(self, step: int) -> int | None:
        """No quorum before a step: the Trainer's first call (before it resumes) does nothing, a
        heal in the last meeting moves the group to its peer's step, else the meetings go on."""
        self.calls += 1
        if self.calls == 1:  # Trainer.start, before the snapshot is read: not a step
            return None
        if self.healed:
            self.healed, self.semi.step = False, self.peer_step
            return self.peer_step if self.peer_step != step else None
        self.semi.begin(step)
        return None

    def heal(self, state: dict) -> None:
        """torchft's load_state_dict: a live peer's model and optimizer state (not its data
        position: that is a function of the step, and each group reads its own windows), and how
        it computes: the loss scale and attention's precision, which each group timed for itself
        at start and may have chosen differently (the walkthrough saw bf16 beside fp32)."""
        self.model.load_state_dict(state["model"])
        for optimizer, saved in zip(self.optimizers, state["optimizers"]):
            optimizer.load_state_dict(saved)
        self.load_snapshot_meta(state.get("meta", {}))
        self.attention_choice = self.attention_choice.replace("the snapshot's run", "the peer")
        self.healed, self.peer_step = True, state.get("step", 0)

    def snapshot_meta(self) -> dict:
        """The layout's meta, and DiLoCo's last meeting (semi_sync.py): a snapshot's, a peer's."""
        return {**super().snapshot_meta(), "semi_sync": self.semi.state_dict() if self.semi else {}}

    def load_snapshot_meta(self, meta: dict) -> None:
        super().load_snapshot_meta(meta)
        if self.semi is not None:
            self.semi.load_state_dict(meta.get("semi_sync", {}))

    def peer_state(self) -> dict:
        """torchft's state_dict: what a healing peer copies from this group."""
        return {
            "model": self.model.state_dict(),
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            "meta": self.snapshot_meta(),  # the loss scale, attention's precision
            "step": self.semi.step if self.semi else self.manager.current_step(),
        }

    def reduce_gradients(self) -> bool:
        """The gradients averaged over the groups of this step's quorum (one flat all-reduce);
        whether this group commits the step (should_commit: its ranks saw no error). Under
        local_sgd and diloco, nothing: the group steps alone, and meets after its step."""
        if self.semi is not None:
            return True
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])  # (all gradient elements,)
        self.manager.allreduce(flat).wait()  # the mean over the groups that are there
        for grad, mean in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(mean.view_as(grad))
        committed, self.joined = self.manager.should_commit(), False  # the step's quorum ends
        if not committed:  # this group saw an error (a peer lost mid-step): it does not apply it
            print0(
                f"torchft | step {self.manager.current_step() + 1} not committed by the quorum "
                "(a group failed during it): nothing applied, the step is trained again"
            )
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
        return committed

    def step_record(self, record: dict) -> str:
        """The bytes handed to the all-reduces between groups so far (the slow links' share)."""
        record["sent_bytes"] = self.sent_bytes
        return ""

    def evaluation_share(self, replica: int, replicas: int) -> tuple[int, int]:
        """Every group evaluates all the validation windows: the groups' losses agree, and one
        group alone still reports the job's."""
        return 0, 1

    def describe(self) -> tuple[str, str]:
        cfg = self.cfg
        mode = f"torchft replica group {cfg.group} of {cfg.groups} (heals from a live peer)"
        mode += f", {self.semi.words()}" if self.semi else ""
        return mode + self.checkpointing_words(), self.precision()
