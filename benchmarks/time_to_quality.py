"""Time to quality: how long a recipe takes, end to end, to reach a validation loss; and the
ablation.

    # speedrun-cpu -> 1.88
    python benchmarks/time_to_quality.py --data data/tinyshakespeare/input.txt
    # nanoGPT's recipe
    python benchmarks/time_to_quality.py --recipe nanogpt-cpu --data ...
    # under torchrun
    python benchmarks/time_to_quality.py --recipe fast-cpu --nproc 2 --data ...
    # the README's table
    python benchmarks/time_to_quality.py --ablation --nanogpt ~/nanoGPT --data ...
    # ms/step vs nanoGPT
    python benchmarks/time_to_quality.py --step-time --nanogpt ~/nanoGPT --data ...

The clock runs from launching the command to its exit: start-up, evaluations and the final
snapshot all count, as they do for whoever waits for the model (the corpus is encoded once,
untimed, before the first run, as nanoGPT's prepare.py is). A run stops at the first evaluation
at or below the target (trainer_config.target_val_loss). Each evaluation averages 240 validation
windows or more, as many as nanoGPT's (eval_iters 20 x batch 12), fixed and evenly spaced over the
split where nanoGPT draws new random ones each time; the recipes here evaluate every 25-50 steps
(nanoGPT: every 250), which decides how soon a run can notice the target, and costs time too.

--ablation adds the techniques one at a time, from nanoGPT's recipe to the speedrun's, and times
nanoGPT's own train.py (a checkout given by --nanogpt) in the same run for the ratio: its CPU recipe
from its README, 2000 steps, fp32. ms/step is a median over 10-step windows (ours) or iterations
(nanoGPT's), so evaluations do not count in it. --step-time compares ms/step alone: nanoGPT's
train.py (as it ships, and with main.py's allocator setting) and this trainer (eager, compiled, and
compiled with glibc's default allocator) at nanoGPT's model and batch, 300 steps each, taking turns
five times.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from common import REPO, hardware, job_env, main_command, run

sys.path.insert(0, REPO)

from mingpt_ddp.metrics import MetricsLog  # noqa: E402

# The recipes are config groups (mingpt_ddp/config/schema.py: recipe=nanogpt-cpu, ...), so main.py
# trains them on its own too; smoke is a seconds-long check for CI.
RECIPES = {
    "nanogpt-cpu": ["recipe=nanogpt-cpu"],
    "fast-cpu": ["recipe=fast-cpu"],
    "speedrun-cpu": ["recipe=speedrun-cpu"],
    "smoke": [
        "model=tiny",
        "data_config.block_size=32",
        "trainer_config.batch_size=8",
        "trainer_config.max_steps=100",
        "trainer_config.eval_every=10",
        "trainer_config.eval_iters=2",
        "optimizer_config.learning_rate=1e-2",
        "optimizer_config.warmup_steps=5",
    ],
}

# The ablation: each row adds one technique to the last kept row above it (overrides accumulate),
# from nanoGPT's recipe in fp32 to the speedrun-cpu recipe; a technique that did not pay here is
# measured the same way, then dropped (kept=False). (label, what it adds, overrides, kept)
FP32 = "trainer_config.use_amp=false"
ABLATION = [
    (
        "nanoGPT recipe, fp32",
        "nanoGPT's model, batch, AdamW, cosine; fp32",
        ["recipe=nanogpt-cpu", FP32],
        True,
    ),
    (
        "+ bf16 where native",
        "precision auto: bf16 autocast, attention in whichever precision times faster",
        ["trainer_config.use_amp=auto"],
        True,
    ),
    (
        "+ batch 24, lr 6e-3",
        "the fast-cpu recipe's batch and a 700-step schedule (AdamW)",
        ["recipe=fast-cpu"],
        True,
    ),
    (
        "+ Muon",
        "Muon (lr 0.05) for the blocks' matrices",
        ["optimizer_config.optimizer=muon", "optimizer_config.muon_lr=0.05"],
        True,
    ),
    (
        "+ 350-step cosine",
        "the schedule ends near where the target is reached",
        ["trainer_config.max_steps=350"],
        True,
    ),
    ("+ rotary", "rotary position embeddings, no position table", ["gpt_config.rotary=true"], True),
    ("+ QK-norm", "RMS-normalised queries and keys", ["gpt_config.qk_norm=true"], True),
    (
        "+ 300-step cosine, eval every 25",
        "the schedule ends where the target now is; evaluations twice as often",
        ["trainer_config.max_steps=300", "trainer_config.eval_every=25"],
        True,
    ),
    (
        "+ untied head, zero-init (dropped)",
        "own head matrix; projections and head start at zero",
        ["gpt_config.tie_embeddings=false", "gpt_config.zero_init_proj=true"],
        False,
    ),
    ("+ ReLU² (dropped)", "relu2 in place of GELU", ["gpt_config.activation=relu2"], False),
    (
        "+ logit soft-cap 30 (dropped)",
        "logits squashed into (-30, 30)",
        ["gpt_config.logit_softcap=30"],
        False,
    ),
    (
        "+ warmup-stable-decay (dropped)",
        "hold the peak, decay over the last 40%",
        ["optimizer_config.schedule=wsd", "optimizer_config.decay_frac=0.4"],
        False,
    ),
    (
        "+ torch.compile (dropped)",
        "the whole model compiled (cold cache: compiling counts)",
        ["trainer_config.compile=true"],
        False,
    ),
    ("= recipe=speedrun-cpu", "the kept rows, as one config group", ["recipe=speedrun-cpu"], None),
]


def run_ours(
    overrides: list[str], data: str, target: float, nproc: int = 1, inductor_cache: str = ""
) -> dict:
    """Train main.py to the target; launch-to-exit seconds, the step and val loss where it stopped,
    ms/step. torch.compile's kernels are cached on disk: by default each run gets an empty cache,
    and so times compiling as a first run does; inductor_cache names a cache to share between runs
    instead."""
    from main import compose, to_job  # the recipe as main.py composes it: its batch and context

    job = to_job(compose(overrides))
    batch, block = job.trainer_config.batch_size, job.data_config.block_size
    if batch % nproc:
        sys.exit(f"error: the recipe's batch of {batch} does not split over {nproc} processes")
    with tempfile.TemporaryDirectory(prefix="ttq-") as run_dir:
        command = main_command(
            nproc,
            overrides
            + [
                f"trainer_config.batch_size={batch // nproc}",
                f"data_config.path={data}",
                f"trainer_config.target_val_loss={target}",
                "trainer_config.sample_chars=0",
                "trainer_config.log_every=10",
                "trainer_config.save_every=100000",
                f"parallel={'none' if nproc == 1 else 'ddp'}",
                f"trainer_config.run_dir={run_dir}",
            ],
        )
        env = {"TORCHINDUCTOR_CACHE_DIR": inductor_cache or os.path.join(run_dir, "inductor-cache")}
        t0, faults = time.perf_counter(), child_page_faults()
        result = run(command, env=env, timeout=None)
        wall, faults = time.perf_counter() - t0, child_page_faults() - faults
        if result.returncode != 0:
            sys.exit(f"error: training failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
        records = MetricsLog.read(f"{run_dir}/metrics.jsonl")
    evals = [r for r in records if "val_loss" in r]
    reached = next((r for r in evals if r["val_loss"] <= target), None)
    final = reached or evals[-1]
    # Windows without an evaluation in them: the training step's own time.
    step_ms = [r["ms_per_step"] for r in records if "ms_per_step" in r and "val_loss" not in r] or [
        r["ms_per_step"] for r in records if "ms_per_step" in r
    ]
    return {
        "reached": reached is not None,
        "val_loss": final["val_loss"],
        "step": final["step"],
        "tokens": final["step"] * batch * block,
        "wall_s": round(wall, 1),
        "ms_per_step": round(statistics.median(step_ms), 1),
        "precision": _precision_word(result.stdout),
        "page_faults": faults,
    }


def child_page_faults() -> int:
    """Minor page faults of this script's finished children so far: each is a fresh 4 KiB page the
    kernel had to map (and zero) for a program, e.g. because its allocator gave memory back."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt


