"""Training speed, mode by mode: tokens/s, ms/step, MFU, data-loading share and snapshot stall.

    python benchmarks/bench.py --data data/tinyshakespeare/input.txt # CPU table (~5 min on 2 cores)
    python benchmarks/bench.py --recipe shakespeare-gpu --data ...    # on a GPU machine
    python benchmarks/bench.py --smoke --data ...                     # seconds: what CI runs

Every mode is a real, short training run of main.py (torchrun for the multi-process
ones) at the same *global* batch, so the rows compare like with like: one process,
DDP over 2 and 4 processes, DDP with bf16 autocast, FSDP, torch.compile on/off, and a
"star all-reduce via rank 0": DDP with its gradients averaged through rank 0 (every rank
sends to rank 0, which sends the mean back; no overlap with backward:
trainer_config.grad_reduce=via_rank0), the parameter-server pattern. (nn.DataParallel itself
is single-process and GPU-only: not a mode here.) The numbers come from each run's metrics file:

- ms/step, tokens/s: median over logged windows, leaving out the first (start-up,
  compilation, allocator warm-up). Tokens/s counts all ranks.
- MFU (model FLOPs utilisation): model FLOPs per token (6N + attention, from the
  config) x tokens/s / the device's peak, measured here with a large matmul in the
  same precision (or given with --peak-gflops).
- data %: host time in the batch path (index -> tensor -> device copy queued) / step time;
  on a GPU the host runs ahead of the device, so there it bounds the input cost, not a stall.
- snapshot: one asynchronous save mid-run. "blocked" is the time the loop spent in
  the save call; "cost" is how much longer the window containing it took than the
  median window (it includes the background write competing for the CPU), in steps.
Writes a JSON file and a PNG chart (matplotlib; skipped with a note if missing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import measure
from common import REPO, hardware, main_command

sys.path.insert(0, REPO)

import torch  # noqa: E402

from mingpt_ddp.metrics import MetricsLog  # noqa: E402
from mingpt_ddp.parallel.plan import tf32_matmuls  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

# Recipes are the `recipe` config group (mingpt_ddp/config/schema.py): the shape, context and batch
# each sets, composed the way main.py composes them. Their batch is the global batch of every mode
# here.
RECIPES = ["nanogpt-cpu", "shakespeare-gpu", "gpt2-gpu"]
SMOKE = ["model=tiny", "data_config.block_size=32", "trainer_config.batch_size=8"]


def recipe_shape(overrides: list[str]) -> tuple:
    """(n_layer, n_head, n_embd, block_size, global batch, dropout) of a composed config."""
    from main import compose, to_job

    job = to_job(compose(overrides))
    g, t = job.gpt_config, job.trainer_config
    return g.n_layer, g.n_head, g.n_embd, job.data_config.block_size, t.batch_size, g.dropout


# Every mode sets its precision: left to "auto", a row named fp32 trains in bf16 on a GPU.
FP32 = {"use_amp": False}


def amp(dtype: str) -> dict:
    return {"use_amp": True, "amp_dtype": dtype}


# name: (processes, trainer_config overrides)
CPU_MODES = [
    ("single process", 1, {"parallel": "none", **FP32}),
    ("single + torch.compile", 1, {"parallel": "none", "compile": True, **FP32}),
    ("single + bf16 autocast", 1, {"parallel": "none", **amp("bf16")}),
    ("star all-reduce via rank 0 x2", 2, {"parallel": "ddp", "grad_reduce": "via_rank0", **FP32}),
    ("DDP x2", 2, {"parallel": "ddp", **FP32}),
    ("star all-reduce via rank 0 x4", 4, {"parallel": "ddp", "grad_reduce": "via_rank0", **FP32}),
    ("DDP x4", 4, {"parallel": "ddp", **FP32}),
    ("DDP x2 + bf16 autocast", 2, {"parallel": "ddp", **amp("bf16")}),
    ("FSDP x2", 2, {"parallel": "fsdp", **FP32}),
]


def gpu_modes(dtype: str) -> list[tuple[str, int, dict]]:
    """One GPU: the precision and compiler choices. dtype: the 16-bit type this GPU multiplies in
    hardware (bf16 from Ampere on, fp16 on V100/T4, where bf16 is only emulated)."""
    return [
        ("single GPU fp32", 1, {"parallel": "none", **FP32}),
        (f"single GPU {dtype} autocast", 1, {"parallel": "none", **amp(dtype)}),
        (f"single GPU {dtype} + compile", 1, {"parallel": "none", "compile": True, **amp(dtype)}),
    ]


SMOKE_MODES = [
    ("single process", 1, {"parallel": "none", **FP32}),
    ("DDP x2", 2, {"parallel": "ddp", **FP32}),
]


def precision_of(overrides: dict) -> str:
    return overrides["amp_dtype"] if overrides["use_amp"] else "fp32"


def flops_per_token(recipe: tuple, vocab: int) -> int:
    """The model's own count (model.GPT.flops_per_token: 6N + attention), from a GPT built on the
    meta device: shapes only, no memory, no initialisation cost, even for GPT-2 sizes."""
    n_layer, n_head, n_embd, block_size = recipe[:4]
    with torch.device("meta"):
        model = GPT(
            GPTConfig(
                n_layer=n_layer,
                n_head=n_head,
                n_embd=n_embd,
                bias=False,
                vocab_size=vocab,
                block_size=block_size,
            )
        )
    return model.flops_per_token()


def mode_args(nproc: int, overrides: dict, recipe: tuple, steps, log_every, data, run_dir) -> list:
    """main.py's overrides for one mode: the recipe's shape at its global batch, split over nproc
    ranks, one evaluation at the end, one asynchronous save mid-run."""
    n_layer, n_head, n_embd, block, global_batch, dropout = recipe
    settings = {
        "data_config.path": data,
        "data_config.block_size": block,
        "gpt_config.n_layer": n_layer,
        "gpt_config.n_head": n_head,
        "gpt_config.n_embd": n_embd,
        "gpt_config.dropout": dropout,
        "gpt_config.bias": False,
        "trainer_config.batch_size": global_batch // nproc,
        "trainer_config.max_steps": steps,
        "trainer_config.log_every": log_every,
        "trainer_config.eval_every": steps,
        "trainer_config.eval_iters": 1,
        "trainer_config.sample_chars": 0,
        "trainer_config.save_every": steps // 2,
        "trainer_config.async_save": True,
        "trainer_config.snapshot_path": f"{run_dir}/snapshots",
        "trainer_config.metrics_path": f"{run_dir}/metrics.jsonl",
        **{f"trainer_config.{k}": v for k, v in overrides.items()},
    }
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()]


def run_mode(
    name: str, nproc: int, overrides: dict, recipe: tuple, steps, log_every, data, workdir
) -> dict:
    """One mode's run of main.py, and its row read from the run's metrics file."""
    run_dir = os.path.join(workdir, "".join(c if c.isalnum() else "_" for c in name))
    args = mode_args(nproc, overrides, recipe, steps, log_every, data, run_dir)
    t0 = time.perf_counter()
    result = subprocess.run(main_command(nproc, args), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if result.returncode != 0:
        raise SystemExit(
            f"error: mode {name!r} failed (exit {result.returncode}):\n{result.stderr[-2000:]}"
        )
    metrics, tokens_per_step = f"{run_dir}/metrics.jsonl", recipe[4] * recipe[3]
    windows = MetricsLog.read(metrics)
    saves = [e for e in MetricsLog.read(metrics, event="snapshot") if e["step"] < steps]
    steady = windows[1:] or windows
    ms = statistics.median(w["ms_per_step"] for w in steady)
    data_ms = statistics.median(w["data_ms"] for w in steady)
    row = {
        "mode": name,
        "processes": nproc,
        "precision": precision_of(overrides),
        "ms_per_step": round(ms, 2),
        "tokens_per_sec": round(tokens_per_step / ms * 1e3, 1),
        "data_pct": round(100 * data_ms / ms, 2),
        "first_window_extra_s": round((windows[0]["ms_per_step"] - ms) * log_every / 1e3, 2),
        "wall_s": round(wall, 1),
        "final_loss": windows[-1]["train_loss"],
    }
    if saves:  # the window that contains the mid-run save (right after its step is logged)
        after = next((w for w in windows if w["step"] > saves[0]["step"]), None)
        cost_ms = max(0.0, (after["ms_per_step"] - ms) * log_every) if after else 0.0
        row.update(
            snapshot_blocked_ms=saves[0]["stall_ms"],
            snapshot_cost_ms=round(cost_ms, 1),
            snapshot_cost_steps=round(cost_ms / ms, 2),
        )
    return row


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| mode | ms/step | tokens/s | MFU | data % "
        "| snapshot blocked / cost | first-window extra |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        snap = (
            f"{r['snapshot_blocked_ms']:.0f} ms / {r['snapshot_cost_steps']:.2f} steps"
            if "snapshot_blocked_ms" in r
            else "-"
        )
        peak = "" if r["precision"] == "fp32" else f" of {r['precision']} peak"
        lines.append(
            f"| {r['mode']} | {r['ms_per_step']:.1f} | {r['tokens_per_sec'] / 1e3:.1f}k | "
            f"{100 * r['mfu']:.1f}%{peak} | {r['data_pct']:.2f} | {snap} | "
            f"{r['first_window_extra_s']:.1f} s |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--data", default=os.path.join(REPO, "data", "tinyshakespeare", "input.txt")
    )
    parser.add_argument(
        "--recipe", choices=RECIPES, default="nanogpt-cpu", help="a recipe=... config group option"
    )
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per mode")
    parser.add_argument("--log-every", type=int, default=10, help="steps per timed window")
    parser.add_argument(
        "--modes", default="", help="comma-separated substrings: run only the modes that match"
    )
    parser.add_argument(
        "--peak-gflops", type=float, default=0.0, help="the device's peak (default: measured)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny model, a few steps, two modes (for CI)"
    )
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "bench.json"))
    parser.add_argument(
        "--chart", default="", help="PNG to write (default: the --out path with .png)"
    )
    args = parser.parse_args()
    if not os.path.exists(args.data):
        sys.exit(
            f"error: no corpus at {args.data}; run python data/fetch_shakespeare.py or pass --data"
        )
    return args


def select_modes(args: argparse.Namespace, gpu: bool, native16: str) -> list:
    """The modes this machine runs (the smoke pair, the GPU's or the CPU's), filtered by --modes."""
    modes = SMOKE_MODES if args.smoke else gpu_modes(native16) if gpu else CPU_MODES
    if args.modes:
        wanted = [m.strip() for m in args.modes.split(",")]
        modes = [m for m in modes if any(w in m[0] for w in wanted)]
    if not modes:
        sys.exit(
            f"error: --modes {args.modes!r} matches none of: "
            f"{', '.join(m[0] for m in CPU_MODES + gpu_modes(native16))}"
        )
    return modes


def run_rows(args, modes, recipe, steps, log_every, peaks, fpt, warnings) -> list[dict]:
    """Each mode's row, printed as it comes, with its MFU (and a warning when above 100%)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-") as workdir:
        for name, nproc, overrides in modes:
            row = run_mode(name, nproc, overrides, recipe, steps, log_every, args.data, workdir)
            row["mfu"] = round(row["tokens_per_sec"] * fpt / (peaks[row["precision"]] * 1e9), 4)
            rows.append(row)
            print(
                f"bench | {name} | {row['ms_per_step']:.1f} ms/step | "
                f"{row['tokens_per_sec'] / 1e3:.1f}k tok/s | "
                f"MFU {100 * row['mfu']:.1f}% | data {row['data_pct']:.2f}%",
                flush=True,
            )
            measure.warn(measure.mfu_warning(row, measured=not args.peak_gflops), warnings)
    for line in measure.speedup_warnings(rows):
        measure.warn(line, warnings)
    return rows


