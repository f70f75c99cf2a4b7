"""Peak memory of one rank, by category: traced where torch can run the layout in one process,
estimated from shapes where it cannot.

Traced: the project's own model and strategy (model.py, parallel/grid.py), built for the layout
under torch's fake process group (`init_process_group("fake")`: every collective returns at
once, nothing is sent, and each rank's share is what it would be on N ranks) and FakeTensorMode
(tensors with shapes and no storage), through two training steps; torch's memory trackers count
every tensor by what it is: FSDPMemTracker for FSDP layouts, MemTracker for one replica
(DDP's own bucket copy of the gradients added, as its reducer allocates it in C++ where the
tracker cannot see). The mesh is built before FakeTensorMode (init_device_mesh raises inside).

Estimated (tensor, context and pipeline parallelism, which FakeTensorMode cannot run through
DTensor's sharding propagation or the pipeline's sends): each category from the shapes, with the
activations of one block measured by a trace of the same width and batch (a 1-block and a
2-block model; their difference is a block's) and cut as each dimension cuts them (Korthikanti et
al., 2205.05198, with attention's scores never stored: SDPA's fused kernels). A pipeline rank's
activations, passing tensors and gradients are those of the peak moment of its schedule
(schedule.py walks torch's action table).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import math
from functools import partial
from unittest.mock import patch

import torch
import torch.distributed as dist

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.planner import moe, schedule
from mingpt_ddp.planner.shapes import Layout, Model
from mingpt_ddp.runtime.distributed import ControlPlane

# The categories the planner reports, and the trackers' names folded into them.
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "buffers")
FOLD = {
    "Parameter": "parameters",
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporaries",
    "All Gather": "buffers",
    "Reduce Scatter": "buffers",
    "Buffer": "buffers",
    "Other": "buffers",
}


def traceable(model: Model, layout: Layout) -> bool:
    """Whether one process can run the layout under the fake group and fake tensors (a
    mixture of experts cannot: its rows per expert are data, which fake tensors do not have)."""
    return layout.tp == layout.pp == layout.cp == 1 and not model.n_experts


def fold(snapshot: dict) -> dict[str, int]:
    """A tracker's peak snapshot ({device: {category: bytes}}) in the planner's categories."""
    found = dict.fromkeys(CATEGORIES, 0)
    for per_device in snapshot.values():
        for kind, nbytes in per_device.items():
            name = getattr(kind, "value", kind)
            if name != "Total":
                found[FOLD[name]] += nbytes
    return found


def trace(
    model: Model, layout: Layout, buckets: bool = True, forward_only: bool = False
) -> dict[str, int]:
    """Rank 0's peak bytes by category over two training steps (the first builds AdamW's
    state); buckets: add DDP's; forward_only: what one forward holds for backward instead
    (_traced_steps). Owns the default group while it runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mingpt_ddp import optim
    from mingpt_ddp.parallel import grid
    from mingpt_ddp.parallel.mesh import ParallelDims

    clip = torch.nn.utils.clip_grads_with_norm_
    world = layout.gpus if layout.parallel == "fsdp" else 1  # DDP: one replica's memory
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        plan, ctx = _plan(layout, world)
        mesh = plan.dims(world).build(torch.device("cpu")) if world > 1 else None
        # The mesh made outside the fake mode; attention in bf16 under autocast (the start-up
        # timing that picks it here would time fake kernels); AdamW's plain per-parameter loop,
        # whose state is the fused kernel's: traced, the fused and foreach kernels on FSDP's
        # DTensors were counted at 9.7-12.3 GiB for GPT-2 large's 0.77 GiB of state on 8 ranks;
        # clipping's foreach scaling, at the whole model's size (24.8 GiB for the 7B on 8).
        with (
            patch.object(ParallelDims, "build", lambda self, device: mesh),
            patch.object(grid, "autocast_attention_fp32", lambda *_: (False, "bf16, as on GPUs")),
            patch.object(optim, "update_kernel", lambda *_: {"fused": False, "foreach": False}),
            patch.object(torch.nn.utils, "clip_grads_with_norm_", partial(clip, foreach=False)),
            FakeTensorMode(allow_non_fake_inputs=True),
        ):
            peak = _traced_steps(model, layout, plan, ctx, forward_only)
    finally:
        dist.destroy_process_group()
    if buckets and not forward_only and layout.parallel != "fsdp" and layout.gpus > 1:
        peak["buffers"] += 4 * model.params()
    return peak


