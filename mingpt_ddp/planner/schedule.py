"""What a pipeline rank holds over its schedule's step: torch's own action table for the rank,
walked action by action.

A pipeline rank's peak is a moment of its schedule, not "the activations of pp microbatches":
which microbatches are in flight, on which of its stages, and what the schedule keeps after a
backward decide it. The walk reads torch's table (the `pipeline_order` every schedule class
builds: a forward F, a backward B, or for the zero-bubble schedules a backward split into its
input half I and its weight half W, per stage and microbatch; stand-in stages are enough for the
schedule to build it) and adds and frees, per action, what the stage's StageCost says:
- F keeps the stage's activations of that microbatch until its backward (`held`);
- B frees them, except what torch keeps until the step ends (`kept`): the hand-offs it sent
  (a schedule waits on its sends at the step's end) and, on the last stage, the logits (kept to
  merge the outputs);
- I computes the input's gradient and keeps the whole graph for W, plus the gradients of every
  weight's output that W needs (`pending`); W then frees like B. On the first stage, whose input
  is token ids, there is no input gradient: its I does nothing and its W is the whole backward;
- a stage's gradients appear during its first backward, as its activations go; each backward
  also holds its passing tensors (the traced temporaries) at its moment.
Held against the bytes alive at once in the parallelism benchmark's pipelines
(benchmarks/planner_check.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from mingpt_ddp.config.pipeline import V_SHAPED, ZERO_BUBBLE
from mingpt_ddp.parallel.stages import block_ranges, placement
from mingpt_ddp.planner.shapes import Layout, Model


@dataclass(frozen=True)
class StageCost:
    """One stage's bytes on its rank, per microbatch where it says so."""

    held: float
    """What a microbatch's forward keeps until its backward."""
    kept: float
    """What a microbatch still holds after its backward, until the step's end."""
    pending: float
    """What the input half of a split backward adds for the weight half."""
    grads: float
    """The stage's gradients (all microbatches accumulate into them)."""
    first: bool = False


def skips_ddp(layout: Layout) -> bool:
    """Whether a zero-bubble schedule would run over DDP's replicas (dp x cp > 1, which DDP
    averages over): its split backward never reaches DDP's reduction, so the project refuses it
    (parallel/pipeline.py: check_schedule) and the planner does too."""
    replicas = layout.dp_replicate * layout.dp_shard * layout.cp
    zero_bubble = layout.pp > 1 and layout.schedule in ZERO_BUBBLE
    return zero_bubble and layout.parallel == "ddp" and replicas > 1


def my_stages(model: Model, layout: Layout, rank: int = 0) -> list[tuple[int, int]]:
    """(stage, its blocks) for the stages `rank` of a pipeline holds (stages.placement)."""
    rank_of = placement(layout.pp, layout.stages, layout.schedule in V_SHAPED)
    ranges = block_ranges(model.n_layer, layout.stages)
    return [(s, len(ranges[s])) for s in sorted(rank_of) if rank_of[s] == rank]


def table(layout: Layout) -> dict[int, list]:
    """torch's own action table for the layout's pipeline (`pipeline_order`: per rank, its
    actions in order), built by the schedule class the project runs (parallel/pipeline.py)
    around stand-in stages of rank 0: the schedule computes every rank's row."""
    from mingpt_ddp.parallel.pipeline import ONE_STAGE, SCHEDULES

    kind, n = SCHEDULES[layout.schedule], layout.stages
    mine = [s for s, r in placement(layout.pp, n, layout.schedule in V_SHAPED).items() if r == 0]
    stand_ins = [
        SimpleNamespace(
            group_size=layout.pp, group_rank=0, num_stages=n, stage_index=s, submod=None
        )
        for s in sorted(mine)
    ]
    one = stand_ins[0] if kind in ONE_STAGE else stand_ins
    return kind(one, layout.microbatches, loss_fn=lambda out, target: out).pipeline_order


def compute(action) -> list:
    """An action's compute parts: DualPipeV's overlapped forward + backward is two; the
    schedule's other entries (REDUCE_GRAD, empty slots) none."""
    parts = (getattr(action, "sub_actions", None) or [action]) if action is not None else []
    return [p for p in parts if p.computation_type.value in UNIT]


def actions(layout: Layout, rank: int = 0) -> list[tuple[str, int]]:
    """`rank`'s compute actions in order, as (F | B | I | W, stage)."""
    row = table(layout)[rank]
    return [(p.computation_type.value, p.stage_index) for a in row for p in compute(a)]


UNIT = {"F": 1, "I": 1, "W": 1, "B": 2}  # a whole backward is the input's half + the weights'


def bubble(layout: Layout) -> float:
    """The share of a step a pipeline's ranks idle: (p - 1) / (m + p - 1) for GPipe and 1F1B,
    the schedule's own table at unit cost for the others (table_bubble). Not the table for the
    first two: torch 2.13's (a picture of the schedule, not what its step runs) has the last
    rank's row start at F1 and end at F{m}, and read 0.5 for 2 stages and 4 microbatches."""
    from mingpt_ddp.parallel.pipeline import ONE_STAGE, SCHEDULES

    if layout.pp == 1:
        return 0.0
    if SCHEDULES[layout.schedule] in ONE_STAGE:
        return (layout.pp - 1) / (layout.microbatches + layout.pp - 1)
    return table_bubble(table(layout))