def write_outputs(args, report: dict, recipe_name: str) -> int:
    """The JSON report, then the chart (matplotlib; a note if it is missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    chart = args.chart or os.path.splitext(args.out)[0] + ".png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print('bench | matplotlib not installed: no chart (pip install -e ".[plot]")')
        return 0
    from plot import plot_benchmark

    hw = report["hardware"]
    plot_benchmark(
        report["rows"],
        chart,
        f"{recipe_name} recipe on {hw['device'].split(' (')[0]}, "
        f"{hw.get('cores', hw.get('gpus'))} {'cores' if 'cores' in hw else 'GPUs'}",
    )
    print(f"bench | wrote {args.out} and {chart}")
    return 0


def main() -> int:
    args = parse_args()
    recipe_name = "smoke" if args.smoke else args.recipe
    recipe = recipe_shape(SMOKE if args.smoke else [f"recipe={args.recipe}"])
    steps, log_every = (8, 2) if args.smoke else (args.steps, args.log_every)
    gpu = torch.cuda.is_available()
    native16 = "bf16" if gpu and torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    modes = select_modes(args, gpu, native16)
    if steps < 3 * log_every:
        sys.exit(
            f"error: --steps must be at least 3 x --log-every ({3 * log_every}): "
            "the first window (start-up, compilation) is left out, "
            "and the snapshot needs a window of its own"
        )
    hw, warnings, load = hardware(), [], measure.load_average()
    # before anything is timed: a busy machine makes both the peak and the rows noisy
    measure.warn(measure.load_warning(load, measure.cpu_cores()), warnings)
    needed = sorted({"fp32", "bf16"} | {precision_of(m[2]) for m in modes})
    size = 512 if args.smoke else 4096 if gpu else 2048
    peaks, spreads = measure.measure_peaks(needed, size, args.peak_gflops)
    measure.print_peaks(hw, peaks, spreads, gpu and tf32_matmuls(torch.device("cuda")), warnings)
    vocab = len(set(open(args.data, encoding="utf-8").read()))
    fpt = flops_per_token(recipe, vocab)
    print(
        f"bench | recipe {recipe_name}: {recipe[0]} layers x {recipe[1]} heads x {recipe[2]} wide, "
        f"context {recipe[3]}, global batch {recipe[4]} | {fpt / 1e6:.2f} MFLOP/token | "
        f"{steps} steps per mode"
    )
    rows = run_rows(args, modes, recipe, steps, log_every, peaks, fpt, warnings)
    print(markdown_table(rows))
    report = {"hardware": hw, "peak_gflops": peaks, "recipe": recipe_name}
    report.update(flops_per_token=fpt, steps=steps, rows=rows, peak_repeats=spreads)
    report.update(load_average=load, warnings=warnings)
    return write_outputs(args, report, recipe_name)


if __name__ == "__main__":
    sys.exit(main())