def _plan(layout: Layout, world: int):
    from mingpt_ddp.config.mesh import MeshConfig
    from mingpt_ddp.parallel.plan import Plan
    from mingpt_ddp.runtime.distributed import DistContext

    parallel = "fsdp" if layout.parallel == "fsdp" and world > 1 else "none"
    degrees = dict(dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard) if world > 1 else {}
    plan = Plan(
        parallel,
        use_amp=layout.dtype != "fp32",
        activation_checkpointing=layout.ac,
        mesh=MeshConfig(**degrees),
    )
    return plan, DistContext(0, 0, world, torch.device("cpu"), local_world_size=world)


def story():
    """The project's GPT (model.py) and training step (trainer.step): the trace runs the real
    ones. They are the story, which runs from the checkout and is not installed (pyproject.toml),
    and which the package never imports by name (tests/test_house.py): the planner, the one
    machinery that must run them, loads them from the checkout by name, here only."""
    try:
        model, trainer = (importlib.import_module(name) for name in ("model", "trainer"))
    except ImportError as e:
        raise ConfigError(
            f"the planner traces this project's model.py and trainer.py, not found ({e}): run "
            "it from the checkout, where they are"
        ) from e
    return model.GPT, model.GPTConfig, trainer.step


class Alike(ControlPlane):
    """The start-up checks' answers when every rank is this one: a fake group carries tensors'
    shapes, not the pickled objects the checks gather."""

    def gather(self, obj) -> list:
        return [obj] * dist.get_world_size()


def _traced_steps(model: Model, layout: Layout, plan, ctx, forward_only: bool) -> dict[str, int]:
    """Two steps' peak by category (the second holds AdamW's state, made in the first); or,
    with forward_only, what a forward leaves held for backward (the snapshot after it)."""
    from mingpt_ddp.config.deepspeed import DeepSpeedConfig
    from mingpt_ddp.config.optimizer import OptimizerConfig
    from mingpt_ddp.parallel.grid import GridStrategy
    from mingpt_ddp.parallel.strategy import StrategyArgs

    GPT, GPTConfig, step = story()
    gc.collect()  # the last trace's fake tensors gone before this tracker starts counting
    shape = dict(n_layer=model.n_layer, n_head=model.n_head, n_embd=model.n_embd)
    gpt = GPT(GPTConfig(**shape, vocab_size=model.vocab, block_size=model.block))
    args = StrategyArgs(plan, ctx, OptimizerConfig(), layout.batch, 1, Alike(), DeepSpeedConfig())
    strategy = GridStrategy(gpt, args)
    x = torch.randint(0, model.vocab, (layout.batch, model.block))  # (B, T)
    tracker = tracker_for(strategy)
    if forward_only:
        with tracker, strategy.forward_context():
            _, loss = strategy.train_model(x, x)  # the loss, and the graph behind it
            gc.collect()
            return fold(tracker.get_tracker_snapshot()) if loss is not None else {}
    with tracker:  # from the start: the tracker counts what it sees made (fake tensors)
        step(strategy, iter([(x, x)]), 1, 1.0)
        tracker.reset_mod_stats()  # (per-module stats of one iteration at a time)
        step(strategy, iter([(x, x)]), 1, 1.0)
    return fold(tracker.get_tracker_snapshot("peak"))


