"""The bug zoo's exhibits that need several ranks: each function runs on every rank of a gloo
group (collectives inside), and returns its Row on rank 0 (None elsewhere).

The buggy variants are copies of the project's trainer.micro_steps that differ from it in one
line, or one decision taken the other way; the zoo's step (base.train_step) is trainer.step with
such a copy in micro_steps' place, around the project's own DDP strategy: the rest is the
project's.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from bugs.base import (
    BATCH,
    BLOCK,
    CPU,
    Batch,
    MicroSteps,
    Row,
    build,
    close,
    tiny_gpt,
    train_step,
    windows,
)
from mingpt_ddp.metrics import LogWindow
from mingpt_ddp.parallel.strategy import Strategy
from mingpt_ddp.runtime.distributed import ControlPlane, DistContext

ACCUM = 2  # micro-steps per optimizer step


def loss_not_divided(s: Strategy, batches: Iterator[Batch], n: int) -> torch.Tensor:
    """Bug 1: each micro-step's loss backpropagated whole, so the gradients are summed over the
    micro-steps instead of averaged (a classic of training scripts' issue trackers)."""
    loss = torch.zeros((), device=s.device)
    for micro, (x, y) in enumerate(batches):
        with s.gradient_sync(micro == n - 1):
            _, micro_loss = s.train_model(x, y)
        s.scaler.scale(micro_loss).backward()  # the bug: not micro_loss / n
        loss += micro_loss.detach() / n
    return loss


def no_sync_around_backward(s: Strategy, batches: Iterator[Batch], n: int) -> torch.Tensor:
    """Bug 2: no_sync around the backward only. DDP reads require_backward_grad_sync (what no_sync
    switches off) in its forward: _post_forward calls reducer.prepare_for_backward there, so a
    forward outside no_sync has already armed the all-reduce its backward will do."""
    loss = torch.zeros((), device=s.device)
    for micro, (x, y) in enumerate(batches):
        _, micro_loss = s.train_model(x, y)  # the bug: forward outside gradient_sync
        with s.gradient_sync(micro == n - 1):
            s.scaler.scale(micro_loss / n).backward()
        loss += micro_loss.detach() / n
    return loss


def count_allreduces(calls, bucket):  # no annotations: DDP inspects a comm hook's signature
    """Comm hook: count the bucket all-reduce, then do DDP's own (the default hook)."""
    calls.append(bucket.index())
    return allreduce_hook(None, bucket)  # None: the default group


def on_rank0(row: Row) -> Row | None:
    return row if dist.get_rank() == 0 else None


def global_batch(ids: torch.Tensor, accum: int = ACCUM) -> torch.Tensor:
    """One global batch of window starts, the same on every rank: (W * accum * B,)."""
    count = dist.get_world_size() * accum * BATCH
    order = torch.randperm(len(ids) - BLOCK - 1, generator=torch.Generator().manual_seed(1))
    return order[:count]


def one_process(ids: torch.Tensor, vocab: int, starts: torch.Tensor) -> dict:
    """The reference: one process, the whole global batch in one micro-step (parallel=none)."""
    strategy = build(tiny_gpt(vocab))
    loss, _ = train_step(strategy, iter([windows(ids, starts)]), 1)
    return {"loss": loss.item(), "norm": strategy.grad_norm()}


def ddp_step(ids, vocab, starts, micro_steps: MicroSteps | None = None, accum: int = ACCUM) -> dict:
    """One optimizer step of the project's DDP strategy, by the project's step (or by it with a
    buggy micro_steps), on this rank's share of the global batch: its own loss (a tensor), the
    gradient norm, the all-reduces."""
    rank, world = dist.get_rank(), dist.get_world_size()
    strategy = build(tiny_gpt(vocab), "ddp", accum)
    calls: list[int] = []
    strategy.train_model.register_comm_hook(calls, count_allreduces)
    # micro-step m of rank r: the (m * W + r)-th slice of B windows, as DataCursor deals them
    micro = [windows(ids, starts[(m * world + rank) * BATCH :][:BATCH]) for m in range(accum)]
    loss, _ = train_step(strategy, iter(micro), accum, micro_steps)
    weights = torch.cat([p.detach().flatten() for p in strategy.model.parameters()])  # (P,)
    return {"loss": loss, "norm": strategy.grad_norm(), "allreduces": len(calls), "w": weights}


def grad_accum_not_divided(ids: torch.Tensor, vocab: int) -> Row | None:
    starts = global_batch(ids)
    one = one_process(ids, vocab, starts)
    bug, project = ddp_step(ids, vocab, starts, loss_not_divided), ddp_step(ids, vocab, starts)
    same_step = torch.allclose(bug["w"], project["w"])
    return on_rank0(
        Row(
            "grad_accum_not_divided",
            f"gradient norm {bug['norm']:.4f} against {one['norm']:.4f} for one process on the "
            f"same global batch ({bug['norm'] / one['norm']:.2f}x at {ACCUM} micro-steps); "
            f"the project's {project['norm']:.4f}; the weights after the step: "
            f"{'the same' if same_step else 'different'}",
            f"equivalence with one process: one step's gradient norm, 2 ranks x {ACCUM} "
            "micro-steps against one process on the whole global batch",
            not close(bug["norm"], one["norm"]),
            close(project["norm"], one["norm"]),
            [
                "Clipping (grad_clip 1.0, below both norms) cuts both gradients to one norm,",
                "and AdamW's m / sqrt(v) is blind to scale anyway: the loss cannot show it, the",
                "logged grad_norm does. Unclipped, SGD would step that many times too far.",
            ],
        )
    )


def no_sync_backward(ids: torch.Tensor, vocab: int) -> Row | None:
    runs = {}
    for name, micro_steps in (("bug", no_sync_around_backward), ("project", None)):
        alone = ddp_step(ids, vocab, global_batch(ids, 1), micro_steps, accum=1)
        runs[name] = (alone["allreduces"], ddp_step(ids, vocab, global_batch(ids), micro_steps))
    (bug_one, bug), (one, project) = runs["bug"], runs["project"]
    return on_rank0(
        Row(
            "no_sync_around_backward",
            f"{bug['allreduces']} gradient all-reduces per optimizer step at {ACCUM} "
            f"micro-steps (the project: {project['allreduces']}; without accumulation: "
            f"{one}); the same loss on rank 0 ({bug['loss'].item():.4f} and "
            f"{project['loss'].item():.4f}) and gradient norm ({bug['norm']:.4f} and "
            f"{project['norm']:.4f}): the loss cannot show it",
            f"a count of all-reduces (a DDP comm hook): a step of {ACCUM} micro-steps must "
            "all-reduce as often as a step of one",
            bug["allreduces"] != bug_one,
            project["allreduces"] == one,
            [
                "DDP decides in its forward whether the backward will all-reduce: no_sync must",
                "cover the forward; wrapped around the backward alone it changes nothing.",
            ],
        )
    )


def logged_loss_rank0(ids: torch.Tensor, vocab: int) -> Row | None:
    starts = global_batch(ids)
    one, run = one_process(ids, vocab, starts), ddp_step(ids, vocab, starts)
    window = LogWindow(0, CPU)
    window.add(run["loss"])
    logged = window.mean_loss(ControlPlane())  # collective: every rank calls it
    own = [None] * dist.get_world_size()
    dist.all_gather_object(own, run["loss"].item())
    return on_rank0(
        Row(
            "logged_loss_rank0_only",
            f"rank 0 logs {own[0]:.4f}, rank 1 would log {own[1]:.4f}; one process on the same "
            f"global batch: {one['loss']:.4f}; the project logs {logged:.4f}",
            "equivalence with one process: the logged loss of one step against one process's "
            "loss on the whole global batch",
            not close(own[0], one["loss"]),
            close(logged, one["loss"]),
            [
                "Each rank's loss is over its own share of the batch; only the mean over the ranks",
                "is the loss of the step every replica took.",
            ],
        )
    )


def writers_of(path: str, saves: bool, state: dict) -> int:
    """Save state to path on the ranks where `saves`; how many ranks wrote it (each writer notes
    its rank beside the file, O_APPEND: one line each, whole)."""
    if saves:
        with open(path + ".writers", "a") as note:
            note.write(f"{dist.get_rank()}\n")
        torch.save(state, path)
    dist.barrier()  # every writer has finished
    if not os.path.exists(path + ".writers"):
        return 0
    with open(path + ".writers") as note:
        return len(note.read().split())


def save_on_local_rank0(ids: torch.Tensor, vocab: int) -> Row | None:
    folder = [tempfile.mkdtemp(prefix="bug-zoo-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)  # one snapshot path for the job, as run_dir is
    # Two nodes of one rank each: global ranks 0 and 1, each local rank 0 on its node.
    ctx = DistContext(dist.get_rank(), 0, dist.get_world_size(), CPU, local_world_size=1)
    state = tiny_gpt(vocab).state_dict()
    bug = writers_of(os.path.join(folder[0], "bug.pt"), ctx.local_rank == 0, state)
    project = writers_of(os.path.join(folder[0], "project.pt"), ctx.is_main, state)
    dist.barrier()  # every rank has counted: the folder may go
    if dist.get_rank() == 0:
        for name in os.listdir(folder[0]):
            os.remove(os.path.join(folder[0], name))
        os.rmdir(folder[0])
    return on_rank0(
        Row(
            "save_on_local_rank0",
            f"{bug} writers of one snapshot path on 2 nodes (the project: {project}): two "
            "processes truncating and writing the same file at once",
            "writers per snapshot path: the ranks that wrote it, noted beside it",
            bug > 1,
            project == 1,
            [
                "Every node has a local rank 0; on a shared file system all of them write the",
                "same path at once. Global rank 0 is one process in the whole job.",
            ],
        )
    )
