"""Every parallel layout measured against its formulas: one run, one table, the hardware named.

    python benchmarks/parallelisms.py --quick --out benchmarks/results/parallelisms_quick.json
    python benchmarks/parallelisms.py --out benchmarks/results/parallelisms.json   # gpt-micro

Each layout is a point of the grid (mingpt_ddp/parallel/mesh.py: pp x dp_replicate x dp_shard x
cp x tp, the row's `degrees`) and trains a few steps (20 with --quick; 4 for the 16-rank grid of
all four) on random token windows through the project's GridStrategy and the Trainer's step
(trainer.step), one process per place of its mesh (started as torchrun starts its workers): the
data, tensor and context-parallel layouts on a global batch of G windows, a pipeline on m
microbatches of a fixed mb windows per replica (so a microbatch costs the same at every m, as
the bubble formula assumes). Per layout, per rank:
- max_abs_loss_diff: the largest difference of a step's loss to one process's (the parent runs
  that reference in-process, parallel=none, on the same global batches);
- sent bytes per step, counted on one steady step (the third: the first exchanges pipeline
  shapes, the second rebuilds DDP's buckets) by comm_bytes.CountBytes, a dispatch mode over the
  c10d ops, beside the formula (benchmarks/formulas.py) in the same unit, ring algorithms assumed;
- memory: parameters, gradients (one per parameter at the step's peak) and optimizer state this
  rank holds, and activations: the most bytes of tensors saved for backward alive at once
  (saved-tensor hooks; the parameters saved by matmuls left out); parameters and activations
  beside their formulas (formulas.param_bytes, formulas.activation_bytes: one process's / dp,
  / cp, / tp with sequence parallelism; none where no single ratio holds);
- pipelines: the bubble, each rank's idle share of the schedule's step: 1 - (time inside its
  stages' forward and backward chunks and the loss) / (the step's wall time), median of the timed
  steps, beside (p - 1) / (m + p - 1) (GPipe, 1F1B) or (p - 1) / (v m + p - 1) (interleaved, v
  stages per rank). The formula assumes equal stages and free hand-offs; with more ranks than
  cores (dp2 x pp2 on 2 cores) ranks wait for a core too, so read those bubbles as noise; and
  --quick's ops are so small that overheads make most of its steps: check losses and bytes with
  it, measure bubbles with the full run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import RANKS, hardware  # noqa: E402
from benchmarks.formulas import (  # noqa: E402
    param_bytes,
    routing_bytes,
    sent_bytes,
)
from benchmarks.layout_rows import DEGREES, label, row, table  # noqa: E402
from benchmarks.probes import SavedBytes, StageClock, live_peak, tracked_peak  # noqa: E402
from mingpt_ddp.planner.schedule import table_bubble  # noqa: E402

VOCAB = 65
# The model, the data-parallel layouts' global batch (G windows of T tokens), a pipeline
# microbatch (mb windows: fixed, so every microbatch costs the same at every m, as the bubble
# formula assumes; a pipeline's global batch is m x mb x dp), and the steps of each run.
SIZES = {
    "quick": dict(n_layer=4, n_head=2, n_embd=32, T=32, G=16, mb=2, steps=20),
    "full": dict(n_layer=4, n_head=4, n_embd=128, T=64, G=16, mb=4, steps=12),
}
WARMUP, COUNTED = 2, 2  # steps before the counted one; the counted step's index


def layouts(size: dict) -> list[dict]:
    """Every layout: its degrees (dp = dp_replicate x dp_shard), parallel, schedule, m
    microbatches, v stages per rank, G windows, and its steps (fewer for the 16-rank grid)."""
    hsdp = dict(dp_replicate=2, dp_shard=2, parallel="fsdp")
    rows = [dict(dp=1, pp=1, parallel="none"), dict(dp=2, pp=1, parallel="ddp")]
    rows += [dict(dp=2, pp=1, parallel="fsdp"), dict(hsdp)]
    rows += [dict(dp=1, pp=2, parallel="ddp", schedule="gpipe", m=m) for m in (1, 2, 4, 8)]
    rows += [dict(dp=1, pp=2, parallel="ddp", schedule="1f1b", m=m) for m in (2, 4, 8)]
    rows.append(dict(dp=1, pp=2, parallel="ddp", schedule="interleaved1f1b", m=4, v=2))
    # Zero bubble: one pipeline, and over FSDP replicas (DDP's are refused: pipeline.py).
    for schedule in ("interleavedzb", "zbv", "dualpipev"):
        v = dict(v=2) if schedule == "interleavedzb" else {}
        rows.append(dict(dp=1, pp=2, parallel="ddp", schedule=schedule, m=4, **v))
        rows.append(dict(dp=2, pp=2, parallel="fsdp", schedule=schedule, m=4, **v))
    rows.append(dict(dp=2, pp=2, parallel="ddp", schedule="gpipe", m=4))
    rows.append(dict(dp=2, pp=2, parallel="ddp", schedule="1f1b", m=4))
    rows += [dict(dp=1, tp=2, parallel="ddp"), dict(dp=1, tp=2, sp=True, parallel="ddp")]
    rows.append(dict(dp=2, tp=2, parallel="fsdp"))
    rows += [dict(dp=1, cp=2, parallel="ddp"), dict(dp=2, cp=2, parallel="ddp")]
    rows.append(dict(dp=1, cp=2, tp=2, parallel="ddp"))
    rows.append(dict(dp=1, pp=2, cp=2, parallel="ddp", schedule="1f1b", m=4))
    rows.append(dict(dp=1, pp=2, tp=2, parallel="ddp", schedule="1f1b", m=4))
    rows.append(dict(dp=2, pp=2, tp=2, parallel="fsdp", schedule="1f1b", m=4))
    # Expert parallelism (4 experts, top 2): alone, beside more data parallelism, FSDP, tensor
    # parallelism, and in a pipeline.
    moe = dict(ep=2, experts=4)
    rows.append(dict(dp=2, parallel="ddp", experts=4))  # ep1: DDP averages the experts too
    rows += [dict(dp=2, parallel="ddp", **moe), dict(dp=4, parallel="ddp", **moe)]
    rows += [dict(dp=2, parallel="fsdp", **moe), dict(dp=2, tp=2, parallel="fsdp", **moe)]
    rows.append(dict(dp=2, pp=2, parallel="ddp", schedule="1f1b", m=4, **moe))
    rows.append(dict(dp=2, parallel="ddp", ac="full", **moe))  # the exchanges recomputed
    rows.append(dict(dp=2, cp=2, parallel="ddp", aux=0.0, **moe))  # cp: the bias balances alone
    # The whole grid at once: 16 processes on however few cores, so few steps.
    rows.append(dict(dp=2, pp=2, cp=2, tp=2, parallel="ddp", schedule="1f1b", m=4, steps=4))
    for r in rows:
        if "dp_replicate" not in r:  # DDP replicates, FSDP shards: the mesh's -1 defaults
            fsdp = r["parallel"] == "fsdp"
            r.update(dp_replicate=1 if fsdp else r["dp"], dp_shard=r["dp"] if fsdp else 1)
        r["dp"] = r["dp_replicate"] * r["dp_shard"]
        r.update(pp=r.get("pp", 1), tp=r.get("tp", 1), cp=r.get("cp", 1))
        r["G"] = r["m"] * size["mb"] * r["dp"] if r["pp"] > 1 else size["G"]
        r.setdefault("steps", size["steps"])
    return rows


def batches(size: dict, step: int, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's global batch of G random token windows (the same for every layout of that G)."""
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (G, size["T"] + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]  # (G, T) inputs and targets


