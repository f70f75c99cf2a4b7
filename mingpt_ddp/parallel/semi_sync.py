"""torchft_config.sync = local_sgd | diloco: replica groups that meet every H steps, not every step.

Averaging the gradients every step sends the whole model's size over the links between groups
every step; over a slow link (two sites, a shared network) that is the step's cost. Local SGD
(Stich 2018) and DiLoCo (Douillard et al. 2023) let each group train alone for H steps
(torchft_config.sync_every) and then meet once:

- local SGD averages the groups' weights;
- DiLoCo averages the *pseudo-gradient*, the change of each group's weights since the last
  meeting, and applies it to the weights of that meeting with an outer optimizer (Nesterov SGD,
  lr 0.7, momentum 0.9 in the paper); the inner optimizer (AdamW) steps every step as before.

Either sends the model's size once every H steps: about 1/H of the bytes. torchft runs both
(torchft.local_sgd.LocalSGD and DiLoCo): hooks on the optimizer count the steps since the last
meeting and, at the H-th, start the quorum, all-reduce and commit. Three things follow from that:

- the manager's step counts meetings, not optimizer steps, so a group resumed from a snapshot at
  step s tells it s // H, and starts s % H steps into the interval (every group meets at the
  same steps: the multiples of H);
- a group that comes back heals at its first meeting (its own steps until then are replaced by a
  live peer's weights) and jumps to the peer's step: the data order is a function of the step;
- a group lost between meetings loses its steps since the last one (at most H), and a meeting
  that fails to commit costs every group its interval under DiLoCo (it returns to the last
  meeting's weights) and nothing under local SGD (each keeps its own weights until the next).

A DiLoCo group's snapshot keeps the last meeting's weights and the outer momentum besides its own
weights (state_dict), so that groups resumed mid-interval still measure their change from one
common point. The hooks sit on one optimizer: Muon's two (Muon and AdamW) are refused.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mingpt_ddp.config.replica_groups import TorchftConfig
from mingpt_ddp.runtime.distributed import print0


class SemiSync:
    """One group's meetings every H steps: torchft's LocalSGD or DiLoCo around its optimizer."""

    def __init__(self, cfg: TorchftConfig, manager, model: nn.Module, optimizer):
        self.cfg, self.manager, self.model, self.optimizer = cfg, manager, model, optimizer
        self.every, self.algorithm, self.outer = cfg.sync_every, None, None
        self.step = 0  # the optimizer steps this group has taken (its Trainer's step)
        self.pending: dict = {}  # DiLoCo's state from a snapshot, applied once DiLoCo is built

    def begin(self, step: int) -> None:
        """Before a step: on the first, start torchft's hooks at this step's place in its interval
        (after a resume, with the resumed weights as the last meeting's); later, say when the
        meeting that ended the last interval did not commit."""
        if self.algorithm is None:
            self._start(step)
        elif step % self.every == 0 and self.manager.current_step() != step // self.every:
            print0(
                f"torchft | the meeting at step {step} was not committed (a group failed during "
                f"it): {self._uncommitted()}; this group heals from a live peer at the next one"
            )
        self.step = step

    def _start(self, step: int) -> None:
        from torchft.local_sgd import DiLoCo, LocalSGD

        if self.manager.current_step() != step // self.every:  # meetings before this step
            done = self.manager.batches_committed()
            self.manager.load_state_dict({"step": step // self.every, "batches_committed": done})
        # Our own hook first (hooks run in the order registered): the step count a healing peer
        # copies is this group's after the step, when torchft's hook meets the others.
        self.optimizer.register_step_post_hook(lambda *_: setattr(self, "step", self.step + 1))
        if self.cfg.sync == "local_sgd":
            self.algorithm = LocalSGD(self.manager, self.model, self.optimizer, self.every)
        else:
            self.outer = torch.optim.SGD(
                self.model.parameters(),
                lr=self.cfg.outer_lr,
                momentum=self.cfg.outer_momentum,
                nesterov=True,
            )
            # The weights of the last meeting are kept in host memory (torchft's default).
            args = (self.manager, [self.model], self.optimizer, self.outer, self.every)
            self.algorithm = DiLoCo(*args)
        self.algorithm.__enter__()  # its hooks on the optimizer, for the rest of the run
        # torchft 0.2.0 counts the steps since the last meeting in _local_step, from 0 when it is
        # built; a group resumed mid-interval starts where the others are, or it meets off-beat.
        self.algorithm._local_step = step % self.every
        self.load_state_dict(self.pending)

    def state_dict(self) -> dict:
        """What a resumed group needs besides its weights: under DiLoCo the last meeting's weights
        (the groups' common starting point, from which each measures its change: without them
        groups resumed mid-interval would each apply the average change to their own weights,
        and drift apart for good) and the outer momentum; nothing under local SGD."""
        if self.outer is None:
            return dict(self.pending)  # not built yet: what the snapshot gave, unchanged
        fragment = self.algorithm._fragments[0]  # torchft 0.2.0: one fragment, the whole model
        original = {name: t.clone() for name, t in fragment.original_parameters.items()}
        return {"original": original, "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.pending = dict(state or {})
        if self.outer is None or not self.pending:
            return  # applied when DiLoCo is built (_start), after the snapshot's weights
        fragment = self.algorithm._fragments[0]
        for name, tensor in self.pending.pop("original").items():
            fragment.original_parameters[name].copy_(tensor)
        self.outer.load_state_dict(self.pending.pop("outer"))

    def _uncommitted(self) -> str:
        if self.cfg.sync == "diloco":
            return f"its weights went back to the last meeting's (up to {self.every} steps lost)"
        return "it keeps its own weights until the next meeting"

    def words(self) -> str:
        how = "weights averaged" if self.cfg.sync == "local_sgd" else "DiLoCo's outer step"
        return f"{self.cfg.sync}: meets every {self.every} steps ({how})"
