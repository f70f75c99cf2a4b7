"""The study notes' comparison table, reproduced: one fixed workload, launched every way the notes
time it.

    # CPU: 2 ranks per row (~4 min, 2 cores)
    python benchmarks/compare.py --data data/tinyshakespeare/input.txt
    # GPU machine: a rank per GPU, bf16 recipe
    python benchmarks/compare.py --gpu --data ...
    # seconds: what CI runs
    python benchmarks/compare.py --smoke --data ...

The notes time one workload under a single GPU, nn.DataParallel, DDP under torchrun, DDP
under mp.spawn, DDP + AMP, Horovod, DeepSpeed and accelerate (2.83 / 2.03 / 1.41 / 1.49 /
0.63 / 5.12 / 1.01 / 1.37 minutes on their GPUs). Here every row trains the same model on
the same global batch for the same number of steps (so the same tokens), timed from launch
to exit: start-up, data, training and the final snapshot, what a user waits for. Peak
memory is main.py's own report on its done line (the largest rank's peak resident size,
and on GPUs its peak of GPU tensors). Rows this machine cannot run say why instead of a
number: nn.DataParallel needs GPUs (its CPU stand-in, the star all-reduce through rank 0,
is timed as its own row), and Horovod runs only where it was built (tools/build_horovod.sh: its
last release, 0.28.1, with upstream's C++17 fix; several minutes of compiling, so CI does not).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time

from common import REPO, free_port, hardware, main_command, run

sys.path.insert(0, REPO)

# Why the Horovod row may not run: `pip install horovod==0.28.1` (its newest release, 2023) stops
# at torch's headers ("#error C++17 or later compatible compiler is required to use PyTorch": it
# compiles its PyTorch extension with -std=c++14); tools/build_horovod.sh builds it with the fix.
HOROVOD = (
    "not built here: Horovod 0.28.1 from PyPI does not compile against torch >= 2.1 (C++14); "
    "run tools/build_horovod.sh (upstream's C++17 fix) to time this row"
)


def horovodrun() -> str | None:
    """horovodrun, if Horovod's PyTorch extension imports here (else None: the row says why)."""
    try:
        import horovod.torch  # noqa: F401 - only whether it loads against this torch
    except ImportError:
        return None
    beside = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return beside if os.path.exists(beside) else shutil.which("horovodrun")


# (the notes' row, its minutes there, what runs here, how it is launched, overrides)
ROWS = [
    ("single GPU", 2.83, "one process", "python", ["parallel=none"]),
    (
        "DataParallel",
        2.03,
        "star all-reduce via rank 0 (in DataParallel's row; not how it works)",
        "torchrun",
        ["parallel=ddp-star"],
    ),
    ("DDP, torch.distributed.launch", 1.41, "DDP", "torchrun", ["parallel=ddp"]),
    ("DDP, mp.spawn", 1.49, "DDP, tutorials/spawn_launch.py", "spawn", ["parallel=ddp"]),
    (
        "DDP + AMP",
        0.63,
        "DDP + bf16 autocast",
        "torchrun",
        ["parallel=ddp", "trainer_config.use_amp=true"],
    ),
    ("Horovod", 5.12, "Horovod", "horovod", ["parallel=horovod"]),
    ("DeepSpeed", 1.01, "DeepSpeed ZeRO-1", "torchrun", ["parallel=zero1"]),
    ("DeepSpeed", 1.01, "DeepSpeed ZeRO-2", "torchrun", ["parallel=zero2"]),
    ("DeepSpeed", 1.01, "DeepSpeed ZeRO-3", "torchrun", ["parallel=zero3"]),
    ("DeepSpeed", 1.01, "DDP, deepspeed launcher", "deepspeed", ["parallel=ddp"]),
    ("accelerate", 1.37, "DDP, accelerate launch", "accelerate", ["parallel=ddp"]),
    ("-", None, "FSDP (PyTorch's ZeRO-3)", "torchrun", ["parallel=fsdp"]),
    # Note 002's "DDP+MP" (DDP with pipeline parallelism), untimed there. At 2 ranks, like every
    # row, it is one replica of 2 stages: the pipeline alone (DDP+MP needs 4 ranks, 2 x 2).
    (
        "DDP+MP",
        None,
        "pipeline, 2 stages, 1F1B (1 replica: no DDP in it)",
        "torchrun",
        ["parallel=ddp", "pipeline_config.degree=2"],
    ),
]
# The workload: (model and batch overrides, steps). Global batch = batch_size x ranks, the same in
# every row.
WORKLOADS = {
    "cpu": (["model=gpt-micro", "data_config.block_size=64"], 8, 200),
    "gpu": (["recipe=shakespeare-gpu", "trainer_config.compile=false"], 64, 1000),
    "smoke": (["model=tiny", "data_config.block_size=32"], 4, 10),
}


