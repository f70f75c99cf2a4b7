"""One command that checks a GPU machine end to end and prints what passed, with numbers.

    python benchmarks/gpu_check.py               # on a machine with >= 1 GPU (a few minutes)
    python benchmarks/gpu_check.py --device cpu --only single
                                                 # rehearse the harness on a CPU machine
    python benchmarks/gpu_check.py               # without a GPU: says so, exits 0 (what CI runs)

The matrix, adapted to the number of GPUs G (1 is the common case):
- environment: torch, CUDA, cuDNN and NCCL versions, the GPUs, the driver;
- the CUDA-only tests (tests/test_cuda.py);
- one process: fp32 (TF32), bf16, fp16 + GradScaler, torch.compile, asynchronous saves,
  each trained, snapshotted and resumed;
- torchrun --nproc_per_node=G: DDP, DDP with gradients through rank 0, FSDP + bf16,
  FSDP + compile, FSDP + CPU offload, each resumed;
- cross-format resume (DDP snapshot -> FSDP -> one process), `python -m mingpt_ddp.snapshots
  consolidate`, and sample.py on the GPU;
- the CPU suite with the GPU hidden (CUDA_VISIBLE_DEVICES=), fast subset unless --full;
- `bench.py --recipe shakespeare-gpu` (ms/step, tokens/s, MFU).
Writes JSON (default benchmarks/results/gpu_check.json) beside the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from common import REPO, job_env, main_command

sys.path.insert(0, REPO)

import torch  # noqa: E402

from mingpt_ddp.metrics import MetricsLog  # noqa: E402

SHAKESPEARE = os.path.join(REPO, "data", "tinyshakespeare", "input.txt")
SMALL = [
    "gpt_config.n_layer=4",
    "gpt_config.n_head=4",
    "gpt_config.n_embd=128",
    "data_config.block_size=128",
    "trainer_config.batch_size=16",
    "trainer_config.eval_iters=5",
    "trainer_config.sample_chars=0",
]
SINGLE = {
    "fp32 (TF32)": [],
    "bf16 autocast": ["trainer_config.use_amp=true"],
    "fp16 + GradScaler": ["trainer_config.use_amp=true", "trainer_config.amp_dtype=fp16"],
    "torch.compile + bf16": ["trainer_config.use_amp=true", "trainer_config.compile=true"],
    "async saves": ["trainer_config.async_save=true"],
}
DISTRIBUTED = {
    "DDP": ["trainer_config.parallel=ddp"],
    "DDP, gradients via rank 0": [
        "trainer_config.parallel=ddp",
        "trainer_config.grad_reduce=via_rank0",
    ],
    "FSDP + bf16": ["trainer_config.parallel=fsdp", "trainer_config.use_amp=true"],
    "FSDP + compile": ["trainer_config.parallel=fsdp", "trainer_config.compile=true"],
    "FSDP + CPU offload": ["trainer_config.parallel=fsdp", "trainer_config.fsdp_cpu_offload=true"],
}


class Matrix:
    """Runs checks, records a row for each, and prints the table at the end."""

    def __init__(self, only: str, work: str, device: str, data: str):
        self.only, self.work, self.device, self.data, self.rows = only, work, device, data, []

    def wanted(self, name: str) -> bool:
        return not self.only or any(
            part.strip().lower() in name.lower() for part in self.only.split(",")
        )

    def record(
        self, name: str, passed: bool, numbers: str, seconds: float, detail: str = ""
    ) -> None:
        row = {
            "check": name,
            "result": "pass" if passed else "FAIL",
            "numbers": numbers,
            "seconds": round(seconds, 1),
        }
        if detail and not passed:
            row["detail"] = detail[-1500:]
        self.rows.append(row)
        print(f"{row['result']:4} | {name} | {numbers} | {seconds:.0f} s", flush=True)

    def run(
        self, cmd: list[str], env: dict | None = None, timeout: float = 900
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            cmd, cwd=self.work, capture_output=True, text=True, timeout=timeout, env=job_env(env)
        )

    def train_and_resume(self, name: str, nproc: int, extra: list[str], steps: int = 60) -> str:
        """Train `steps`, snapshot, then resume to 1.5x steps; pass if both runs succeed and the
        second resumed."""
        if not self.wanted(name):
            return ""
        run_dir = os.path.join(self.work, re.sub(r"\W+", "_", name).strip("_"))
        base = [
            f"data_config.path={self.data}",
            f"data_config.cache_dir={self.work}/prepared",
            f"trainer_config.snapshot_path={run_dir}/snapshots",
            f"trainer_config.metrics_path={run_dir}/metrics.jsonl",
            f"trainer_config.device={self.device}",
            "trainer_config.log_every=10",
            f"trainer_config.save_every={steps}",
            f"trainer_config.eval_every={steps}",
            *SMALL,
            *extra,
        ]
        t0 = time.perf_counter()
        first = self.run(main_command(nproc, base + [f"trainer_config.max_steps={steps}"]))
        second = (
            self.run(main_command(nproc, base + [f"trainer_config.max_steps={steps * 3 // 2}"]))
            if first.returncode == 0
            else first
        )
        passed = (
            first.returncode == 0
            and second.returncode == 0
            and f"resume | step {steps} |" in second.stdout
        )
        numbers = ""
        if passed:
            records = MetricsLog.read(os.path.join(run_dir, "metrics.jsonl"))
            ms = statistics.median(r["ms_per_step"] for r in records[1:] or records)
            numbers = (
                f"{ms:.1f} ms/step, "
                f"{statistics.median(r['tokens_per_sec'] for r in records) / 1e3:.0f}k tok/s, "
                f"val {records[-1].get('val_loss', float('nan')):.3f}"
            )
        self.record(
            name,
            passed,
            numbers,
            time.perf_counter() - t0,
            second.stdout[-800:] + second.stderr[-1500:],
        )
        return run_dir if passed else ""

    def command(
        self,
        name: str,
        cmd: list[str],
        expect: str = "",
        env: dict | None = None,
        numbers=lambda out: "",
        timeout: float = 900,
    ) -> None:
        if not self.wanted(name):
            return
        t0 = time.perf_counter()
        result = self.run(cmd, env, timeout)
        out = result.stdout + result.stderr
        passed = result.returncode == 0 and expect in out
        self.record(name, passed, numbers(out) if passed else "", time.perf_counter() - t0, out)


def cross_format(m: Matrix, nproc: int) -> None:
    """One snapshot path through every format: a DDP snapshot resumed by FSDP, that sharded snapshot
    consolidated into one file and resumed by a single process, then sampled on the device."""
    run_dir, t0, log = os.path.join(m.work, "cross"), time.perf_counter(), ""
    common = [
        f"data_config.path={m.data}",
        f"data_config.cache_dir={m.work}/prepared",
        *SMALL,
        f"trainer_config.snapshot_path={run_dir}/snapshots",
        f"trainer_config.device={m.device}",
        f"trainer_config.metrics_path={run_dir}/metrics.jsonl",
        "trainer_config.save_every=20",
    ]
    legs = [(20, nproc, "ddp"), (40, nproc, "fsdp"), ("consolidate", 0, ""), (60, 1, "none")]
    ok = True
    for steps, procs, mode in legs:
        if steps == "consolidate":
            cmd = [
                sys.executable,
                "-m",
                "mingpt_ddp.snapshots",
                "consolidate",
                f"{run_dir}/snapshots",
                f"{run_dir}/consolidated.pt",
            ]
        else:
            cmd = main_command(
                procs,
                common + [f"trainer_config.max_steps={steps}", f"trainer_config.parallel={mode}"],
            )
        result = m.run(cmd)
        log += result.stdout[-600:] + result.stderr[-1200:]
        expect = (
            "wrote"
            if steps == "consolidate"
            else ""
            if steps == 20
            else f"resume | step {steps - 20} |"
        )
        ok = ok and result.returncode == 0 and expect in result.stdout
    m.record(
        "cross-format resume: DDP -> FSDP -> consolidate -> one process",
        ok,
        "",
        time.perf_counter() - t0,
        log,
    )
    m.command(
        f"sample.py on {m.device}, from the consolidated file",
        [
            sys.executable,
            os.path.join(REPO, "sample.py"),
            "--snapshot",
            f"{run_dir}/consolidated.pt",
            "--device",
            m.device,
            "--chars",
            "100",
        ],
        expect="# step 40",
    )


def environment() -> dict:
    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    if torch.cuda.is_available():
        info["cudnn"] = torch.backends.cudnn.version()
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["bf16"] = torch.cuda.is_bf16_supported()
        info["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        info["driver"] = (
            smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else ""
        )
    return info


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: rehearse the matrix on the CPU",
    )
    p.add_argument(
        "--only",
        default="",
        help="comma-separated substrings: run only the checks whose names match",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="the whole CPU suite with the GPU hidden, not the fast subset",
    )
    p.add_argument("--data", default=SHAKESPEARE)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "gpu_check.json"))
    args = p.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = environment()
    print("environment | " + " | ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    if args.device == "cuda" and gpus == 0:
        print(
            "gpu_check | no CUDA device visible: GPU checks skipped "
            "(use --device cpu to rehearse on the CPU)"
        )
        return 0
    nproc = gpus if args.device == "cuda" else 2
    data = os.path.abspath(args.data)
    work = tempfile.mkdtemp(prefix="gpu-check-")
    m = Matrix(args.only, work, args.device, data)
    try:
        if args.device == "cuda":
            m.command(
                "CUDA-only tests",
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    os.path.join(REPO, "tests", "test_cuda.py"),
                ],
                expect=" passed",
                numbers=lambda out: re.findall(r"\d+ passed[^\n]*", out)[-1],
            )
        for name, extra in SINGLE.items():
            m.train_and_resume(f"single {name}", 1, extra)
        for name, extra in DISTRIBUTED.items():
            if args.device == "cpu" and "offload" in name:
                continue  # offloading moves shards from GPU to CPU memory: nothing to do on a CPU
            m.train_and_resume(f"torchrun x{nproc} {name}", nproc, extra)
        if m.wanted("cross-format"):
            cross_format(m, nproc)
        if args.device == "cuda":
            m.command(
                "CPU suite with the GPU hidden",
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    *([] if args.full else ["-m", "not slow"]),
                    os.path.join(REPO, "tests"),
                ],
                expect=" passed",
                env={"CUDA_VISIBLE_DEVICES": ""},
                timeout=3600,
                numbers=lambda out: re.findall(r"\d+ passed[^\n]*", out)[-1],
            )
            m.command(
                "bench.py --recipe shakespeare-gpu",
                [
                    sys.executable,
                    os.path.join(REPO, "benchmarks", "bench.py"),
                    "--recipe",
                    "shakespeare-gpu",
                    "--data",
                    data,
                    "--out",
                    os.path.join(work, "bench.json"),
                ],
                expect="| mode |",
                numbers=lambda out: "; ".join(
                    line.strip("| ")
                    for line in out.splitlines()
                    if line.startswith("| ") and "mode" not in line
                )[:300],
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    failed = [r for r in m.rows if r["result"] != "pass"]
    print(
        f"\n{len(m.rows) - len(failed)} passed, {len(failed)} failed  "
        f"(device {args.device}, {nproc} ranks for torchrun)"
    )
    print("\n| check | result | numbers | seconds |\n|---|---|---|---|")
    for r in m.rows:
        print(f"| {r['check']} | {r['result']} | {r['numbers']} | {r['seconds']} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"environment": env, "device": args.device, "nproc": nproc, "rows": m.rows}, f, indent=1
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
