"""Entry point: read the config, join the process group, build data + model, train.

    python main.py                                    # one process
    torchrun --standalone --nproc_per_node=4 main.py  # four processes on this machine
    torchrun --standalone --nproc_per_node=4 main.py trainer_config.max_steps=500  # overrides
    python main.py model=gpt-mini parallel=none recipe=fast-cpu                     # config groups
    python main.py --multirun optimizer_config.learning_rate=1e-3,3e-3 model=tiny,gpt-micro
    python main.py --help                             # the groups, and every key with its meaning

Every process of the job runs this same file. They differ only in the RANK /
LOCAL_RANK the launcher gives them (read in mingpt_ddp/runtime/distributed.py). Rerunning the same
command resumes from the newest snapshot of the run (trainer_config.run_dir).
"""

from __future__ import annotations

import os
import sys
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from mingpt_ddp.runtime.versions import require_supported_torch

require_supported_torch()  # before the imports below, which need a recent torch

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf.errors import OmegaConfBaseException

from char_dataset import CharDataset, DataConfig, DatasetError
from data.fetch_shakespeare import FetchError, ensure_tinyshakespeare
from mingpt_ddp.config import schema as config
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.export.weights import initial_state
from mingpt_ddp.launch import (
    JobFailed,
    give_sweep_job_its_own_directory,
    hydra_error_line,
    stop_sweep_workers,
)
from mingpt_ddp.parallel.plan import precision_of
from mingpt_ddp.runtime.distributed import (
    DistContext,
    all_gather_objects,
    barrier,
    exit_process,
    is_main_process,
    previous_attempt_report,
    print0,
    record_exit,
    setup_distributed,
    teardown_distributed,
)
from mingpt_ddp.runtime.error_line import peer_gone, print_error
from mingpt_ddp.runtime.host import keep_freed_cpu_memory, set_cpu_threads
from mingpt_ddp.runtime.signals import stop_when_the_launcher_dies
from mingpt_ddp.snapshots.lease import LeaseError
from mingpt_ddp.snapshots.store import SnapshotError, SnapshotStore
from model import GPT
from trainer import Trainer

REPO = os.path.dirname(os.path.abspath(__file__))
config.register()  # the schema, the config groups and --help, for Hydra
# Mistakes a user can fix; reported as one line and a non-zero exit, not a traceback.
USER_ERRORS = (ConfigError, DatasetError, SnapshotError, FetchError, LeaseError)


# Objects that own the process group (DDP's reducer holds it) are kept alive until the
# process ends through exit_process(). Letting Python free them when run() returns
# destroys gloo's process group while this thread holds the GIL, and gloo's worker
# thread, which needs the GIL to release a tensor, can then never finish: a job that
# printed "done" hangs forever (seen on 1 rank in about 50 runs here).
_KEEP_UNTIL_EXIT: list = []


class StartupError(RuntimeError):
    """A start-up check failed on some rank; every rank stops with the same message."""


def on_all_ranks(what: Callable[[], Any]) -> Any:
    """Run a start-up step on every rank and stop them all if it failed on any.

    Without this, a rank that fails alone (say, its node lacks the data file)
    would leave the others waiting in their next collective until the timeout.
    """
    try:
        result, error = what(), None
    except USER_ERRORS as e:
        result, error = None, str(e)
    errors = [(rank, e) for rank, e in enumerate(all_gather_objects(error)) if e]
    if errors:
        rank, message = errors[0]
        raise StartupError(message if rank == 0 else f"on rank {rank}: {message}")
    return result


def fetch_default_corpus(cfg: DataConfig, ctx: DistContext) -> None:
    """Fetch tiny Shakespeare if the default data_config.path is missing, once per node.

    Local rank 0 downloads (nodes need not share a disk); the other ranks wait for
    it inside on_all_ranks, which every rank calls whether or not it fetches.
    """
    if ctx.local_rank == 0 and cfg.path == DataConfig.path and not os.path.exists(cfg.path):
        print(f"data | {cfg.path} not found | fetching tiny Shakespeare", flush=True)
        try:
            ensure_tinyshakespeare(cfg.path)
        except FetchError as e:
            raise FetchError(
                f"data_config.path: {e}; download it by hand or set data_config.path=<a UTF-8 file>"
            ) from None