def _precision_word(log: str) -> str:
    match = re.search(r"\| precision ([^|(]+)", log)
    return match.group(1).strip() if match else ""


# nanoGPT's CPU recipe, from its README ("a baby GPT on a MacBook / CPU"), run to the end.
NANOGPT_ARGS = [
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
]


def run_nanogpt(
    checkout: str, data: str, target: float, max_iters: int = 2000, env: dict | None = None
) -> dict:
    """nanoGPT's own train.py on a copy of its checkout: prepare.py untimed, then train.py timed to
    exit (env: more environment variables for it)."""
    with tempfile.TemporaryDirectory(prefix="nanogpt-") as tmp:
        work = shutil.copytree(
            checkout, os.path.join(tmp, "nanoGPT"), ignore=shutil.ignore_patterns(".git", "out*")
        )
        corpus_dir = os.path.join(work, "data", "shakespeare_char")
        shutil.copy(
            data, os.path.join(corpus_dir, "input.txt")
        )  # prepare.py downloads only if it is missing
        subprocess.run(
            [sys.executable, "prepare.py"], cwd=corpus_dir, check=True, capture_output=True
        )
        t0, faults = time.perf_counter(), child_page_faults()
        result = subprocess.run(
            [
                sys.executable,
                "train.py",
                *NANOGPT_ARGS,
                f"--max_iters={max_iters}",
                f"--out_dir={tmp}/out",
            ],
            cwd=work,
            capture_output=True,
            text=True,
            env=job_env(env),
        )
        wall, faults = time.perf_counter() - t0, child_page_faults() - faults
    if result.returncode != 0:
        sys.exit(
            f"error: nanoGPT's train.py failed (exit {result.returncode}):\n{result.stderr[-2000:]}"
        )
    evals = [
        (int(s), float(v))
        for s, v in re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", result.stdout)
    ]
    iter_ms = [
        float(ms) for ms in re.findall(r"iter \d+: loss [\d.]+, time ([\d.]+)ms", result.stdout)
    ]
    reached = next(((s, v) for s, v in evals if v <= target), None)
    step, val = reached or evals[-1]
    return {
        "reached": reached is not None,
        "val_loss": val,
        "step": step,
        "tokens": step * 12 * 64,
        "wall_s": round(wall, 1),
        "ms_per_step": round(statistics.median(iter_ms), 1),
        "precision": "fp32",
        "page_faults": faults,
    }


