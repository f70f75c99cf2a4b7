"""DDP vs FSDP vs AMP: per-rank memory, tokens/s and snapshot save time, each under real torchrun.

    python benchmarks/fsdp_bench.py --data data/tinyshakespeare/input.txt  # full table
    python benchmarks/fsdp_bench.py --smoke --data ...                      # seconds, for CI

The driver starts one `torchrun` job per configuration and collects what rank 0
reports. Memory is what one rank holds for parameters + gradients + optimizer state
(for FSDP: its shards), measured from the tensors themselves after a backward pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from common import REPO, main_command, run

sys.path.insert(0, REPO)

# (name, world size, parallel, use_amp, model shape, steps): memory rows use a ~25M model.
FULL = [
    ("memory DDP x2", 2, "ddp", False, (8, 8, 512), 2),
    ("memory FSDP x2", 2, "fsdp", False, (8, 8, 512), 2),
    ("memory DDP x4", 4, "ddp", False, (8, 8, 512), 2),
    ("memory FSDP x4", 4, "fsdp", False, (8, 8, 512), 2),
    ("speed single fp32", 1, "ddp", False, (4, 4, 128), 60),
    ("speed single bf16", 1, "ddp", True, (4, 4, 128), 60),
    ("speed DDP x2 fp32", 2, "ddp", False, (4, 4, 128), 60),
    ("speed DDP x2 bf16", 2, "ddp", True, (4, 4, 128), 60),
    ("speed FSDP x2 fp32", 2, "fsdp", False, (4, 4, 128), 60),
    ("speed FSDP x2 bf16", 2, "fsdp", True, (4, 4, 128), 60),
]
SMOKE = [
    ("smoke DDP x2", 2, "ddp", False, (2, 2, 32), 3),
    ("smoke FSDP x2", 2, "fsdp", False, (2, 2, 32), 3),
]


def worker(args) -> None:
    import torch

    from char_dataset import CharDataset, DataConfig
    from mingpt_ddp.config.optimizer import OptimizerConfig
    from mingpt_ddp.config.trainer import TrainerConfig
    from mingpt_ddp.optim import state_tensors
    from mingpt_ddp.parallel.plan import local_bytes
    from mingpt_ddp.runtime.distributed import (
        all_gather_objects,
        exit_process,
        setup_distributed,
        teardown_distributed,
    )
    from mingpt_ddp.snapshots.store import SnapshotStore
    from model import GPT, GPTConfig
    from trainer import Trainer

    ctx = setup_distributed()
    n_layer, n_head, n_embd = json.loads(args.shape)
    data = CharDataset(DataConfig(path=args.data, block_size=64))
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=data.vocab_size, block_size=64
        )
    )
    global_batch = 12
    tcfg = TrainerConfig(
        batch_size=global_batch // ctx.world_size,
        parallel=args.parallel,
        use_amp=args.amp,
        metrics_path="none",
        snapshot_path=args.snapshots,
    )
    trainer = Trainer(
        model,
        data,
        tcfg,
        OptimizerConfig(),
        ctx,
        {"gpt_config": vars(model.config)},
        SnapshotStore(args.snapshots),
    )
    trainer.train_step()  # warm-up; creates the optimizer state
    x, y = trainer._next_batch()
    strategy = trainer.strategy
    with strategy.forward_context():  # autocast, as the step runs forward
        loss = strategy.train_model(x, y)[1]
    loss.backward()  # gradients exist now: measure what this rank holds
    params = list(trainer.model.parameters())
    mem = {
        "params": local_bytes(params),
        "grads": local_bytes(p.grad for p in params),
        "optimizer": local_bytes(state_tensors(strategy.optimizers)),
    }
    for optimizer in strategy.optimizers:
        optimizer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = trainer.train_step()
    loss.item()
    dt = (time.perf_counter() - t0) / args.steps
    t0 = time.perf_counter()
    trainer.snapshots.save(block=True)
    save_s = time.perf_counter() - t0
    per_rank = all_gather_objects(sum(mem.values()))
    if ctx.is_main:
        print(
            "RESULT "
            + json.dumps(
                {
                    "params_M": round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 2),
                    "mem_MB_rank0": round(sum(mem.values()) / 1e6, 1),
                    "mem_MB_max_rank": round(max(per_rank) / 1e6, 1),
                    **{f"{k}_MB": round(v / 1e6, 1) for k, v in mem.items()},
                    "ms_per_step": round(1e3 * dt, 1),
                    "tokens_per_sec": round(global_batch * 64 / dt),
                    "save_s": round(save_s, 3),
                }
            ),
            flush=True,
        )
    teardown_distributed()
    exit_process(0)


def driver(args) -> int:
    rows = []
    for name, world, parallel, amp, shape, steps in SMOKE if args.smoke else FULL:
        with tempfile.TemporaryDirectory() as tmp:
            worker = [
                "--worker",
                "--data",
                args.data,
                "--parallel",
                parallel,
                "--shape",
                json.dumps(shape),
                "--steps",
                str(steps),
                "--snapshots",
                os.path.join(tmp, "snaps"),
            ] + (["--amp"] if amp else [])
            cmd = main_command(world, worker, script=os.path.abspath(__file__), torchrun=True)
            threads = str(max(1, (os.cpu_count() or 1) // world))
            out = run(cmd, env={"OMP_NUM_THREADS": threads}, cwd=None, timeout=None)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                print(out.stdout[-2000:], out.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append(
                {
                    "config": name,
                    "world_size": world,
                    "parallel": parallel,
                    "amp": "bf16" if amp else "fp32",
                    **json.loads(lines[0][len("RESULT ") :]),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    cols = [
        "config",
        "params_M",
        "mem_MB_rank0",
        "params_MB",
        "grads_MB",
        "optimizer_MB",
        "ms_per_step",
        "tokens_per_sec",
        "save_s",
    ]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\nsaved {args.out}")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data/tinyshakespeare/input.txt")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="benchmarks/results/fsdp_bench.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--parallel", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--amp", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shape", default="[4, 4, 128]", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=10, help=argparse.SUPPRESS)
    p.add_argument("--snapshots", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.data = os.path.abspath(a.data)
    if a.worker:
        worker(a)
    else:
        sys.exit(driver(a))
