"""Process-group setup and teardown, and the few collective helpers the trainer uses.

Vocabulary, as used across this project:
- world size: how many training processes the job has in total (all nodes).
- rank: this process's id in the job, 0 .. world_size-1. Rank 0 is the one that
  prints and writes snapshots.
- local rank: this process's id on its own machine (node); it picks the GPU.
- process group: the set of processes that take part in collectives, plus the
  communication backend they use (nccl between GPUs, gloo between CPUs).
- all-reduce: a collective in which every rank contributes a tensor and every
  rank receives the element-wise sum (or mean, max...) of all of them.

torchrun (or SLURM, any launcher) sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT;
only this module reads them (horovodrun's HOROVOD_* become them first: horovodrun.py). A plain
`python main.py` sets none of them and runs as a world of one, with no process group at all.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.runtime import horovodrun
from mingpt_ddp.runtime.flight_recorder import silent_rank, use_flight_recorder


@dataclass(frozen=True)
class DistContext:
    """Who this process is in the job, and where its tensors live."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    restart_count: int = 0
    """How many times torchrun has restarted the worker group (TORCHELASTIC_RESTART_COUNT)."""
    local_world_size: int = 1
    """How many ranks run on this node (LOCAL_WORLD_SIZE); they share its cores and GPUs."""
    run_id: str = ""
    """torchrun's --rdzv_id (TORCHELASTIC_RUN_ID): the same in every restart of one job, on every
    node; "" when there is none (run alone, mp.spawn, or torchrun's default id "none", which every
    job shares)."""

    @property
    def is_main(self) -> bool:
        """Global rank 0 (not local rank 0: in a multi-node job every node has a local rank 0)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


def choose_device(
    requested: str, gpus: int, local_rank: int, local_world_size: int, group: int | None = None
) -> torch.device:
    """The device this rank computes on: its own GPU (picked by its local rank) or the CPU.

    requested is trainer_config.device (auto | cpu | cuda); gpus is how many GPUs this
    process can see. Every rank of a node checks the whole node (local_world_size), so
    they all stop with the same message instead of one failing while the others wait.
    group: torchft_config.group when replica groups are on (else None). Each group is a
    torchrun job of one process, LOCAL_RANK 0 in every one: the groups on a machine take
    GPU group % gpus instead of all sharing cuda:0 (CUDA_VISIBLE_DEVICES=<one GPU> per group
    picks by hand: then the group sees one GPU, cuda:0).
    """
    if requested == "cpu" or (requested == "auto" and gpus == 0):
        return torch.device("cpu")
    if gpus == 0:
        raise ConfigError(
            "trainer_config.device=cuda, but no GPU is visible (a CPU-only torch build, no "
            "driver, or CUDA_VISIBLE_DEVICES empty); fix that or set trainer_config.device=cpu"
        )
    if local_world_size > gpus or local_rank >= gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise ConfigError(
            f"{local_world_size} ranks on this node need one GPU each, but {gpus} GPU(s) are "
            f"visible (CUDA_VISIBLE_DEVICES={visible}); start at most {gpus} per node "
            f"(torchrun --nproc_per_node={gpus}) or set trainer_config.device=cpu to train on "
            "the CPU"
        )
    if group is not None and local_world_size == 1:
        return torch.device("cuda", group % gpus)
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """The process group's communication backends, per device type of the tensors it moves.

    GPU tensors go through nccl (GPU-to-GPU over NVLink / InfiniBand, no host copy).
    CPU tensors need gloo: the trainer's small control messages, the pickled objects of
    all_gather_object, and with FSDP CPU offload the gradient norm of CPU-resident
    shards. One group with both ("cuda:nccl,cpu:gloo") lets torch pick per tensor.
    """
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def setup_distributed(
    timeout_s: float = 600.0, device: str = "auto", trace_dir: str = "", group: int | None = None
) -> DistContext:
    """Join the process group described by the launcher's environment, or run alone.

    timeout_s bounds every collective: a rank that stops answering turns into an
    error on the others after that long, instead of a job that hangs forever.
    device is trainer_config.device: auto (a GPU per rank if there are GPUs), cpu, or cuda.
    trace_dir: where a GPU rank's flight recorder dumps its last collectives on a timeout.
    group: this torchft replica group's number (None without torchft): it picks the GPU.
    """
    global _IS_MAIN
    horovodrun.adopt()  # horovodrun's ranks, in torchrun's variables (nothing under torchrun)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not launched_with_ranks():
        chosen = choose_device(device, gpus, local_rank=0, local_world_size=1, group=group)
        if chosen.type == "cuda":
            torch.cuda.set_device(chosen)
        _IS_MAIN = True
        return DistContext(rank=0, local_rank=0, world_size=1, device=chosen)

    rank, local_rank, world_size, restart_count, local_world_size, run_id = _launcher_env()
    _IS_MAIN = rank == 0  # from here on print0 follows this process's rank
    chosen = choose_device(device, gpus, local_rank, local_world_size, group)
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)  # one GPU per process, by its rank on this node (or group)
    use_flight_recorder(trace_dir if chosen.type == "cuda" else None, restart_count)
    _join(chosen, rank, world_size, restart_count, timedelta(seconds=timeout_s))
    return DistContext(
        rank, local_rank, world_size, chosen, restart_count, local_world_size, run_id
    )


def _launcher_env() -> tuple[int, int, int, int, int, str]:
    """rank, local rank, world size, restart count, local world size and run id, as the launcher
    set them."""
    env = os.environ
    restart_count = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # torchrun (and accelerate, which runs it) says LOCAL_WORLD_SIZE; the deepspeed launcher
    # says LOCAL_SIZE.
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", "1")))
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    run_id = "" if run_id == "none" else run_id
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    return (
        rank,
        int(env.get("LOCAL_RANK", "0")),
        world_size,
        restart_count,
        local_world_size,
        run_id,
    )


def _join(device: torch.device, rank: int, world_size: int, restart_count: int, timeout) -> None:
    """init_process_group, through the launcher's store, in this attempt's own key space."""
    # Rendezvous through the key-value store at MASTER_ADDR:MASTER_PORT. torchrun
    # keeps that store alive across restarts of the workers, so each attempt gets
    # its own key space: otherwise a restarted group can read the dead attempt's
    # keys and hang while connecting (pytorch/pytorch#135712).
    global _JOB_STORE
    _JOB_STORE, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    _JOB_STORE.set(f"attempt_{restart_count}/world_size", str(world_size))
    store = dist.PrefixStore(f"attempt_{restart_count}", _JOB_STORE)
    # device_id binds the group to this rank's GPU: nccl connects now rather than at the
    # first collective, and barriers know which GPU to use.
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


# The launcher's key-value store. Under torchrun it outlives the workers, so one
# attempt can leave notes there for the next: why each rank of it exited.
_JOB_STORE: dist.Store | None = None


def record_exit(ctx: DistContext | None, reason: str) -> None:
    """Leave this rank's reason for exiting in the job store, for the next attempt to report."""
    if _JOB_STORE is not None and ctx is not None:
        try:
            _JOB_STORE.set(f"attempt_{ctx.restart_count}/exit/{ctx.rank}", reason[:500])
        except Exception:  # noqa: BLE001 - best effort: the store may be gone too
            pass