def tracker_for(strategy):
    """torch's memory tracker for a built strategy: FSDPMemTracker for an FSDP (or HSDP) model,
    whose categories know its gathered and sharded tensors; MemTracker for the rest, told of
    every module and optimizer. The planner's traces and the benchmark's real runs
    (benchmarks/probes.tracked_peak) use this one choice, so their categories compare."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if strategy.pipeline is None and strategy.parts[0].data_parallel in ("fsdp", "hsdp"):
        return FSDPMemTracker(strategy.train_model, strategy.optimizers[0])
    tracker = MemTracker()
    tracker.track_external(*strategy.modules, *strategy.optimizers)
    return tracker


def estimate(model: Model, layout: Layout, traced: dict) -> dict:
    """Rank 0's peak by category from shapes, and from calibrate's traced numbers for one forward
    unit (a microbatch's windows, T / cp tokens) on one rank: "block", what one block keeps for
    backward; "rest", what the model keeps outside its blocks (embeddings' output, logits, loss);
    "temporaries", backward's passing tensors (the logits' gradient the largest)."""
    from mingpt_ddp.planner.traffic import wrapper

    held, gathered, grads = _states(model, layout)
    # A block's activations, cut by sequence parallelism's tp (every position split), or, by
    # tensor parallelism alone, only its insides (24 of Korthikanti's 34 units); a mixture of
    # experts' own on top (moe.py).
    act = traced["block"] * (1 / layout.tp if layout.sp else (10 + 24 / layout.tp) / 34)
    act += moe.extra_activations(model, layout)
    again = 0.0  # under checkpointing, the block recomputed in backward holds all of its own
    if layout.ac == "full":  # and every block only its input (fp32, the residual stream)
        act, again = layout.micro * (model.block // layout.cp) * model.n_embd * 4, act
    found = {
        "parameters": held + gathered,
        "gradients": held,
        "optimizer": 2 * held,
        "activations": model.n_layer * act + again + traced["rest"],
        "temporaries": traced["temporaries"],
        # DDP's bucket copy of the gradients it averages (none without replicas)
        "buffers": held - grads["experts"] if wrapper(layout) == "ddp" else 0.0,
    }
    if layout.pp > 1:  # the schedule's peak moment; gradients whole there, FSDP's too: a
        # stage accumulates them unsharded (fp32) until the step's last backward
        costs = schedule.stage_costs(model, layout, act, traced["rest"], grads["stages"])
        passing = traced["temporaries"] + again
        found.update(schedule.walk(schedule.actions(layout), costs, passing))
    return found


def _states(model: Model, layout: Layout) -> tuple[float, float, dict]:
    """Rank 0's fp32 parameter bytes (FSDP's shards of those it shards, the experts that
    expert parallelism gave it whole), the compute copies FSDP gathers, and gradient bytes:
    {"stages": each pipeline stage's, "experts": the experts'}."""
    from mingpt_ddp.planner.traffic import local_shapes, shards_of, shared_out

    C, V, T = model.n_embd, model.vocab, model.block
    shared = {k: v for k, v in model.block_tensors().items() if k not in shared_out(layout)}
    block = sum(math.prod(s) for s in local_shapes(shared, layout.tp).values())
    own = moe.expert_elements(model, layout)  # per block, whole on this rank
    mine = schedule.my_stages(model, layout) if layout.pp > 1 else []
    stages = schedule.stage_elements(model, layout, block) if mine else {}
    root = sum(math.prod(s) for s in model.root_tensors().values())
    elements = sum(stages.values()) if mine else model.n_layer * block + root
    blocks = sum(b for _, b in mine) if mine else model.n_layer
    shards = shards_of(layout)
    held = (elements / shards + blocks * own) * 4
    gathered = 0.0
    if layout.parallel == "fsdp" and shards > 1:  # the compute copies FSDP gathers: the root's
        # and two blocks at a time; a pipeline stage's all, kept from its first backward to the
        # step's end (torch's stage turns resharding after backward off until then)
        gathered = (elements if mine else (V + T) * C + 2 * block) * layout.itemsize
    grads = {s: (stages[s] + b * own) * 4 for s, b in mine}
    return held, gathered, {"stages": grads, "experts": blocks * own * 4}


def calibrate(model: Model, layout: Layout) -> dict[str, float]:
    """What estimate needs for one forward unit of this layout, from traces of a 1-block and a
    2-block model of the same width, vocabulary and unit, in this process."""
    unit = Layout(batch=layout.micro, dtype=layout.dtype, parallel="ddp")
    # a mixture of experts as its dense model (moe.py adds the difference)
    short = dataclasses.replace(model, block=model.block // layout.cp, n_experts=0)
    one, two = (
        trace(dataclasses.replace(short, n_layer=n), unit, forward_only=True) for n in (1, 2)
    )
    block = two["activations"] - one["activations"]  # held after forward: no moment to pick
    peak = trace(dataclasses.replace(short, n_layer=1), unit)
    return {"block": block, "rest": one["activations"] - block, "temporaries": peak["temporaries"]}