# --step-time's rows. nanoGPT's train.py as it ships, and with the allocator setting main.py makes
# (runtime/host.py, keep_freed_cpu_memory), given as glibc's environment variables: the difference
# that setting makes is then seen on both programs. This trainer at nanoGPT's model and batch as
# nanoGPT runs it (eager), compiled, and compiled with glibc's default allocator.
KEEP_FREED_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024),
    "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1),
}
NANOGPT_ROWS = {"nanoGPT": {}, "nanoGPT, keep-freed malloc": KEEP_FREED_ENV}
STEP_TIME_ROWS = {
    "eager": [],
    "compiled": ["trainer_config.compile=true"],
    "compiled, default malloc": [
        "trainer_config.compile=true",
        "trainer_config.cpu_keep_freed_memory=false",
    ],
}


def step_times(args, rounds: int = 5, steps: int = 300) -> dict:
    """ms/step on nanoGPT's model and batch: nanoGPT's train.py and this trainer (precision auto)
    taking turns, `rounds` times: on a shared machine whose speed drifts, alternating keeps the
    comparison fair. Compiling is not in ms/step, so the compiled rows share one kernel cache."""
    ms: dict[str, list[float]] = {row: [] for row in [*NANOGPT_ROWS, *STEP_TIME_ROWS]}
    faults: dict[str, list[int]] = {
        row: [] for row in ms
    }  # minor page faults per run, start-up included
    with tempfile.TemporaryDirectory(prefix="ttq-inductor-") as cache:
        for _ in range(rounds):
            runs = {
                row: run_nanogpt(args.nanogpt, args.data, 0.0, max_iters=steps, env=env)
                for row, env in NANOGPT_ROWS.items()
            }
            runs.update(
                {
                    row: run_ours(
                        ["recipe=nanogpt-cpu", f"trainer_config.max_steps={steps}", *extra],
                        args.data,
                        0.0,
                        inductor_cache=cache,
                    )
                    for row, extra in STEP_TIME_ROWS.items()
                }
            )
            for row, run in runs.items():
                ms[row].append(run["ms_per_step"])
                faults[row].append(run["page_faults"])
            print(
                "step-time | " + " | ".join(f"{row} {times[-1]} ms" for row, times in ms.items()),
                flush=True,
            )
    base = statistics.median(ms["nanoGPT"])
    ratios = {row: round(statistics.median(times) / base, 2) for row, times in ms.items()}
    print(
        (
            f"step-time | nanoGPT's model and batch, {rounds} rounds of {steps} steps, "
            "ratio of medians to nanoGPT's | "
        )
        + " | ".join(f"{row} {ms[row]} ms: {ratios[row]:.2f}" for row in ms)
    )
    print(
        "step-time | minor page faults per run (start-up included), median | "
        + " | ".join(f"{row} {statistics.median(f):,.0f}" for row, f in faults.items())
    )
    return {"ms": ms, "ratio": ratios, "page_faults": faults}


