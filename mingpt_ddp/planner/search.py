"""Every layout of N GPUs, judged by the formulas: memory, bytes, an estimated step time, and
whether it fits; the best few then traced.

The step time is an estimate with its assumptions written out (ASSUMPTIONS): compute from the
FLOPs at a share of the GPU's peak, a pipeline's bubble on top, tensor and context parallelism's
and a pipeline's hand-offs on the critical path, data parallelism's reduction hidden behind the
backward except what exceeds it. A dimension's links are NVLink while its group stays inside a
node (the grid's order, mesh.py: tp innermost, then cp, dp_shard, dp_replicate, pp), else the
network's.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from mingpt_ddp.config.pipeline import LOOPED
from mingpt_ddp.planner.memory import estimate
from mingpt_ddp.planner.schedule import bubble, skips_ddp
from mingpt_ddp.planner.shapes import Layout, Machine, Model
from mingpt_ddp.planner.traffic import per_dimension

ASSUMPTIONS = [
    "compute: FLOPs per token (6 per parameter met + attention's 12 L T C) x tokens per rank, at "
    "peak x mfu; activation checkpointing adds a forward (x 4/3)",
    "pipeline: the compute stretched by its schedule's bubble b, x 1 / (1 - b): (pp - 1) / "
    "(m + pp - 1) for 1F1B, the schedule's own action table at unit cost for the others",
    "tensor and context parallelism, pipeline hand-offs: on the critical path, at their link's "
    "bandwidth",
    "data parallelism: hidden behind the backward (2/3 of the compute); only what exceeds it shows",
    "expert parallelism's rows: on the critical path, an even spread over the experts",
    "links: NVLink while a dimension's group fits in a node (tp innermost, then cp, dp_shard, "
    "dp_replicate, pp; ep's ranks are dp's, innermost), else the network; no latency, no "
    "congestion",
]
ORDER = ("tp", "cp", "dp_shard", "dp_replicate", "pp")  # innermost first (mesh.py, reversed)


def layouts(model: Model, gpus: int, base: Layout) -> list[Layout]:
    """Every factorisation of gpus into the grid's degrees that the model can take: tp divides
    the heads, a pipeline has a block a stage and 2 x pp microbatches (1F1B, and interleaved
    1F1B and zero bubble's V where it has 2 blocks a rank), cp divides the context;
    data parallelism as FSDP shards or DDP replicas, sequence parallelism with or without (not
    with experts), and for a mixture of experts every ep dividing dp and the experts."""
    found = []
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    for tp, cp, pp in itertools.product(divisors, repeat=3):
        rest, bad = gpus // (tp * cp * pp) if gpus % (tp * cp * pp) == 0 else 0, False
        bad = not rest or model.n_head % tp or model.block % cp or pp > model.n_layer
        if bad:
            continue
        m = 2 * pp if pp > 1 else 1
        sps = (False, True) if tp > 1 and not model.n_experts else (False,)
        # expert parallelism: any degree dividing both the data-parallel ranks and the experts
        eps = [e for e in divisors if rest % e == 0 == model.n_experts % e]
        eps = eps if model.n_experts else [1]
        for parallel, sp, ep, schedule in itertools.product(
            ("fsdp", "ddp"), sps, eps, schedules(model, pp)
        ):
            dp = dict(dp_shard=rest) if parallel == "fsdp" else dict(dp_replicate=rest)
            grid = dict(tp=tp, cp=cp, pp=pp, sp=sp, ep=ep, microbatches=m, parallel=parallel)
            v = 2 if schedule in LOOPED else 1
            layout = dataclasses.replace(base, **grid, **dp, schedule=schedule, stages_per_rank=v)
            if not skips_ddp(layout):
                found.append(layout)
    return found


def schedules(model: Model, pp: int) -> list[str]:
    """The pipeline schedules a search tries: 1F1B; interleaved 1F1B and zero bubble's V (2
    stages a rank) where the model has a block for each of their stages."""
    if pp == 1:
        return ["1f1b"]
    return ["1f1b"] + (["interleaved1f1b", "zbv"] if model.n_layer >= 2 * pp else [])


def judge(model: Model, layout: Layout, machine: Machine, calibration) -> dict:
    """One layout's row: memory (estimated), bytes by dimension, step time, fits."""
    memory = estimate(model, layout, calibration(layout))
    sent = per_dimension(model, layout, act_bytes=layout.itemsize)
    seconds = step_time(model, layout, machine, sent)
    return row(layout, memory, "estimated", sent, seconds, machine)


def row(layout, memory, source, sent, seconds, machine) -> dict:
    peak = sum(memory.values())
    return {
        "layout": layout.name(),
        "degrees": layout.degrees(),
        "parallel": layout.parallel,
        "sequence_parallel": layout.sp,
        "microbatches": layout.microbatches,
        "peak_bytes_per_rank": round(peak),
        "memory_by_category": {k: round(v) for k, v in memory.items()},
        "memory_from": source,
        "sent_bytes_per_step": round(sum(sent.values())),
        "sent_bytes_by_dimension": {k: round(v) for k, v in sent.items() if v},
        "step_time_s": seconds,
        "fits": peak <= machine.memory_gib * 2**30,
    }


def link(layout: Layout, dim: str, machine: Machine) -> float:
    """Bytes per second of this dimension's links (module docstring)."""
    if dim == "ep":  # data-parallel ranks side by side (mesh.py)
        inner = layout.tp * layout.cp * layout.ep
    else:
        inner = math.prod(getattr(layout, d) for d in ORDER[: ORDER.index(dim) + 1])
    fast = inner <= machine.gpus_per_node
    return (machine.nvlink_gbs if fast else machine.network_gbs) * 1e9


def step_time(model: Model, layout: Layout, machine: Machine, sent: dict) -> float:
    """Seconds per step under ASSUMPTIONS."""
    tokens = layout.batch * model.block  # a replica's tokens a step
    flops = model.flops_per_token() * tokens / (layout.tp * layout.pp * layout.cp)
    compute = flops / (machine.peak_tflops * 1e12 * machine.mfu)
    compute *= 4 / 3 if layout.ac == "full" else 1
    compute /= 1 - bubble(layout)
    exposed = sum(sent[d] / link(layout, d, machine) for d in ("tp", "cp", "pp", "ep"))
    dp = "dp_shard" if layout.dp_shard > 1 else "dp_replicate"
    reduce = (sent["dp"] + sent["routing"]) / link(layout, dp, machine)
    return round(compute + exposed + max(0.0, reduce - 2 / 3 * compute), 6)
