"""Snapshot benchmark: size, save time, load time and training stall, sync vs async, local vs S3.

    python benchmarks/snapshot_bench.py          # default model and a ~25M model, local + S3
    python benchmarks/snapshot_bench.py --smoke  # seconds: a tiny model, for CI
    python benchmarks/snapshot_bench.py --s3-endpoint http://minio:9000 --s3-bucket my-bucket

The stall is measured the honest way: the wall time of a short training run that
saves every few steps, minus the same run without saves, divided by the number of
saves. For async saves that includes the copy to CPU memory and any slowdown from
the background write competing for the CPU; `blocked` is only the time the
training loop spent inside the save call (for async: the copy to CPU memory). Without
--s3-endpoint, a moto_server (pip install 'moto[server]') is started on loopback as the S3 target.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from common import REPO

sys.path.insert(0, REPO)

import torch  # noqa: E402

from benchmarks.s3_local import MotoServer  # noqa: E402
from char_dataset import CharDataset, DataConfig  # noqa: E402
from mingpt_ddp.config.optimizer import OptimizerConfig  # noqa: E402
from mingpt_ddp.config.trainer import TrainerConfig  # noqa: E402
from mingpt_ddp.runtime.distributed import DistContext  # noqa: E402
from mingpt_ddp.snapshots.store import SnapshotStore  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from trainer import Trainer  # noqa: E402

MODELS = {  # name: (n_layer, n_head, n_embd)
    "default (4x128)": (4, 4, 128),
    "25M (8x512)": (8, 8, 512),
}


def make_trainer(
    dataset: CharDataset,
    shape: tuple[int, int, int],
    url: str,
    async_save: bool,
    endpoint: str,
    batch_size: int,
) -> Trainer:
    n_layer, n_head, n_embd = shape
    gcfg = GPTConfig(
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        vocab_size=dataset.vocab_size,
        block_size=dataset.config.block_size,
    )
    torch.manual_seed(0)
    tcfg = TrainerConfig(
        batch_size=batch_size, async_save=async_save, metrics_path="none", s3_endpoint_url=endpoint
    )
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    store = SnapshotStore(url, keep_last=2, s3_endpoint_url=endpoint)
    store.check_writable()
    return Trainer(
        GPT(gcfg), dataset, tcfg, OptimizerConfig(), ctx, {"gpt_config": vars(gcfg)}, store
    )


def timed_run(trainer: Trainer, steps: int, save_every: int) -> tuple[float, float]:
    """Wall time of `steps` training steps with a save every `save_every`, and the part of it
    spent blocked inside the save calls themselves."""
    t0, blocked = time.perf_counter(), 0.0
    for step in range(1, steps + 1):
        trainer.train_step()
        if save_every and step % save_every == 0:
            blocked += trainer.snapshots.save()
    elapsed = time.perf_counter() - t0
    trainer.store.wait()
    return elapsed, blocked


def bench(dataset, name, shape, target, url, endpoint, steps, save_every, batch_size) -> dict:
    base = make_trainer(dataset, shape, url + "/base", False, endpoint, batch_size)
    base.train_step()  # warm-up, and optimizer state exists from here on
    step_s = timed_run(base, steps, 0)[0] / steps
    saves = steps // save_every
    row = {
        "model": name,
        "params_M": round(base.num_params / 1e6, 2),
        "storage": target,
        "step_ms": round(1e3 * step_s, 1),
    }
    for mode in ("sync", "async"):
        trainer = make_trainer(
            dataset, shape, f"{url}/{mode}", mode == "async", endpoint, batch_size
        )
        trainer.train_step()
        elapsed, blocked = timed_run(trainer, steps, save_every)
        row[f"{mode}_stall_ms"] = round(1e3 * max((elapsed - step_s * steps) / saves, 0.0), 1)
        row[f"{mode}_blocked_ms"] = round(1e3 * blocked / saves, 1)
    store = trainer.store
    t0 = time.perf_counter()
    entry = store.save(trainer.state_dict(), trainer.step + 1)
    row["save_s"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    assert store.load_latest()["step"] == trainer.step
    row["load_s"] = round(time.perf_counter() - t0, 3)
    row["size_MB"] = round(entry["bytes"] / 1e6, 1)
    row["async_stall_steps"] = round(row["async_stall_ms"] / row["step_ms"], 2)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description="Snapshot size / save / load / stall benchmark.")
    p.add_argument("--data", default="data/tinyshakespeare/input.txt")
    p.add_argument("--smoke", action="store_true", help="a tiny model and a few steps (CI)")
    p.add_argument(
        "--s3-endpoint", default="", help="S3 endpoint to use instead of a local moto_server"
    )
    p.add_argument("--s3-bucket", default="snapshot-bench")
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--out", default="benchmarks/results/snapshot_bench.json")
    args = p.parse_args()

    dataset = CharDataset(DataConfig(path=args.data, block_size=64))
    models = {"smoke (2x32)": (2, 2, 32)} if args.smoke else MODELS
    steps, save_every, batch = (6, 3, 4) if args.smoke else (20, 5, 8)
    local_dir = tempfile.mkdtemp(prefix="snapshot-bench-")
    targets = {"local disk": local_dir}
    moto, endpoint = None, args.s3_endpoint
    if not args.no_s3:
        if not endpoint:
            os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
            os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
            moto = MotoServer()  # the tests' S3 server, on a free loopback port
            endpoint = moto.url
            import boto3

            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=args.s3_bucket)
        targets["S3 (" + endpoint + ")"] = f"s3://{args.s3_bucket}/bench"
    rows = []
    try:
        for name, shape in models.items():
            for target, url in targets.items():
                rows.append(
                    bench(dataset, name, shape, target, url, endpoint, steps, save_every, batch)
                )
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
        if moto is not None:
            moto.stop()
    cols = [
        "model",
        "params_M",
        "storage",
        "size_MB",
        "save_s",
        "load_s",
        "step_ms",
        "sync_stall_ms",
        "async_blocked_ms",
        "async_stall_ms",
        "async_stall_steps",
    ]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows},
            f,
            indent=1,
        )
    print(f"\nsaved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