def command(launcher: str, nproc: int, args: list[str]) -> tuple[list[str], dict]:
    """The command line (and extra environment) that starts main.py with nproc ranks under a
    launcher."""
    main_py, port = os.path.join(REPO, "main.py"), str(free_port())
    py = sys.executable
    if launcher == "python":
        return [py, main_py, *args], {}
    if launcher == "torchrun":
        return main_command(nproc, args, torchrun=True), {}
    if launcher == "spawn":
        return [
            py,
            os.path.join(REPO, "tutorials", "spawn_launch.py"),
            "--nproc",
            str(nproc),
            *args,
        ], {}
    if launcher == "deepspeed":  # --no_local_rank: main.py reads LOCAL_RANK from the environment
        return [
            py,
            "-m",
            "deepspeed.launcher.runner",
            "--num_accelerators",
            str(nproc),
            "--no_local_rank",
            "--master_port",
            port,
            main_py,
            *args,
        ], {"DS_ACCELERATOR": "cpu" if "trainer_config.device=cpu" in args else "cuda"}
    if (
        launcher == "accelerate"
    ):  # --multi_gpu is the mode that starts several ranks (through torchrun)
        return [
            py,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(nproc),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            port,
            main_py,
            *args,
        ], {}
    if launcher == "horovod":  # its gloo launcher; mingpt_ddp/runtime/horovodrun.py reads its ranks
        hosts = f"localhost:{nproc}"
        return [horovodrun(), "-np", str(nproc), "-H", hosts, "--gloo", py, main_py, *args], {}
    raise ValueError(launcher)


def fp32_unless_amp(overrides: list[str]) -> list[str]:
    """fp32 unless the row says otherwise: "auto" would pick bf16 on a GPU (and on a CPU with bf16
    units), and the DDP row would be the DDP + AMP row again."""
    return [] if any("use_amp" in o for o in overrides) else ["trainer_config.use_amp=false"]


