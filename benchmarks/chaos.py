"""Chaos trials: SIGKILL a random rank at a random step of a torchrun job, K times, and measure
recovery.

    python benchmarks/chaos.py --trials 20 --data data/tinyshakespeare/input.txt

Each trial runs `torchrun --nproc_per_node=2 --max-restarts=3` on a small model,
kills one worker (rank and step drawn from a seeded RNG) and lets torchrun restart
the group. It reports whether the job finished at max_steps, how many steps were
lost (trained before the kill but after the last snapshot, so trained again), and
the time to recover: from the kill to the first step completed after the restart.
Steps lost should equal the steps trained since the last snapshot committed before the kill.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time

from common import main_command, start, worker_pid


def trial(i: int, rng: random.Random, args, run_dir: str) -> dict:
    kill_rank, kill_step = rng.randrange(args.nproc), rng.randrange(2, args.max_steps - 1)
    overrides = [
        f"data_config.path={args.data}",
        "gpt_config.n_layer=2",
        "gpt_config.n_head=2",
        "gpt_config.n_embd=64",
        "data_config.block_size=64",
        "trainer_config.batch_size=8",
        f"trainer_config.max_steps={args.max_steps}",
        f"trainer_config.save_every={args.save_every}",
        "trainer_config.log_every=1",
        "trainer_config.eval_every=100000",
        "trainer_config.sample_chars=0",
        "trainer_config.eval_iters=1",
        f"trainer_config.snapshot_path={run_dir}/snapshots",
        f"trainer_config.metrics_path={run_dir}/metrics.jsonl",
    ]
    job = start(main_command(args.nproc, overrides, ("--max-restarts=3", "--monitor-interval=0.5")))
    killed_at, last_step_before, recovered_at, resumed_from, finished_step = (
        None,
        0,
        None,
        None,
        None,
    )
    last_snapshot = 0  # newest snapshot committed before the kill
    for line in job.stdout:
        now = time.monotonic()
        step = re.match(r"^step +(\d+)/", line)
        if step and killed_at is None:
            last_step_before = int(step.group(1))
            if last_step_before >= kill_step:
                pid = worker_pid(job.pid, kill_rank)
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        elif step and killed_at is not None and recovered_at is None and resumed_from is not None:
            recovered_at = now
        if line.startswith("snapshot | step ") and killed_at is None:
            last_snapshot = int(line.split()[3])
        if line.startswith("resume | step "):
            resumed_from = int(line.split()[3])
        if line.startswith("resume | no snapshot"):
            resumed_from = 0
        if line.startswith("done | step "):
            finished_step = int(line.split()[3])
    job.wait()
    return {
        "trial": i,
        "kill_rank": kill_rank,
        "kill_after_step": last_step_before,
        "exit_code": job.returncode,
        "finished": job.returncode == 0 and finished_step == args.max_steps,
        "resumed_from": resumed_from,
        "steps_lost": None if resumed_from is None else last_step_before - resumed_from,
        "last_snapshot_before_kill": last_snapshot,
        "steps_since_snapshot": last_step_before - last_snapshot,
        "recover_s": None if recovered_at is None else round(recovered_at - killed_at, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--data", default="data/tinyshakespeare/input.txt")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/chaos.json")
    args = p.parse_args()
    args.data = os.path.abspath(args.data)
    rng, rows = random.Random(args.seed), []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory() as run_dir:
            rows.append(trial(i, rng, args, run_dir))
        print(json.dumps(rows[-1]), flush=True)
    recover = [r["recover_s"] for r in rows if r["recover_s"] is not None]
    summary = {
        "trials": len(rows),
        "jobs_finished": sum(r["finished"] for r in rows),
        "steps_lost_equals_steps_since_snapshot": sum(
            r["steps_lost"] == r["steps_since_snapshot"] for r in rows
        ),
        "mean_steps_lost": round(statistics.mean(r["steps_lost"] or 0 for r in rows), 2),
        "recover_s_median": round(statistics.median(recover), 2) if recover else None,
        "recover_s_max": max(recover) if recover else None,
    }
    print(json.dumps(summary, indent=1))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "trials": rows}, f, indent=1)
    return 0 if summary["jobs_finished"] == summary["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