def build(layout: dict, size: dict, ctx):
    """The model and the grid strategy this layout trains it with (registry "grid": every
    torch-native layout, its degrees given as mesh_config would)."""
    from mingpt_ddp.config.context import ContextConfig
    from mingpt_ddp.config.deepspeed import DeepSpeedConfig
    from mingpt_ddp.config.mesh import MeshConfig
    from mingpt_ddp.config.optimizer import OptimizerConfig
    from mingpt_ddp.config.pipeline import PipelineConfig
    from mingpt_ddp.config.tensor import TensorConfig
    from mingpt_ddp.parallel.grid import GridStrategy
    from mingpt_ddp.parallel.plan import Plan
    from mingpt_ddp.parallel.strategy import StrategyArgs
    from mingpt_ddp.runtime.distributed import ControlPlane
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    shape = {k: size[k] for k in ("n_layer", "n_head", "n_embd")}
    experts = layout.get("experts", 0)
    # Experts balanced by both: the loss (the default) and the bias.
    moe = dict(n_experts=experts, bias_update_rate=1e-3 if experts else 0.0)
    moe["aux_loss_coef"] = layout.get("aux", 0.01)
    model = GPT(GPTConfig(**shape, vocab_size=VOCAB, block_size=size["T"], **moe))
    pipeline = PipelineConfig(
        layout["pp"], layout.get("schedule", "1f1b"), layout.get("m", 4), layout.get("v", 2)
    )
    degrees = {k: layout[k] for k in DEGREES}
    plan = Plan(
        layout["parallel"],
        use_amp=False,
        activation_checkpointing=layout.get("ac", "none"),
        pipeline=pipeline,
        tensor=TensorConfig(layout["tp"], layout.get("sp", False)),
        context=ContextConfig(layout["cp"]),
        mesh=MeshConfig(**degrees, ep=layout.get("ep", 1)),
    )
    optim = OptimizerConfig()
    batch = layout["G"] // layout["dp"]
    args = StrategyArgs(plan, ctx, optim, batch, 1, ControlPlane(), DeepSpeedConfig())
    return model, GridStrategy(model, args)


