"""Dense against a mixture of experts at the same active parameters per token, on the default
recipe (tiny Shakespeare, gpt-micro), one process: validation curves, tokens per second, memory,
and how the router spreads tokens over the experts with and without load balancing.

    python benchmarks/experts.py --out benchmarks/results/experts_amd_epyc.json   # and its .png

Runs main.py four times, --steps each (default 600), the same seed and data:
- dense: the MLP of hidden 4C;
- experts: 8 experts of hidden 2C, top 2 (a token meets 2 x 2C = 4C hidden units, as dense),
  balanced by the default loss (gpt_config.aux_loss_coef=0.01);
- experts + bias: the same, balanced by DeepSeek-V3's bias instead (aux 0, bias rate 1e-3);
- experts, unbalanced: neither.
Per run: the validation losses, the median tokens per second and ms per step of the logged
windows, the peak memory line, and per log step the experts' imbalance (max over mean tokens per
expert, averaged over the blocks) from metrics.jsonl (`expert_load`, `tokens_per_expert`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import hardware, run_main  # noqa: E402

MOE = ["gpt_config.n_experts=8", "gpt_config.top_k=2"]
RUNS = {
    "dense": [],
    "experts": MOE,
    "experts + bias": [*MOE, "gpt_config.aux_loss_coef=0", "gpt_config.bias_update_rate=0.001"],
    "experts, unbalanced": [*MOE, "gpt_config.aux_loss_coef=0"],
}


def train(name: str, extra: list[str], steps: int, folder: Path, data: str) -> dict:
    """One run of main.py; its curves and speed from metrics.jsonl, its peak memory line."""
    run_dir = folder / name.replace(" ", "_").replace(",", "").replace("+", "plus")
    args = [
        f"data_config.path={data}",
        f"trainer_config.run_dir={run_dir}",
        f"trainer_config.max_steps={steps}",
        "trainer_config.eval_every=100",
        "trainer_config.log_every=20",
        "trainer_config.save_every=100000",  # no snapshots: a fresh start each run
        "trainer_config.sample_chars=0",
        *extra,
    ]
    result = run_main(args, timeout=1800)
    if result.returncode:
        sys.exit(f"{name}: main.py failed\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    params = re.search(r"train \| ([\d.]+M) parameters", result.stdout)
    memory = re.search(r"peak memory per rank (.+)", result.stdout)
    records = [r for r in records if "tokens_per_sec" in r]  # the step records
    timed = records[1:]  # the first window holds the start-up
    return {
        "parameters": params.group(1) if params else None,
        "val_loss": [(r["step"], r["val_loss"]) for r in records if "val_loss" in r],
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in timed),
        "ms_per_step": statistics.median(r["ms_per_step"] for r in timed),
        "peak_memory": memory.group(1).strip() if memory else None,
        "expert_load": [(r["step"], r["expert_load"]) for r in records if "expert_load" in r],
        "tokens_per_expert_last": records[-1].get("tokens_per_expert"),
    }


def plot(report: dict, path: Path) -> None:
    """Validation curves, and the experts' imbalance over training (matplotlib, if installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('experts | matplotlib not installed: no chart (pip install -e ".[plot]")')
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in report["runs"].items():
        left.plot(*zip(*run["val_loss"]), label=name, marker=".")
        if run["expert_load"]:
            right.plot(*zip(*run["expert_load"]), label=name)
    left.set(xlabel="step", ylabel="validation loss", title="dense vs experts (same active)")
    right.set(xlabel="step", ylabel="max / mean tokens per expert", title="balance")
    left.legend(), right.legend()
    fig.suptitle(f"{report['hardware']['device']}, {report['hardware']['cores']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600, help="steps per run (default 600)")
    p.add_argument("--out", help="the JSON report (a PNG chart beside it)")
    p.add_argument(
        "--data",
        default=str(REPO / "data/tinyshakespeare/input.txt"),
        help="the corpus (default: the one data/fetch_shakespeare.py fetches)",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        runs = {}
        for name, extra in RUNS.items():
            runs[name] = train(name, extra, args.steps, Path(folder), args.data)
            run = runs[name]
            print(
                f"{name}: val {run['val_loss'][-1][1]:.4f} | {run['tokens_per_sec']:,.0f} tok/s | "
                f"{run['parameters']} parameters | peak {run['peak_memory']}",
                flush=True,
            )
    report = {"hardware": hardware(), "steps": args.steps, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        plot(report, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