def take_snapshot_path(store: SnapshotStore, ttl_s: float, ctx: DistContext) -> None:
    """One writer per snapshot path: global rank 0, the rank that commits, takes the path's lease
    for this job (mingpt_ddp/snapshots/lease.py) before anything is written; then every rank learns
    its generation, which names the files it writes. The job's identity is torchrun's run id, so a
    restarted worker group (or a new rank 0 after an elastic membership change) takes its own lease
    back at once."""
    if ttl_s <= 0:
        return  # trainer_config.lease_ttl_s=0: no lease, no fencing (docs/snapshots.md)
    how = on_all_ranks(
        lambda: store.acquire(ctx.run_id or uuid.uuid4().hex[:12], ttl_s) if ctx.is_main else ""
    )
    store.generation = all_gather_objects(store.generation)[0]
    print0(
        f"lease | {store.url} | generation {store.generation} | {how} | "
        f"renewed every {ttl_s / 4:g} s"
    )


@dataclass
class Outcome:
    """How one job ended, as its launcher and a sweep need it."""

    code: int
    """The exit code: 0 finished, 1 a user error (said in one line), 128+N stopped by signal N."""
    val_loss: float | None = None
    """The last validation loss (a sweep's objective); None if the job never evaluated."""


def run(job) -> Outcome:
    """Train one job (a config.job_schema() instance) on this process's rank."""
    tcfg, ctx, store = job.trainer_config, None, None
    try:
        group = job.torchft_config.group if job.torchft_config.groups else None  # picks its GPU
        ctx = setup_distributed(tcfg.collective_timeout_s, tcfg.device, tcfg.run_dir, group)
        if ctx.distributed:  # a SIGKILLed torchrun's workers save and stop, not train on alone
            stop_when_the_launcher_dies()
        announce_job(ctx, job)
        store = SnapshotStore(tcfg.snapshot_url, tcfg.keep_last, tcfg.s3_endpoint_url)
        trainer = build_trainer(job, ctx, store)
        finished = trainer.train()
        # Leave together: a rank exiting while rank 0 still writes its last snapshot
        # has been seen to abort the gloo teardown ("terminate called without an active exception").
        barrier()
        # Stopped by a signal: non-zero, so schedulers (Kubernetes, SLURM) know the job is not done.
        return Outcome(
            0 if finished else 128 + (trainer.stop_signal or 15), trainer.state.last_val_loss
        )
    except (StartupError, *USER_ERRORS) as e:
        record_exit(ctx, f"{type(e).__name__}: {e}")
        print_error(f"error: {e}")  # every rank has the same message: the first to fail says it
        return Outcome(1)
    except BaseException as e:
        # Anything else (a peer vanished mid-collective, a timeout, a bug): note it for
        # the next attempt's report, then let it propagate with its traceback.
        record_exit(ctx, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        if not (line := peer_gone(e)):
            raise
        print_error(line)  # another rank died: its output says why, a traceback here would not
        return Outcome(1)
    finally:
        if store is not None:
            store.release()  # the next run on this path need not wait for the lease to go stale
        teardown_distributed()


def build_trainer(job, ctx: DistContext, store: SnapshotStore) -> Trainer:
    """Data, model and Trainer; the snapshot path checked and taken; the newest snapshot loaded."""
    data_cfg, gpt_cfg, tcfg = job.data_config, job.gpt_config, job.trainer_config
    on_all_ranks(lambda: fetch_default_corpus(data_cfg, ctx))
    dataset = load_dataset(data_cfg, tcfg, ctx)
    gpt_cfg.vocab_size, gpt_cfg.block_size = dataset.vocab_size, data_cfg.block_size
    torch.manual_seed(tcfg.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's)
    run_config = {name: config.to_dict(getattr(job, name)) for name in config.sections()}
    model = GPT(gpt_cfg)
    if tcfg.init_from:  # fine-tuning: these weights, unless a snapshot of this run is resumed
        model.load_state_dict(initial_state(tcfg.init_from, gpt_cfg, dataset.tokenizer.chars))
    trainer = Trainer(
        model,
        dataset,
        tcfg,
        job.optimizer_config,
        ctx,
        run_config,
        store,
        job.deepspeed_config,
        config.modes(job),
    )
    if ctx.distributed:  # (a sweep's jobs are single processes: nothing to keep between them)
        _KEEP_UNTIL_EXIT.append(trainer)
    # Probe the destination now, not at the first save an hour in: rank 0 writes single-file
    # snapshots; where every rank writes its own files (a layout), every rank probes.
    writes = ctx.is_main or trainer.strategy.files is not None
    on_all_ranks(store.check_writable if writes else lambda: None)
    take_snapshot_path(store, tcfg.lease_ttl_s, ctx)
    on_all_ranks(trainer.start)  # heal from a live replica group (torchft), or resume
    return trainer


def announce_job(ctx: DistContext, job) -> None:
    """The job line (who, where, how many threads, which precision and why) and, after a restart,
    what the previous attempt left."""
    tcfg = job.trainer_config
    offloads = tcfg.fsdp_cpu_offload or job.deepspeed_config.offload_optimizer  # update on CPU
    threads = set_cpu_threads(ctx, tcfg.cpu_threads, optimizer_on_cpu=offloads)
    allocator = keep_freed_cpu_memory(ctx.device, tcfg.cpu_keep_freed_memory)
    use_amp, amp_dtype, why = precision_of(tcfg, ctx.device, config.modes(job))
    backend = torch.distributed.get_backend() if ctx.distributed else "none"
    print0(
        f"job | world size {ctx.world_size} | backend {backend} | device {ctx.device} | "
        f"{threads} CPU threads per rank | restart {ctx.restart_count} | seed {tcfg.seed} | "
        f"precision {amp_dtype + ' mixed' if use_amp else 'fp32'} ({why})"
        f"{' | ' + allocator if allocator else ''}"
    )
    if ctx.restart_count and ctx.is_main:
        print0(
            "restart | torchrun restarted the workers "
            f"(TORCHELASTIC_RESTART_COUNT={ctx.restart_count}) "
            f"| {previous_attempt_report(ctx) or 'no report from the previous attempt'}"
        )


def load_dataset(data_cfg: DataConfig, tcfg, ctx: DistContext) -> CharDataset:
    """Every rank opens the prepared token file. Local rank 0 goes first and, the first time,
    prepares it while its node's other ranks wait; then they open what it prepared. (Nodes that
    share a cache_dir are kept apart by a file lock: mingpt_ddp/corpus/prepare.py.)"""
    open_it = lambda: CharDataset(data_cfg, tcfg.s3_endpoint_url, log=print0)  # noqa: E731
    first = on_all_ranks(open_it if ctx.local_rank == 0 else lambda: None)
    dataset = on_all_ranks(lambda: first if first is not None else open_it())
    print0(
        f"data | {data_cfg.path} | {dataset.num_tokens:,} characters | "
        f"vocabulary {dataset.vocab_size} | {len(dataset.train):,} train / "
        f"{len(dataset.val):,} val windows of {data_cfg.block_size} "
        f"| {dataset.prepared.meta['dtype']} ids in {dataset.prepared.directory}"
    )
    return dataset


def to_job(cfg: DictConfig) -> Any:
    """The composed config as dataclasses (each section's __post_init__ checks its ranges).

    Hydra refuses an unknown key written as `key=value`, but applies `+key=` and `++key=` with
    its struct check off, and to_object would then drop the stray key without a word: so the
    composed keys are compared with the schema here, whatever wrote them."""
    if unknown := config.unknown_keys(cfg):
        raise config.unknown_key_error(unknown[0])
    return OmegaConf.to_object(cfg)


def compose(overrides: list[str]) -> Any:
    """The config main.py would run with these overrides, without main.py's command line (for
    other entry points: tutorials/spawn_launch.py, tests)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=REPO, version_base=None):
        return hydra_compose(config_name="gpt2_train_cfg", overrides=overrides)


def train_job(cfg: DictConfig) -> float:
    """Hydra's task function: one job, in this process. Returns its last validation loss, the value
    sweepers (Optuna...) minimise. A failure ends a single run with its exit code; in a sweep it
    fails this job (the other jobs go on) and a stop signal ends the sweep.

    It lives in this module under its own name, undecorated, so that joblib and submitit pickle it
    by reference (the worker imports main.py, which registers the config, and runs the job)."""
    sweep = HydraConfig.get().mode == RunMode.MULTIRUN
    problem = give_sweep_job_its_own_directory(cfg) if sweep else ""
    if problem:  # refused before any job: rank 0 says why and fails; under torchrun the other ranks
        print0(f"error: {problem}", file=sys.stderr)  # the others: quiet, so none is killed first
        raise SystemExit(1 if is_main_process() else 0)
    try:
        outcome = run(to_job(cfg))
    except ConfigError as e:  # a range, a combination or an unknown key: one line, exit 1
        print_error(f"error: {e}")
        outcome = Outcome(1)
    if outcome.code and (outcome.code > 128 or not sweep):  # a stop signal ends a whole sweep
        raise SystemExit(outcome.code)
    if outcome.code:
        raise JobFailed(outcome.code, HydraConfig.get().runtime.output_dir)
    return float("nan") if outcome.val_loss is None else outcome.val_loss


# An absolute config_path: the YAML is found wherever you launch from, and also when
# this module is imported by another entry point. Hydra has composed the schema, the config
# groups, the YAML and the command line, and refused unknown keys and wrong types, before it
# calls train_job.
main = hydra.main(config_path=REPO, config_name="gpt2_train_cfg", version_base=None)(train_job)


def cli() -> None:
    """Run main() and exit the process with the job's code (a sweep: non-zero if any job failed)."""
    # Hydra's errors reach this function as exceptions, not as Hydra's printed report, so a config
    # typo reads the same wherever it was written (unless the user asked for Hydra's full trace).
    trace = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    # A launcher's workers (joblib's processes, submitit's SLURM jobs) import this module to run
    # train_job: let them find it wherever the sweep was launched from.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    try:
        if "--help" in sys.argv[1:]:  # ours, for speed (config.help_page says why)
            print(config.help_page(REPO, "gpt2_train_cfg", sys.argv[1:]))
        else:
            main()
        code = 0
    except JobFailed as e:  # the first failed job of a sweep, re-raised by Hydra's sweeper
        print_error(f"error: {e}")
        code = e.code
    except (HydraException, OmegaConfBaseException) as e:
        if trace:
            raise
        print_error(hydra_error_line(e))
        code = 1
    except SystemExit as e:  # a single run's code, a stop signal, or Hydra's after its report
        code = e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:  # a second Ctrl-C / SIGTERM: stop now, without a snapshot
        code = 130
    except Exception:  # a bug, or a peer that vanished: the traceback, and a failed exit
        traceback.print_exc()
        code = 1
    stop_sweep_workers()
    exit_process(code)


if __name__ == "__main__":
    # Run as `python main.py`, this file is the module __main__, whose functions a launcher
    # would pickle by value with everything they reach. Run it as the module `main` instead,
    # so Hydra's joblib and submitit launchers pickle train_job by name.
    import main as story

    story.cli()