def previous_attempt_report(ctx: DistContext) -> str:
    """After a restart: which ranks of the previous attempt failed, and how (from their notes).

    A rank that left no note was killed outright (SIGKILL, the OOM killer, a lost
    node); ranks that did leave one usually failed because a peer vanished.
    """
    if ctx.restart_count == 0 or _JOB_STORE is None:
        return ""
    prefix = f"attempt_{ctx.restart_count - 1}"
    try:
        if not _JOB_STORE.check([f"{prefix}/world_size"]):
            return ""
        world = int(_JOB_STORE.get(f"{prefix}/world_size"))
        notes = {
            r: _JOB_STORE.get(f"{prefix}/exit/{r}").decode()
            for r in range(world)
            if _JOB_STORE.check([f"{prefix}/exit/{r}"])
        }
    except Exception:  # noqa: BLE001 - a report, never a reason to fail
        return ""
    parts = [silent_rank(r, ctx.restart_count - 1) for r in range(world) if r not in notes]
    parts += [f"rank {r}: {note}" for r, note in notes.items()]
    return f"previous attempt (world size {world}): " + "; ".join(parts)


def teardown_distributed() -> None:
    """Leave the process group. Called from `finally`, so it runs on errors too."""
    global _JOB_STORE
    if dist.is_initialized():
        dist.destroy_process_group()
    horovodrun.shutdown()  # Horovod's thread too, on every rank: none leaves it talking to a peer
    _JOB_STORE = None  # close the store connection now, not during interpreter shutdown