def share(layout: dict, step: int, size: dict, replica: int) -> list:
    """This replica's windows of a step's global batch, as the one micro-batch of the step."""
    x, y = batches(size, step, layout["G"])
    return [(x[replica :: layout["dp"]], y[replica :: layout["dp"]])]


def measure(layout: dict, size: dict) -> dict:
    """One rank's run of a layout: losses, counted bytes, memory, idle shares."""
    import torch.distributed as dist

    from benchmarks.comm_bytes import CountBytes
    from mingpt_ddp.parallel.plan import local_bytes
    from mingpt_ddp.runtime.distributed import DistContext
    from trainer import step as train_step

    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = DistContext(rank, rank, world, torch.device("cpu"), local_world_size=world)
    _, strategy = build(layout, size, ctx)
    r = strategy.plan.dims(world).coordinates(rank)["dp"]  # which replica's windows it reads
    clip = strategy.args.optim.grad_clip
    params = [p for opt in strategy.optimizers for g in opt.param_groups for p in g["params"]]
    losses, idle, sent, ops, saved = [], [], 0.0, {}, SavedBytes(params)
    routing, received, routed, tracked, live = 0.0, 0, [], {}, None
    pipeline = strategy.pipeline
    if pipeline is not None:  # the schedule's step alone: the optimizer's step is no bubble
        pipeline.schedule.step = StageClock.common_window(pipeline.schedule.step)
    for step in range(layout["steps"]):
        work = share(layout, step, size, r)
        StageClock.busy = StageClock.wall = 0.0
        if step == COUNTED - 1 and pipeline is None:  # a warm step, under the planner's trackers
            (loss, _), tracked = tracked_peak(strategy, train_step, iter(work), 1, clip)
        # probes.live_peak: a pipeline's warm step (no tracker runs its schedule); the other
        # layouts' last step, to hold it against their tracked peak
        elif step == COUNTED - 1 or (step == layout["steps"] - 1 > COUNTED and pipeline is None):
            (loss, _), live = live_peak(strategy, train_step, iter(work), 1, clip)
        elif step == COUNTED:
            with CountBytes() as counter, saved.hooks():
                loss, _ = train_step(strategy, iter(work), 1, clip)
            sent, ops = counter.sent_bytes(), {op: b for op, _, _, _, b in counter.rows()}
            routing, received = routing_bytes(strategy, size["n_embd"]), strategy.moe.received
        else:
            loss, _ = train_step(strategy, iter(work), 1, clip)
        if step > COUNTED and pipeline is not None:
            idle.append(1 - StageClock.busy / StageClock.wall)
        losses.append(None if loss is None else loss.item())
        routed.append(routed_by_block(strategy))
    return {
        "losses": losses,
        "routed": routed,  # per step: {MoE block: tokens per expert over the ranks}
        "sent": sent,
        "ops": ops,
        "formula": sent_bytes(layout, strategy, size) + routing,
        # the schedule's own action table at unit cost (planner/schedule.py: table_bubble)
        "table_bubble": table_bubble(pipeline.schedule.pipeline_order)
        if pipeline is not None and len(pipeline.stages) > 1  # a multi-stage schedule's table
        else None,
        "received": received,  # rows this rank's experts computed in the counted step
        "idle": statistics.median(idle) if idle else None,
        "params": local_bytes(params),
        "params_formula": param_bytes(layout, strategy),
        "optimizer": strategy.optimizer_state_bytes(),
        "saved": saved.peak,
        "tracked": tracked,  # peak by category (probes.tracked_peak), at step COUNTED - 1
        "live": live,  # peak bytes (probes.live_peak): a pipeline's at COUNTED - 1, else the last
    }


