"""What the grader measures, beside "equal to one process": each probe sees something equality
cannot. Every check returns a Check: its name, whether it held, and in words what was found.

- close:    two tensors equal to a tolerance; else the largest difference and where.
- Traffic:  every collective and send this rank issued inside the block (benchmarks/comm_bytes.py's
            dispatch mode over the c10d ops): bytes sent under the ring algorithms, the ops by
            name, and whether each was issued while backward was running (an overlap probe: a
            DDP that all-reduces only after backward issues none inside it).
- held:     the most microbatches a pipeline stage held at once (forward done, backward not).
- state_bytes: the bytes of the optimizer state an object holds, in every torch optimizer it
            keeps (ZeRO-1 keeps 1/N of it).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.comm_bytes import CountBytes  # noqa: E402


@dataclass
class Check:
    name: str
    passed: bool
    found: str

    def row(self) -> dict:
        return asdict(self)


def close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> Check:
    """got equals want to tol; else where they differ most, in words."""
    if got is None:
        return Check(name, False, "nothing there (None): did backward reach it?")
    if got.shape != want.shape:
        return Check(name, False, f"shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    diff = (got.float() - want.float()).abs()
    worst = diff.max().item()
    if worst <= tol:
        return Check(name, True, f"max |diff| {worst:.1e} <= {tol:.0e}")
    at = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    return Check(
        name,
        False,
        f"max |diff| {worst:.2e} at {at}: got {got.flatten()[diff.argmax()].item():.4g}, "
        f"expected {want.flatten()[diff.argmax()].item():.4g}",
    )


class Traffic(CountBytes):
    """CountBytes that also notes, per op, whether it was issued inside backward."""

    def __init__(self):
        super().__init__()
        self.in_backward: list[str] = []  # ops issued while the autograd engine ran

    def _record(self, name: str, schema, args, kwargs) -> None:
        super()._record(name, schema, args, kwargs)
        if torch._C._current_graph_task_id() != -1:  # private: -1 outside backward
            self.in_backward.append(name.removeprefix("c10d::"))

    def kinds(self) -> set[str]:
        return {count.kind for count in self.ops.values()}


def sent(name: str, traffic: Traffic, want: float, what: str) -> Check:
    """The bytes this rank sent equal the formula `what` (want bytes)."""
    got = traffic.sent_bytes()
    ops = ", ".join(f"{op} x{c.calls}" for op, c in sorted(traffic.ops.items())) or "none"
    found = f"sent {got:,.0f} bytes ({ops}); {what} = {want:,.0f}"
    return Check(name, abs(got - want) < 0.5, found)


def state_bytes(obj) -> int:
    """Bytes of the state of obj, a torch optimizer, or of every one it keeps (as an attribute, or
    in a list)."""
    found = [obj] if isinstance(obj, torch.optim.Optimizer) else []
    for value in [] if found else vars(obj).values():
        values = value if isinstance(value, (list, tuple)) else [value]
        found += [v for v in values if isinstance(v, torch.optim.Optimizer)]
    return sum(
        t.numel() * t.element_size()
        for opt in found
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