def exit_process(code: int) -> None:
    """End the process now, after teardown_distributed(), without C++ static destructors.

    After a clean teardown, gloo's exit-time destructors still abort about one
    process in 40 here with "terminate called without an active exception" (no
    Python frame involved), which turns a finished job into a failed one. By now
    everything is saved and the process group destroyed; only output needs flushing.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launched_with_ranks() -> bool:
    """Whether a launcher started this process as one rank of several (torchrun, SLURM,
    mp.spawn, horovodrun...)."""
    return "WORLD_SIZE" in os.environ or horovodrun.started()


# Whether this process is global rank 0: set by setup_distributed from the DistContext it
# returns. Before that (a config error at start-up) it is unknown: None.
_IS_MAIN: bool | None = None


def is_main_process() -> bool:
    """Global rank 0, as the DistContext says; before setup_distributed, as the launcher says."""
    if _IS_MAIN is not None:
        return _IS_MAIN
    # Not set up yet: the launcher's word (torchrun's, or horovodrun's), so one rank prints.
    return os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "0")) == "0"


_ONE_LINE = threading.Lock()


def print0(*args, file=None) -> None:
    """Print on global rank 0 only: one line per event, not one per process. The line goes out
    in one write: print() writes the text and its newline apart, and a line from another thread
    (a snapshot written in the background) landing between them can glue the two into one line,
    a step's line lost inside the snapshot's."""
    if is_main_process():
        stream = file or sys.stdout
        with _ONE_LINE:
            stream.write(" ".join(map(str, args)) + "\n")
            stream.flush()


def warn0(message: str) -> None:
    """A warning on rank 0, to stderr."""
    print0(f"WARNING: {message}", file=sys.stderr)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Average a tensor over all ranks (in place; a no-op in a single process)."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def all_gather_objects(obj):
    """Collect one picklable object from every rank (rank order); a list of one when alone.
    Pickled bytes travel as CPU tensors, through gloo (see ControlPlane.max)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class ControlPlane:
    """The collectives that coordinate the ranks, as opposed to those that move gradients: the
    per-step vote, start-up checks, means for log lines. They are handed to the strategies and
    the snapshot protocol rather than reached for, so that a mode with its own ranks and transport
    can hand in its own (Horovod does not need to: horovodrun.py); this one is torch.distributed's
    default process group (or nothing at all, alone)."""

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_mean(t)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def max(self, values: list[int]) -> list[int]:
        """Each position's largest value over all ranks, on every rank (an all-reduce with MAX).

        A CPU tensor, so it goes through gloo even in a GPU job (backend_for): the trainer
        votes every step, and on nccl a GPU tensor's .item() would make the CPU wait for
        every queued kernel, leaving the GPU idle meanwhile. A gloo timeout also raises an
        exception (and the rank's exit note is written), where an nccl one aborts the process.
        """
        if not dist.is_initialized():
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def gather(self, obj) -> list:
        return all_gather_objects(obj)
