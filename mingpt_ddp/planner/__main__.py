"""What it would take: memory, bytes and time per GPU for a model on N GPUs, in any layout.

    python -m mingpt_ddp.planner --model gpt2 --gpus 8 --gpu-memory 80 --search --out plan.json
    python -m mingpt_ddp.planner --model gpt2-xl --gpus 8 --dp-shard 8 --ac full
    python -m mingpt_ddp.planner --model 7b --gpus 64 --tp 8 --dp-shard 8 --sp
    python -m mingpt_ddp.planner --model gpt2 --experts 8 --gpus 8 --ep 8

Per layout: rank 0's peak memory by category (traced for data-parallel layouts under torch's
fake process group, estimated for the others: memory.py), the bytes each dimension sends per
step (traffic.py: the formulas the parallelism benchmark checks against what it counts), an
estimated step time with its assumptions (search.py) and whether it fits. With --search, every
layout of the GPUs, those that fit first, then the fastest; the best --trace of them traced.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from mingpt_ddp.config.pipeline import LOOPED, SCHEDULES, PipelineConfig
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.planner.memory import calibrate, trace, traceable
from mingpt_ddp.planner.schedule import skips_ddp
from mingpt_ddp.planner.search import ASSUMPTIONS, judge, layouts, row, step_time
from mingpt_ddp.planner.shapes import MACHINES, Layout, Machine, Model
from mingpt_ddp.planner.traffic import per_dimension


def options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mingpt_ddp.planner", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="gpt2", help="a size of model.MODEL_SIZES, or 7b")
    for name in ("n-layer", "n-head", "n-embd", "vocab", "block"):
        p.add_argument(f"--{name}", type=int, default=0, help="override the size's shape")
    p.add_argument("--experts", type=int, default=0, help="experts in each block's MLP (0: dense)")
    p.add_argument("--top-k", type=int, default=2, help="the experts each token goes through")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--machine", choices=MACHINES, default="h100", help="the defaults below")
    for name, what in (
        ("gpu-memory", "GiB per GPU"),
        ("peak-tflops", "dense bf16 peak per GPU"),
        ("nvlink-gbs", "GB/s per GPU each way inside a node"),
        ("network-gbs", "GB/s per GPU each way between nodes"),
    ):
        p.add_argument(f"--{name}", type=float, default=0.0, help=f"{what} (0: the machine's)")
    p.add_argument("--mfu", type=float, default=0.4, help="the share of the peak matmuls reach")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument(
        "--ac", choices=("none", "full"), default="none", help="activation checkpointing"
    )
    p.add_argument(
        "--global-batch", type=int, default=0, help="windows per step, all replicas (0: 4 a GPU)"
    )
    p.add_argument("--parallel", choices=("fsdp", "ddp"), default="fsdp")
    for name in ("dp-replicate", "dp-shard", "tp", "pp", "cp", "ep", "microbatches"):
        p.add_argument(f"--{name}", type=int, default=0, help="a degree (0: 1, or the rest)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="a pipeline's (--pp)")
    p.add_argument(
        "--stages-per-rank", type=int, default=2, help="interleaved schedules' stages a rank"
    )
    p.add_argument("--search", action="store_true", help="every layout of --gpus, best first")
    p.add_argument("--trace", type=int, default=3, help="how many of the best to trace")
    p.add_argument("--out", help="write the rows as JSON here")
    return p


def chosen(args, gpus: int) -> Layout:
    """The layout the degrees name; the data-parallel degree fills the rest of the GPUs."""
    tp, pp, cp = args.tp or 1, args.pp or 1, args.cp or 1
    m = args.microbatches or (2 * pp if pp > 1 else 1)
    v = args.stages_per_rank if args.schedule in LOOPED else 1
    if pp > 1:  # the project's own checks of a schedule, in the planner's flags
        try:
            PipelineConfig(pp, args.schedule, m, v)
        except ConfigError as e:
            raise ConfigError(flags(str(e))) from None
    fixed = tp * pp * cp * (args.dp_replicate or 1) * (args.dp_shard or 1)
    if gpus % fixed:
        raise ConfigError(f"the degrees multiply to {fixed}, which does not divide --gpus {gpus}")
    rest = gpus // fixed
    shard = args.dp_shard or (rest if args.parallel == "fsdp" else 1)
    replicate = args.dp_replicate or (rest if args.parallel == "ddp" else 1)
    layout = Layout(replicate, shard, tp, pp, cp, args.sp, m, ac=args.ac, dtype=args.dtype)
    layout = dataclasses.replace(
        layout, parallel=args.parallel, ep=args.ep or 1, schedule=args.schedule, stages_per_rank=v
    )
    if skips_ddp(layout):
        raise ConfigError(
            f"--schedule {args.schedule} splits backward past DDP's gradient reduction (replicas "
            "would not average): give --parallel fsdp, or --schedule 1f1b"
        )
    if layout.gpus != gpus:
        raise ConfigError(f"the degrees make {layout.gpus} GPUs, not --gpus {gpus}")
    if (split := with_batch(layout, args.global_batch)) is None:
        raise ConfigError(
            f"--global-batch {args.global_batch} does not cut into {replicate * shard} replicas x "
            f"{m} microbatches of whole windows: make it a multiple of {replicate * shard * m}"
        )
    return split


def flags(message: str) -> str:
    """A pipeline_config error in the planner's words: each key as its flag."""
    for key, flag in (
        ("pipeline_config.microbatches", "--microbatches"),
        ("pipeline_config.stages_per_rank", "--stages-per-rank"),
        ("pipeline_config.schedule", "--schedule"),
        ("pipeline_config.degree", "--pp"),
        ("x degree", "x --pp"),
    ):
        message = message.replace(key, flag)
    return message