def table_bubble(order: dict[int, list]) -> float:
    """A schedule's idle share from its own action table (torch's pipeline_order) at unit cost:
    a forward, a backward for the input and one for the weights take 1 each, a whole backward 2.
    Each action starts when its rank is free and what it needs is done (a forward the stage
    before's forward; a backward the stage after's backward and its own forward; the weights'
    part its input part); the share is 1 - busy / makespan, averaged over ranks. For 1F1B it is
    the textbook (p - 1) / (m + p - 1), for interleaved 1F1B (p - 1) / (v m + p - 1) (1/9 at
    p = 2, v = 2, m = 4); for the zero-bubble schedules, which publish none, it is theirs here."""
    acts = {r: [c for c in map(compute, row) if c] for r, row in order.items()}
    last = max(p.stage_index for row in acts.values() for parts in row for p in parts)
    done: dict[tuple, float] = {}  # (kind, stage, microbatch) -> when it finished
    clock, busy, at = dict.fromkeys(acts, 0.0), dict.fromkeys(acts, 0.0), dict.fromkeys(acts, 0)
    moved = True
    while moved:
        moved = False
        for r, row in acts.items():
            while at[r] < len(row):
                steps = [
                    (p.computation_type.value, p.stage_index, p.microbatch_index)
                    for p in row[at[r]]
                ]
                needs = [n for kind, s, mb in steps for n in _needs(kind, s, mb, last)]
                if any(n not in done for n in needs):
                    break
                start = max([clock[r], *(done[n] for n in needs)])
                cost = sum(UNIT[kind] for kind, _, _ in steps)
                clock[r], busy[r], at[r], moved = start + cost, busy[r] + cost, at[r] + 1, True
                for kind, s, mb in steps:
                    for made in ("I", "W") if kind == "B" else (kind,):
                        done[(made, s, mb)] = clock[r]
    makespan = max(clock.values())
    return sum(1 - b / makespan for b in busy.values()) / len(busy)


def _needs(kind: str, stage: int, mb: int, last: int) -> list[tuple]:
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind == "W":
        return [("I", stage, mb)]
    return [("F", stage, mb)] + ([("I", stage + 1, mb)] if stage < last else [])


def walk(steps: list[tuple[str, int]], costs: dict[int, StageCost], passing: float) -> dict:
    """The peak moment of a rank's step: the activations then alive, the backward's passing
    tensors (`passing` at each backward), and the gradients made by then."""
    live, made, peak = 0.0, set(), dict(activations=0.0, temporaries=0.0, gradients=0.0)

    def moment(extra: float, making: int | None = None) -> None:
        grads = sum(costs[s].grads for s in made if s != making)
        if live + extra + grads > sum(peak.values()):
            peak.update(activations=live, temporaries=extra, gradients=grads)

    for kind, s in steps:
        c = costs[s]
        whole = kind == "B" or (kind == "W" and c.first)
        if kind == "F":
            live += c.held
            moment(0.0)
        elif kind == "I" and not c.first:  # the weight half's inputs stay
            moment(passing)
            live += c.pending
        elif whole or kind == "W":
            new = s not in made
            made.add(s)
            # its gradients come as its activations go: not both whole at its first backward
            moment(passing if whole else 0.0, making=s if new else None)
            live -= c.held + (0.0 if whole else c.pending) - c.kept
    return peak


def stage_costs(
    model: Model, layout: Layout, act: float, rest: float, grads: dict[int, float]
) -> dict[int, StageCost]:
    """Each of rank 0's stages' StageCost: `act` a block's activations of one microbatch (as
    the layout cuts them), `rest` what the whole model keeps outside its blocks (calibrate's),
    grads[stage] its gradient bytes."""
    C, V = model.n_embd, model.vocab
    tokens = layout.micro * (model.block // layout.cp)
    unit = tokens * C * 4  # a hand-off: the residual stream, fp32
    ids = tokens * 8  # the first stage's token ids (int64)
    head = rest - ids - unit  # the final LayerNorm, the head and the loss (rest: ids + 1 unit)
    item = layout.itemsize
    # the gradients of each weight's output, for W: QKV and the first MLP layer (cut by tp),
    # the two output projections, the two LayerNorms; the head's logits and its LayerNorm
    per_block = tokens * ((7 * C / layout.tp + 2 * C) * item + 2 * C * 4)
    last = layout.stages - 1
    costs = {}
    for s, blocks in my_stages(model, layout):
        first, is_last = s == 0, s == last
        held = blocks * act + (ids if first else 0) + (head if is_last else unit)
        kept = (tokens * V * item if is_last else unit) + (0 if first else unit)
        pending = blocks * per_block + (tokens * (V * item + C * 4) if is_last else 0)
        costs[s] = StageCost(held, kept, pending, grads[s], first)
    return costs


def stage_elements(model: Model, layout: Layout, local_block: int) -> dict[int, int]:
    """Parameters of each of rank 0's stages (its blocks of `local_block` elements each, the
    embeddings on the first, the final LayerNorm and the head's own copy on the last)."""
    last = layout.stages - 1
    return {
        s: blocks * local_block
        + sum(math.prod(t) for t in model.root_tensors(s == 0, s == last).values())
        for s, blocks in my_stages(model, layout)
    }