def ablation(args) -> list[dict]:
    rows, overrides = [], []
    if args.nanogpt:
        print("ablation | nanoGPT train.py ...", flush=True)
        rows.append(
            {
                "row": "nanoGPT train.py",
                "adds": "nanoGPT itself, its CPU recipe (2000 steps)",
                **run_nanogpt(args.nanogpt, args.data, args.target),
            }
        )
        print(f"ablation | {rows[-1]}", flush=True)
    for label, adds, extra, kept in ABLATION:
        replaced = {e.split("=")[0] for e in extra}
        trial = (
            extra
            if kept is None
            else [o for o in overrides if o.split("=")[0] not in replaced] + extra
        )
        rows.append(
            {
                "row": label,
                "adds": adds,
                "overrides": trial,
                **run_ours(trial, args.data, args.target),
            }
        )
        print(f"ablation | {rows[-1]}", flush=True)
        if kept:
            overrides = trial
    return rows


def table(rows: list[dict], target: float) -> str:
    base = rows[0] if rows[0]["row"] == "nanoGPT train.py" else None
    lines = [
        (
            f"| run | adds | precision | ms/step | steps to val ≤ {target} "
            "| tokens | s, launch to exit |"
        )
        + (" × nanoGPT |" if base else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if base else ""),
    ]
    for r in rows:
        steps = (
            f"{r['step']}" if r["reached"] else f"not reached ({r['val_loss']:.4f} at {r['step']})"
        )
        line = (
            f"| {r['row']} | {r['adds']} | {r['precision']} | {r['ms_per_step']} | {steps} | "
            f"{r['tokens'] / 1e6:.2f}M | {r['wall_s']} |"
        )
        lines.append(line + (f" {r['wall_s'] / base['wall_s']:.2f} |" if base else ""))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data", default=os.path.join(REPO, "data", "tinyshakespeare", "input.txt")
    )
    parser.add_argument("--recipe", choices=RECIPES, default="speedrun-cpu")
    parser.add_argument("--target", type=float, default=1.88, help="validation loss to reach")
    parser.add_argument(
        "--nproc", type=int, default=1, help="processes (>1: torchrun, same global batch)"
    )
    parser.add_argument(
        "--ablation", action="store_true", help="the techniques one at a time (the README's table)"
    )
    parser.add_argument(
        "--nanogpt",
        default="",
        help="a nanoGPT checkout, timed in the same run (--ablation, --step-time)",
    )
    parser.add_argument(
        "--step-time", action="store_true", help="ms/step against nanoGPT's train.py, taking turns"
    )
    parser.add_argument("--out", default="", help="also write the result as JSON here")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="more main.py overrides for the recipe, e.g. gpt_config.bias=false",
    )
    args = parser.parse_args()
    if not os.path.exists(args.data):
        sys.exit(
            f"error: no corpus at {args.data}; run python data/fetch_shakespeare.py or pass --data"
        )
    if args.nanogpt and not os.path.exists(os.path.join(args.nanogpt, "train.py")):
        sys.exit(
            f"error: no nanoGPT train.py under {args.nanogpt}; git clone https://github.com/karpathy/nanoGPT"
        )
    # Encode the corpus once, untimed (a recipe's runs then open the prepared token file).
    with tempfile.TemporaryDirectory(prefix="ttq-") as run_dir:
        subprocess.run(
            main_command(
                1,
                RECIPES["smoke"]
                + [
                    f"data_config.path={args.data}",
                    "trainer_config.max_steps=1",
                    "parallel=none",
                    "trainer_config.metrics_path=none",
                    f"trainer_config.run_dir={run_dir}",
                ],
            ),
            capture_output=True,
            cwd=REPO,
        )
    if args.step_time:
        if not args.nanogpt:
            sys.exit(
                "error: --step-time compares with nanoGPT's train.py: pass --nanogpt <checkout>"
            )
        report, ok = step_times(args), True
    elif args.ablation:
        rows = ablation(args)
        print(table(rows, args.target))
        report = {"rows": rows}
        ok = rows[-1]["reached"]
    else:
        report = {
            "recipe": args.recipe,
            "overrides": args.overrides,
            "processes": args.nproc,
            "target": args.target,
            **run_ours(RECIPES[args.recipe] + args.overrides, args.data, args.target, args.nproc),
        }
        verdict = "reached" if report["reached"] else "NOT reached"
        print(
            f"time-to-quality | {args.recipe} x{args.nproc} | "
            f"val {report['val_loss']:.4f} ({verdict} {args.target}) "
            f"at step {report['step']} | {report['tokens'] / 1e6:.2f}M tokens | "
            f"{report['ms_per_step']} ms/step | "
            f"{report['wall_s']:.1f} s end to end"
        )
        ok = report["reached"]
    if (
        args.out
    ):  # with the machine it was measured on: CPUs of one kind differ (native bf16 or not)
        with open(args.out, "w") as f:
            json.dump({"hardware": hardware(), **report}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