def worker() -> None:
    """One rank (RANK of WORLD_SIZE, as torchrun sets them) of the layout in
    $PARALLELISMS_LAYOUT; its numbers to $PARALLELISMS_OUT."""
    import torch.distributed as dist

    from mingpt_ddp.runtime.distributed import exit_process

    layout, size = json.loads(os.environ["PARALLELISMS_LAYOUT"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    StageClock.install()
    result = measure(layout, size)
    path = Path(os.environ["PARALLELISMS_OUT"]) / f"rank{dist.get_rank()}.json"
    path.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    exit_process(0)  # past gloo's exit-time destructors, which abort now and then


def routed_by_block(strategy) -> dict:
    """The step's tokens per expert of each MoE block this rank holds, by the block's name (a
    pipeline stage's blocks keep the whole model's numbers), summed over the ranks."""
    from mingpt_ddp.moe import MoE

    names = [n for m in strategy.modules for n, b in m.named_modules() if isinstance(b, MoE)]
    rows = strategy.moe.routed.tolist() if strategy.moe.routed is not None else []
    return dict(zip(names, rows))


def reference(size: dict, G: int, experts: int = 0, aux: float = 0.01) -> dict:
    """One process (parallel=none) over the same global batches: the losses to compare with, and
    the activations it saves for backward (what the formulas divide)."""
    from mingpt_ddp.runtime.distributed import DistContext
    from trainer import step as train_step

    torch.set_num_threads(1)
    layout = dict(dp=1, dp_replicate=1, dp_shard=1, pp=1, tp=1, cp=1, parallel="none", G=G)
    layout.update(experts=experts, aux=aux)
    _, strategy = build(layout, size, DistContext(0, 0, 1, torch.device("cpu")))
    saved, losses, routed = SavedBytes(strategy.model.parameters()), [], []
    clip = strategy.args.optim.grad_clip
    for step in range(size["steps"]):
        work = iter(share(layout, step, size, 0))
        with saved.hooks() if step == COUNTED else nullcontext():
            losses.append(train_step(strategy, work, 1, clip)[0].item())
            routed.append(routed_by_block(strategy))
    return {"losses": losses, "saved": saved.peak, "routed": routed}


def run_layout(layout: dict, size: dict) -> list[dict]:
    """Every rank's numbers for one layout: this file's worker() in each rank of a job started by
    ranks.py (as torchrun starts its workers, forked from one process that imported torch once;
    one failing rank ends the others)."""
    nproc = math.prod(layout[k] for k in DEGREES)
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PARALLELISMS_LAYOUT=json.dumps([layout, size]), PARALLELISMS_OUT=out)
        with open(Path(out) / "ranks.log", "w+") as log:
            job = subprocess.run(
                [sys.executable, RANKS, str(nproc), __file__],
                env=env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            if job.returncode:
                log.seek(0)
                sys.exit(f"{layout}: a rank failed\n{log.read()[-3000:]}")
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="a tiny model, 20 steps (4 in the 16-rank layout)"
    )
    p.add_argument("--out", help="write the JSON here (and the markdown table beside it, .md)")
    p.add_argument("--only", help='comma-separated layouts to run (e.g. "dp2 ddp,pp2 1f1b m=2")')
    p.add_argument("--steps", type=int, help="steps per layout, at least 4 (the tests run fewer)")
    args = p.parse_args()
    size = SIZES["quick" if args.quick else "full"]
    if args.steps:  # the counted step is the third; a pipeline's bubble is timed on those after
        size = {**size, "steps": max(4, args.steps)}
    t0, expected, rows = time.perf_counter(), {}, []
    chosen = [w.strip() for w in args.only.split(",")] if args.only else None
    for layout in layouts(size):
        if chosen is not None and label(layout) not in chosen:
            continue
        key = layout["G"], layout.get("experts", 0), layout.get("aux", 0.01)
        if key not in expected:
            expected[key] = reference(size, *key)
        rows.append(row(layout, run_layout(layout, size), expected[key]))
        print(f"{rows[-1]['layout']}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    result = {
        "hardware": hardware(),
        "size": size,
        "torch": torch.__version__,
        "rows": rows,
    }
    print(f"\n{result['hardware']}\n{table(rows)}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        Path(args.out).with_suffix(".md").write_text(table(rows) + "\n")


if __name__ == "__main__":
    if "PARALLELISMS_LAYOUT" in os.environ:
        worker()
    else:
        main()