def run_row(row: tuple, nproc: int, workload: tuple, data: str, device: str, workdir: str) -> dict:
    notes_name, notes_min, what, launcher, overrides = row
    base, per_rank_batch, steps = workload
    ranks = 1 if launcher == "python" else nproc
    out = {"notes_row": notes_name, "notes_minutes": notes_min, "here": what, "ranks": ranks}
    if launcher == "horovod" and horovodrun() is None:
        return {**out, "skipped": HOROVOD}
    # A pipeline's ranks share one batch: batch_size is per replica (stages x replicas = ranks).
    degree = int(next((o.split("=")[1] for o in overrides if "pipeline_config.degree" in o), 1))
    if ranks % degree:
        return {**out, "skipped": f"needs a multiple of {degree} ranks (pipeline stages)"}
    run_dir = os.path.join(workdir, re.sub(r"\W+", "_", what))
    args = [
        *base,
        *overrides,
        *fp32_unless_amp(overrides),
        f"data_config.path={data}",
        f"data_config.cache_dir={workdir}/prepared",
        f"trainer_config.device={device}",
        f"trainer_config.batch_size={per_rank_batch * nproc * degree // ranks}",
        f"trainer_config.max_steps={steps}",
        f"trainer_config.log_every={max(1, steps // 5)}",
        f"trainer_config.eval_every={steps}",
        "trainer_config.eval_iters=2",
        "trainer_config.sample_chars=0",
        f"trainer_config.save_every={steps}",
        f"trainer_config.run_dir={run_dir}",
    ]
    cmd, env = command(launcher, nproc, args)
    t0 = time.perf_counter()
    result = run(cmd, env=env, timeout=None)
    wall = time.perf_counter() - t0
    done = re.search(
        r"done \| step (\d+) .*peak memory per rank (\d+) MiB host(?:, (\d+) MiB GPU)?",
        result.stdout,
    )
    if result.returncode != 0 or not done:
        return {
            **out,
            "skipped": (
                f"failed (exit {result.returncode}): {(result.stderr or result.stdout)[-300:]}"
            ),
        }
    tokens = (
        int(re.search(r"= (\d+) tokens \| steps", result.stdout).group(1)) * steps
    )  # per step x steps
    loss = re.findall(r"eval \| step \d+ \| val loss ([\d.]+)", result.stdout)
    return {
        **out,
        "wall_s": round(wall, 1),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall),
        "peak_host_mib": int(done.group(2)),
        "peak_gpu_mib": int(done.group(3)) if done.group(3) else None,
        "val_loss": float(loss[-1]) if loss else None,
    }


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| the notes' row (their GPU minutes) | here | ranks | launch to exit, s "
        "| tokens/s, end to end | peak memory per rank, MiB | val loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        notes = f"{r['notes_row']} ({r['notes_minutes']})" if r["notes_minutes"] else r["notes_row"]
        if "skipped" in r:
            lines.append(f"| {notes} | {r['here']} | - | {r['skipped']} | - | - | - |")
            continue
        mem = f"{r['peak_host_mib']}" + (
            f" host, {r['peak_gpu_mib']} GPU" if r["peak_gpu_mib"] else ""
        )
        lines.append(
            f"| {notes} | {r['here']} | {r['ranks']} | {r['wall_s']:.1f} | "
            f"{r['tokens_per_s']:,} | {mem} | {r['val_loss']:.4f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data", default=os.path.join(REPO, "data", "tinyshakespeare", "input.txt")
    )
    parser.add_argument(
        "--gpu", action="store_true", help="a rank per GPU and nanoGPT's GPU recipe (bf16)"
    )
    parser.add_argument(
        "--nproc", type=int, default=2, help="ranks in the multi-process rows (CPU)"
    )
    parser.add_argument(
        "--rows", default="", help="comma-separated substrings of the 'here' column: run only those"
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 10 steps (for CI)")
    parser.add_argument(
        "--out", default=os.path.join(REPO, "benchmarks", "results", "compare.json")
    )
    args = parser.parse_args()
    if not os.path.exists(args.data):
        sys.exit(
            f"error: no corpus at {args.data}; run python data/fetch_shakespeare.py or pass --data"
        )
    import torch

    if args.gpu:
        nproc, device, workload = torch.cuda.device_count(), "cuda", WORKLOADS["gpu"]
        if nproc == 0:
            sys.exit("error: --gpu on a machine without a CUDA GPU")
    else:
        nproc, device, workload = args.nproc, "cpu", WORKLOADS["smoke" if args.smoke else "cpu"]
    rows = [
        r for r in ROWS if not args.rows or any(w.strip() in r[2] for w in args.rows.split(","))
    ]
    if not rows:
        sys.exit(f"error: --rows {args.rows!r} matches none of: {', '.join(r[2] for r in ROWS)}")
    hw = hardware()["device"]
    print(
        f"compare | {hw} | {os.cpu_count()} cores | torch {torch.__version__} | "
        f"{nproc} ranks per row | "
        f"{' '.join(workload[0])}, {workload[1]} windows per rank, {workload[2]} steps",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="compare-") as workdir:
        zero_rows = [r for r in rows if any(o.startswith("parallel=zero") for o in r[4])]
        # DeepSpeed's first use on a machine compiles an op (about a minute): not part of a row
        if zero_rows:
            print(
                "compare | warm-up, not timed: one short DeepSpeed run "
                "(its first use compiles a shared-memory op)",
                flush=True,
            )
            run_row(
                zero_rows[0],
                nproc,
                (workload[0], workload[1], 2),
                args.data,
                device,
                workdir + "/warm-up",
            )
        for row in rows:
            results.append(run_row(row, nproc, workload, args.data, device, workdir))
            r = results[-1]
            print(
                f"compare | {r['here']} | "
                + (
                    r["skipped"]
                    if "skipped" in r
                    else f"{r['wall_s']:.1f} s | peak {r['peak_host_mib']} MiB per rank"
                ),
                flush=True,
            )
    print(markdown_table(results))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "device": hw,
                "cores": os.cpu_count(),
                "torch": torch.__version__,
                "ranks": nproc,
                "workload": workload,
                "rows": results,
            },
            f,
            indent=1,
        )
    return 0 if all("skipped" not in r or r["here"] == "Horovod" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