def check_experts(model: Model, layout: Layout) -> None:
    """Refuse an expert layout the project cannot run (parallel/expert.py: check_ep), in one
    line naming the flag."""
    dp = layout.dp_replicate * layout.dp_shard
    if layout.ep > 1 and not model.n_experts:
        raise ConfigError(
            f"--ep {layout.ep} shares out experts and the model has none: give --experts (a "
            f"multiple of {layout.ep}) or drop --ep"
        )
    if model.n_experts and not 1 <= model.top_k <= model.n_experts:
        raise ConfigError(
            f"--top-k {model.top_k} must be between 1 and --experts {model.n_experts}"
        )
    if dp % layout.ep or model.n_experts % layout.ep:
        raise ConfigError(
            f"--ep {layout.ep} must divide the data-parallel degree ({dp}) and --experts "
            f"({model.n_experts}): its ranks are data-parallel ranks, each with an equal share"
        )
    if model.n_experts and layout.sp:
        raise ConfigError(
            "--sp is not built with --experts (a tp rank would route its shard only): drop --sp"
        )


def with_batch(layout: Layout, global_batch: int) -> Layout | None:
    """The layout with its replica's share of the global batch (None: not whole microbatches)."""
    dp = layout.dp_replicate * layout.dp_shard
    if global_batch % (dp * layout.microbatches):
        return None
    return dataclasses.replace(layout, batch=global_batch // dp)


def machine_of(args) -> Machine:
    """The --machine's numbers, each flag given beating its own."""
    named = MACHINES[args.machine]
    given = {k: getattr(args, k if k != "memory_gib" else "gpu_memory") for k in named}
    numbers = {k: given[k] or v for k, v in named.items()}
    return Machine(args.gpus, args.gpus_per_node, mfu=args.mfu, **numbers)


def traced(model: Model, layout: Layout, machine: Machine) -> dict:
    """A row whose memory is traced (memory.trace) rather than estimated."""
    memory = trace(model, layout)
    sent = per_dimension(model, layout, act_bytes=layout.itemsize)
    return row(layout, memory, "traced", sent, step_time(model, layout, machine, sent), machine)


def plan(args) -> dict:
    shape = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "vocab", "block")}
    model = Model.named(args.model, **shape, n_experts=args.experts, top_k=args.top_k)
    machine = machine_of(args)
    args.global_batch = args.global_batch or 4 * args.gpus
    base = Layout(ac=args.ac, dtype=args.dtype)
    cache: dict = {}  # calibrations by forward unit (windows, tokens)

    def calibration(layout: Layout) -> dict:
        key = (layout.micro, model.block // layout.cp)
        if key not in cache:
            cache[key] = calibrate(model, layout)
        return cache[key]

    if args.search:
        found = (with_batch(x, args.global_batch) for x in layouts(model, args.gpus, base))
        candidates = [x for x in found if x is not None]
    else:
        candidates = [chosen(args, args.gpus)]
        check_experts(model, candidates[0])
    best = lambda r: (not r["fits"], r["step_time_s"])  # noqa: E731
    rows = sorted((judge(model, x, machine, calibration) | {"_": x} for x in candidates), key=best)
    traceables = [i for i, r in enumerate(rows) if traceable(model, r["_"])][: args.trace]
    rows = [traced(model, r["_"], machine) if i in traceables else r for i, r in enumerate(rows)]
    rows = sorted(({k: v for k, v in r.items() if k != "_"} for r in rows), key=best)
    return {
        "model": dataclasses.asdict(model) | {"name": args.model, "parameters": model.params()},
        "machine": dataclasses.asdict(machine),
        "global_batch": args.global_batch,
        "dtype": args.dtype,
        "activation_checkpointing": args.ac,
        "assumptions": ASSUMPTIONS,
        "rows": rows,
    }


def table(result: dict, limit: int = 12) -> str:
    gib = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
    lines = ["| layout | peak GiB/rank (from) | params | grads | optim | acts | temps | buffers "
             "| sent GB/step | step s | fits |", "|" + "---|" * 11]  # fmt: skip
    for r in result["rows"][:limit]:
        m = r["memory_by_category"]
        cats = " | ".join(gib(m[k]) for k in m)
        lines.append(
            f"| {r['layout']} | {gib(r['peak_bytes_per_rank'])} ({r['memory_from']}) | {cats} | "
            f"{r['sent_bytes_per_step'] / 1e9:.2f} | {r['step_time_s']:.3f} | "
            f"{'yes' if r['fits'] else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = options().parse_args()
    try:
        result = plan(args)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    m = result["model"]
    print(
        f"plan | {args.model}: {m['parameters'] / 1e6:,.1f}M parameters ({m['n_layer']} x "
        f"{m['n_embd']}, vocabulary {m['vocab']}, context {m['block']}) on {args.gpus} GPUs of "
        f"{result['machine']['memory_gib']:g} GiB | {args.global_batch} windows a step | "
        f"{args.dtype} | "
        f"{len(result['rows'])} layout(s), {sum(r['fits'] for r in result['rows'])} fit"
    )
    print(table(result))
    print("assumptions: " + "; ".join(result["assumptions"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
