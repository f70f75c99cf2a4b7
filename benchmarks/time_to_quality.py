"""Time to quality: how long a named recipe takes, end to end, to reach a validation loss.

    python benchmarks/time_to_quality.py --data data/tinyshakespeare/input.txt              # fast-cpu -> 1.88
    python benchmarks/time_to_quality.py --recipe nanogpt-cpu --data ...                     # nanoGPT's recipe
    python benchmarks/time_to_quality.py --recipe fast-cpu --nproc 2 --data ...              # under torchrun

The clock runs from launching the command to its exit: start-up, data encoding,
evaluations and the final snapshot all count, as they do for whoever waits for the
model. The run stops at the first evaluation at or below the target
(trainer_config.target_val_loss). Each evaluation averages 240 validation windows,
as many as nanoGPT's (eval_iters 20 x batch 12), but fixed and evenly spaced over the
split where nanoGPT draws new random ones each time. The recipes evaluate every 50
steps (nanoGPT: every 250), which also decides how soon a run can notice the target.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common import REPO, main_command

sys.path.insert(0, REPO)

from metrics import MetricsLog  # noqa: E402

# The recipes are config groups (config.py: recipe=nanogpt-cpu, recipe=fast-cpu), so main.py can
# train them on their own too; smoke is a seconds-long check for CI.
RECIPES = {
    "nanogpt-cpu": ["recipe=nanogpt-cpu"],
    "fast-cpu": ["recipe=fast-cpu"],
    "smoke": ["model=tiny", "data_config.block_size=32", "trainer_config.batch_size=8", "trainer_config.max_steps=100",
              "trainer_config.eval_every=10", "trainer_config.eval_iters=2", "optimizer_config.learning_rate=1e-2",
              "optimizer_config.warmup_steps=5"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=os.path.join(REPO, "data", "tinyshakespeare", "input.txt"))
    parser.add_argument("--recipe", choices=RECIPES, default="fast-cpu")
    parser.add_argument("--target", type=float, default=1.88, help="validation loss to reach")
    parser.add_argument("--nproc", type=int, default=1, help="processes (>1: torchrun, same global batch)")
    parser.add_argument("--out", default="", help="also write the result as JSON here")
    args = parser.parse_args()
    if not os.path.exists(args.data):
        sys.exit(f"error: no corpus at {args.data}; run python data/fetch_shakespeare.py or pass --data")
    from main import compose, to_job  # the recipe as main.py composes it: its batch and context

    job = to_job(compose(RECIPES[args.recipe]))
    batch, block = job.trainer_config.batch_size, job.data_config.block_size
    if batch % args.nproc:
        sys.exit(f"error: the recipe's batch of {batch} does not split over {args.nproc} processes")
    with tempfile.TemporaryDirectory(prefix="ttq-") as run_dir:
        overrides = RECIPES[args.recipe] + [
            f"trainer_config.batch_size={batch // args.nproc}", f"data_config.path={args.data}",
            f"trainer_config.target_val_loss={args.target}", "trainer_config.sample_chars=0",
            "trainer_config.save_every=100000", f"parallel={'none' if args.nproc == 1 else 'ddp'}",
            f"trainer_config.run_dir={run_dir}"]
        command = main_command(args.nproc, overrides)
        t0 = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if result.returncode != 0:
            sys.exit(f"error: training failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
        evals = [r for r in MetricsLog.read(f"{run_dir}/metrics.jsonl") if "val_loss" in r]
    reached = next((r for r in evals if r["val_loss"] <= args.target), None)
    final = reached or evals[-1]
    tokens = final["step"] * batch * block
    report = {"recipe": args.recipe, "processes": args.nproc, "target": args.target, "reached": reached is not None,
              "val_loss": final["val_loss"], "step": final["step"], "tokens": tokens, "wall_s": round(wall, 1)}
    verdict = "reached" if reached else "NOT reached"
    print(f"time-to-quality | {args.recipe} x{args.nproc} | val {final['val_loss']:.4f} ({verdict} {args.target}) "
          f"at step {final['step']} | {tokens / 1e6:.2f}M tokens | {wall:.1f} s end to end")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if reached else 1


if __name__ == "__main__":
    sys.exit(main())
