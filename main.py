"""Entry point: read the config, join the process group, build data + model, train.

    python main.py                                         # one process
    torchrun --standalone --nproc_per_node=4 main.py       # four processes on this machine
    torchrun --standalone --nproc_per_node=4 main.py trainer_config.max_steps=500   # Hydra overrides

Every process of the job runs this same file. They differ only in the RANK /
LOCAL_RANK the launcher gives them (read in distributed.py). Rerunning the same
command resumes from the newest snapshot under trainer_config.snapshot_path.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import hydra
from omegaconf import DictConfig, OmegaConf

from versions import require_supported_torch

require_supported_torch()  # before the imports below, which need a recent torch

import torch

from char_dataset import CharDataset, DataConfig, DatasetError
from config import ConfigError, build_config, to_dict
from data.fetch_shakespeare import FetchError, ensure_tinyshakespeare
from distributed import (DistContext, all_gather_objects, barrier, exit_process, previous_attempt_report, print0,
                         record_exit, set_cpu_threads, setup_distributed, teardown_distributed)
from model import GPT, GPTConfig
from snapshot import SnapshotError, SnapshotStore
from train_config import OptimizerConfig, TrainerConfig
from trainer import Trainer

SCHEMA = {"data_config": DataConfig, "gpt_config": GPTConfig,
          "optimizer_config": OptimizerConfig, "trainer_config": TrainerConfig}
# Mistakes a user can fix; reported as one line and a non-zero exit, not a traceback.
USER_ERRORS = (ConfigError, DatasetError, SnapshotError, FetchError)


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
            raise FetchError(f"data_config.path: {e}; download it by hand or set data_config.path=<a UTF-8 file>") from None


def run(raw: dict[str, Any]) -> int:
    try:
        cfg = build_config(raw, SCHEMA)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    data_cfg, gpt_cfg, tcfg = cfg["data_config"], cfg["gpt_config"], cfg["trainer_config"]
    ctx = None
    try:
        ctx = setup_distributed(tcfg.collective_timeout_s, tcfg.device)
        threads = set_cpu_threads(ctx, tcfg.cpu_threads)
        print0(f"job | world size {ctx.world_size} | backend {torch.distributed.get_backend() if ctx.distributed else 'none'}"
               f" | device {ctx.device} | {threads} CPU threads per rank | restart {ctx.restart_count} | seed {tcfg.seed}")
        if ctx.restart_count and ctx.is_main:
            print0(f"restart | torchrun restarted the workers (TORCHELASTIC_RESTART_COUNT={ctx.restart_count}) | "
                   f"{previous_attempt_report(ctx) or 'no report from the previous attempt'}")
        on_all_ranks(lambda: fetch_default_corpus(data_cfg, ctx))
        # Every rank opens the prepared token file; the first to need it prepares it while the
        # others on its node (or on a shared cache_dir) wait on a file lock (prepare.py).
        dataset = on_all_ranks(lambda: CharDataset(data_cfg, tcfg.s3_endpoint_url, log=print0))
        print0(f"data | {data_cfg.path} | {dataset.num_tokens:,} characters | vocabulary {dataset.vocab_size} | "
               f"{len(dataset.train):,} train / {len(dataset.val):,} val windows of {data_cfg.block_size} | "
               f"{dataset.prepared.meta['dtype']} ids in {dataset.prepared.directory}")
        gpt_cfg.vocab_size, gpt_cfg.block_size = dataset.vocab_size, data_cfg.block_size
        torch.manual_seed(tcfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
        model = GPT(gpt_cfg)
        store = SnapshotStore(tcfg.snapshot_path, tcfg.keep_last, tcfg.s3_endpoint_url)
        # Probe the destination now, not at the first save an hour in: rank 0 writes single-file
        # snapshots; under FSDP every rank writes its own shards, so every rank probes.
        writes = ctx.is_main or tcfg.parallel == "fsdp"
        on_all_ranks(store.check_writable if writes else lambda: None)
        run_config = {name: to_dict(section) for name, section in cfg.items()}
        trainer = Trainer(model, dataset, tcfg, cfg["optimizer_config"], ctx, run_config, store)
        _KEEP_UNTIL_EXIT.append(trainer)
        on_all_ranks(trainer.resume)
        finished = trainer.train()
        # Leave together: a rank exiting while rank 0 still writes its last snapshot
        # has been seen to abort the gloo teardown ("terminate called without an active exception").
        barrier()
        # Stopped by a signal: non-zero, so schedulers (Kubernetes, SLURM) know the job is not done.
        return 0 if finished else 128 + (trainer.stop_signal or 15)
    except (StartupError, *USER_ERRORS) as e:
        record_exit(ctx, f"{type(e).__name__}: {e}")
        if ctx is None or ctx.is_main:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except BaseException as e:
        # Anything else (a peer vanished mid-collective, a timeout, a bug): note it for
        # the next attempt's report, then let it propagate with its traceback.
        record_exit(ctx, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    finally:
        teardown_distributed()


# An absolute config_path: the YAML is found wherever you launch from, and also when
# this module is imported by another entry point.
@hydra.main(config_path=os.path.dirname(os.path.abspath(__file__)), config_name="gpt2_train_cfg", version_base=None)
def main(cfg: DictConfig) -> None:
    # Hydra has merged the YAML with the command-line overrides; from here on the
    # config is plain data, validated by the dataclasses.
    sys.exit(run(OmegaConf.to_container(cfg, resolve=True)))


def cli() -> None:
    """Run main() and exit the process with its code."""
    try:
        main()
        code = 0
    except SystemExit as e:  # run()'s exit code, or Hydra's after it reported an error
        code = e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:  # a second Ctrl-C / SIGTERM: stop now, without a snapshot
        code = 130
    exit_process(code)


if __name__ == "__main__":
    cli()
