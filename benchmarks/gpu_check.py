"""The acceptance run for a GPU machine: one command, no network, a JSON report to quote.

    python benchmarks/gpu_check.py --out gpu_check.json   # >= 1 GPU (13 min on one H200)
    python benchmarks/gpu_check.py --device cpu           # the rehearsal: every row a CPU runs
    python benchmarks/gpu_check.py --device cpu --only "one process fp16,SIGTERM"   # a subset
    python benchmarks/gpu_check.py --cpu-suite            # also the CPU test suite, GPU hidden

Every row is a real training run of main.py with its precision set (trainer_config.use_amp and
amp_dtype, never "auto") and printed; it passes only if it exits cleanly, every logged loss is
finite, and the final validation loss is below a ceiling (the untrained loss, ln(vocabulary),
less 0.3). Distributed rows always run under torchrun: with one GPU, world size 1 over NCCL; the
multi-rank logic on one GPU runs as 2 ranks on the host's CPU over gloo (device=cpu rows), since
NCCL refuses two ranks on one device; NCCL rows with several ranks (resume at another world size,
SIGTERM, kill and restart included) run where there are 2 or more GPUs and say "skipped: 1 GPU"
otherwise. The report: {"hardware": {name, capability, arch_list, driver, ...}, "rows": [{name,
precision, world_size, launcher, finite_loss, val_loss, ok, ...}]}; fields that do not apply (a
CPU's capability) are null.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from common import REPO, TINY_MODEL, hardware, job_env, main_command, start, wait_for_line

sys.path.insert(0, REPO)

import torch  # noqa: E402

from mingpt_ddp.metrics import MetricsLog  # noqa: E402

GPU_MODEL = [  # a small model that still gives a GPU some work
    "gpt_config.n_layer=4",
    "gpt_config.n_head=4",
    "gpt_config.n_embd=128",
    "data_config.block_size=128",
    "trainer_config.batch_size=16",
]
LEARN = ["optimizer_config.learning_rate=1e-2", "optimizer_config.warmup_steps=5"]
DDP, FSDP = "trainer_config.parallel=ddp", "trainer_config.parallel=fsdp"
COMPILE = "trainer_config.compile=true"
OFFLOAD, VIA_RANK0 = "trainer_config.fsdp_cpu_offload=true", "trainer_config.grad_reduce=via_rank0"
AC, SAMPLE = "trainer_config.activation_checkpointing=full", "trainer_config.sample_chars=64"
DS_OFFLOAD = ("deepspeed_config.offload_optimizer=true", "deepspeed_config.offload_params=true")
PRECISION = {
    "fp32": ["trainer_config.use_amp=false"],
    "bf16": ["trainer_config.use_amp=true", "trainer_config.amp_dtype=bf16"],
    "fp16": ["trainer_config.use_amp=true", "trainer_config.amp_dtype=fp16"],
}


@dataclass(frozen=True)
class Row:
    """One check: a run of main.py, how it is launched, and what is done to it."""

    name: str
    precision: str  # fp32 | bf16 | fp16
    overrides: tuple[str, ...] = ()
    ranks: int = 1
    launcher: str = "torchrun"  # torchrun | python
    check: str = "resume"  # resume | world_size | sigterm | restart
    device: str = ""  # "" the check's device; "cpu": the host's CPU even on a GPU machine
    skip: str = ""  # why it cannot run here ("" it can)


def plan_rows(device: str, gpus: int, half: str) -> list[Row]:
    """The rows for this machine: device cuda|cpu, its GPU count, and half, the 16-bit type it
    multiplies in hardware (bf16 from Ampere on, fp16 before; bf16 on a CPU rehearsal)."""
    gpu = device == "cuda"
    # The multi-rank rows' ranks: a GPU each, or 2 (CPU processes; on one GPU, the rows it skips)
    n = gpus if gpu and gpus >= 2 else 2
    many = "" if not gpu or gpus >= 2 else "skipped: 1 GPU (NCCL needs a GPU per rank)"
    offload = "" if gpu else "skipped: needs a GPU (offload moves shards out of GPU memory)"
    ds = ("trainer_config.parallel=deepspeed", "deepspeed_config.zero_stage=2")
    ds3 = ("trainer_config.parallel=deepspeed", "deepspeed_config.zero_stage=3")
    rows = [
        Row("one process fp32", "fp32", launcher="python"),
        Row(f"one process {half} autocast", half, launcher="python"),
        Row("one process fp16 + GradScaler", "fp16", launcher="python"),
        Row(f"one process compile + {half}", half, (COMPILE,), launcher="python"),
        Row("one process Muon", "fp32", ("optimizer_config.optimizer=muon",), launcher="python"),
        Row(
            "one process async saves",
            "fp32",
            ("trainer_config.async_save=true",),
            launcher="python",
        ),
        Row("torchrun x1 DDP", "fp32", (DDP,)),
        Row(f"torchrun x1 DDP + compile + {half}", half, (DDP, COMPILE)),
        Row("torchrun x1 DDP, 4 micro-steps", "fp32", (DDP, "trainer_config.grad_accum_steps=4")),
        Row(f"torchrun x1 FSDP + {half}", half, (FSDP,)),
        Row("torchrun x1 FSDP fp16 + GradScaler", "fp16", (FSDP,)),
        Row("torchrun x1 FSDP fp16 + CPU offload", "fp16", (FSDP, OFFLOAD), skip=offload),
        Row(f"torchrun x1 DeepSpeed ZeRO-2 {half}", half, ds),
        Row(f"torchrun x1 DeepSpeed ZeRO-3 {half}", half, ds3),
        Row(f"torchrun x1 DeepSpeed ZeRO-3 + offload {half}", half, ds3 + DS_OFFLOAD, skip=offload),
        Row(f"one process activation checkpointing + {half}", half, (AC,), launcher="python"),
        Row(
            f"torchrun x1 FSDP + activation checkpointing + compile + {half}",
            half,
            (FSDP, AC, COMPILE),
        ),
        Row("one process sampling during training", "fp32", (SAMPLE,), launcher="python"),
        Row(f"torchrun x{n} DDP", "fp32", (DDP,), n, skip=many),
        Row(f"torchrun x{n} DDP, gradients via rank 0", "fp32", (DDP, VIA_RANK0), n, skip=many),
        Row(f"torchrun x{n} FSDP + {half}", half, (FSDP,), n, skip=many),
        Row(f"torchrun x{n} FSDP, resumed at x1", half, (FSDP,), n, check="world_size", skip=many),
        Row(
            f"torchrun x{n} SIGTERM: saves its step, resumes",
            "fp32",
            (DDP,),
            n,
            check="sigterm",
            skip=many,
        ),
        Row(
            f"torchrun x{n} worker killed: restart, finish",
            "fp32",
            (DDP,),
            n,
            check="restart",
            skip=many,
        ),
    ]
    if gpu:  # the multi-rank logic on any GPU count, and the CPU path of a GPU host
        cpu = dict(ranks=2, device="cpu")
        rows += [
            Row("device=cpu on the GPU host: DDP x2 over gloo", "fp32", (DDP,), **cpu),
            Row("device=cpu on the GPU host: FSDP x2 over gloo", "fp32", (FSDP,), **cpu),
        ]
    return rows


class Check:
    """Runs rows in a scratch directory and keeps their results."""

    def __init__(self, device: str, data: str, work: str, only: str):
        self.device, self.data, self.work, self.only, self.rows = device, data, work, only, []
        with open(data, encoding="utf-8") as f:
            self.ceiling = math.log(len(set(f.read()))) - 0.3  # below the untrained loss
        self.steps = 60 if device == "cuda" else 20

    def wanted(self, name: str) -> bool:
        return not self.only or any(p.strip().lower() in name.lower() for p in self.only.split(","))

    def args(self, row: Row, run_dir: str) -> list[str]:
        model = GPU_MODEL if self.device == "cuda" else [f"{k}={v}" for k, v in TINY_MODEL.items()]
        base = [
            *model,
            *LEARN,
            *PRECISION[row.precision],
            *row.overrides,
            f"data_config.path={self.data}",
            f"data_config.cache_dir={self.work}/prepared",
            f"trainer_config.run_dir={run_dir}",
            f"trainer_config.device={row.device or self.device}",
            "trainer_config.log_every=5",
            "trainer_config.eval_iters=4",
            "trainer_config.sample_chars=0",
            f"trainer_config.save_every={self.steps}",
            f"trainer_config.eval_every={self.steps // 2}",
        ]
        # A row's own setting of a key replaces the base's (Hydra refuses a key given twice)
        mine = {o.split("=")[0] for o in row.overrides}
        return [o for o in base if o.split("=")[0] not in mine or o in row.overrides]

    def command(self, row: Row, args: list[str], ranks: int, flags=()) -> list[str]:
        return main_command(ranks, args, tuple(flags), torchrun=row.launcher == "torchrun")

    def run(self, cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=job_env())

    def row(self, row: Row) -> None:
        if not self.wanted(row.name):
            return
        result = {
            "name": row.name,
            "precision": row.precision,
            "world_size": row.ranks,
            "launcher": row.launcher,
            "device": row.device or self.device,
            "finite_loss": None,
            "val_loss": None,
            "ok": False,
        }
        t0 = time.perf_counter()
        if row.skip:
            result.update(ok=None, skipped=row.skip)
        else:
            run_dir = os.path.join(self.work, re.sub(r"\W+", "_", row.name).strip("_"))
            try:
                getattr(self, f"check_{row.check}")(row, run_dir)
                result.update(self.judge(run_dir))
            except (AssertionError, subprocess.TimeoutExpired) as e:
                result["detail"] = str(e)[-2500:]
        result["seconds"] = round(time.perf_counter() - t0, 1)
        self.rows.append(result)
        say = "skip" if row.skip else "pass" if result["ok"] else "FAIL"
        numbers = row.skip or f"val {result['val_loss']} (ceiling {self.ceiling:.2f})"
        print(f"{say:4} | {row.name} | {row.precision} | {numbers} | {result['seconds']} s")

    def judge(self, run_dir: str) -> dict:
        """Finite losses throughout and a final validation loss below the ceiling."""
        records = MetricsLog.read(os.path.join(run_dir, "metrics.jsonl"))
        losses = [r[k] for r in records for k in ("train_loss", "val_loss") if k in r]
        vals = [r["val_loss"] for r in records if "val_loss" in r]
        finite = bool(losses) and all(math.isfinite(v) for v in losses)
        val = vals[-1] if vals else None
        ok = finite and val is not None and val < self.ceiling
        return {"finite_loss": finite, "val_loss": val, "ok": ok}

    def ok(self, result: subprocess.CompletedProcess, expect: str = "") -> str:
        out = result.stdout + result.stderr
        assert result.returncode == 0 and expect in result.stdout, (
            f"exit {result.returncode}, expected {expect!r}:\n{out[-2500:]}"
        )
        return result.stdout

    def check_resume(self, row: Row, run_dir: str, resume_ranks: int = 0) -> None:
        """Train, snapshot, then resume from that snapshot (at resume_ranks ranks; 0: the same)
        to half as many steps again."""
        args, n = self.args(row, run_dir), self.steps
        self.ok(self.run(self.command(row, args + [f"trainer_config.max_steps={n}"], row.ranks)))
        more = args + [f"trainer_config.max_steps={n * 3 // 2}"]
        ranks = resume_ranks or row.ranks
        self.ok(self.run(self.command(row, more, ranks)), f"resume | step {n} |")

    def check_world_size(self, row: Row, run_dir: str) -> None:
        """Train at row.ranks, then resume the sharded snapshot in one rank (DCP reshards)."""
        self.check_resume(row, run_dir, resume_ranks=1)

    def check_sigterm(self, row: Row, run_dir: str) -> None:
        """SIGTERM to torchrun mid-run: every rank finishes its step, it is saved, and a rerun
        resumes from exactly that step."""
        args = self.args(row, run_dir) + ["trainer_config.max_steps=100000"]
        job = start(self.command(row, args, row.ranks))
        wait_for_line(job, f"step {2 * 5:>6}/", timeout=300)
        job.send_signal(signal.SIGTERM)
        out = job.communicate(timeout=300)[0]
        saved = re.findall(r"snapshot \| step (\d+) ", out)
        assert job.returncode != 0 and saved, f"exit {job.returncode}:\n{out[-2500:]}"
        step = int(saved[-1])
        more = self.args(row, run_dir) + [f"trainer_config.max_steps={step + 10}"]
        self.ok(self.run(self.command(row, more, row.ranks)), f"resume | step {step} |")

    def check_restart(self, row: Row, run_dir: str) -> None:
        """A worker SIGKILLed mid-run: torchrun restarts the group, which resumes and finishes."""
        from common import worker_pid

        args = self.args(row, run_dir) + [f"trainer_config.max_steps={self.steps * 3}"]
        flags = ("--max-restarts=1", "--monitor-interval=1")
        job = start(self.command(row, args, row.ranks, flags))
        wait_for_line(job, f"step {2 * 5:>6}/", timeout=300)
        os.kill(worker_pid(job.pid, 1), signal.SIGKILL)
        out = job.communicate(timeout=600)[0]
        assert job.returncode == 0 and "restart | torchrun restarted" in out, out[-2500:]

    def command_row(self, name: str, cmd: list[str], expect: str, env=None) -> None:
        """A row that is one command (tests, consolidation, sampling, the benchmark)."""
        if not self.wanted(name):
            return
        t0 = time.perf_counter()
        result = subprocess.run(cmd, capture_output=True, text=True, env=job_env(env))
        out = result.stdout + result.stderr
        ok = result.returncode == 0 and expect in out
        row = {"name": name, "precision": None, "world_size": None, "launcher": "python"}
        row.update(finite_loss=None, val_loss=None, ok=ok, seconds=round(time.perf_counter() - t0))
        if not ok:
            row["detail"] = out[-2500:]
        self.rows.append(row)
        print(f"{'pass' if ok else 'FAIL'} | {name} | {row['seconds']} s")


def cross_format(c: Check, half: str) -> None:
    """One snapshot through every format: DDP, resumed by FSDP, consolidated into one file,
    resumed by one process, then sampled from."""
    name = "cross-format: DDP -> FSDP -> consolidate -> one process"
    if not c.wanted(name):
        return
    run_dir = os.path.join(c.work, "cross")
    t0, n, ok, detail = time.perf_counter(), c.steps, True, ""
    for steps, mode, launcher in [(n, DDP, "torchrun"), (2 * n, FSDP, "torchrun")]:
        row = Row(name, half, (mode,), launcher=launcher)
        args = c.args(row, run_dir) + [f"trainer_config.max_steps={steps}"]
        result = c.run(c.command(row, args, 1))
        ok = ok and result.returncode == 0
        detail += result.stderr[-1200:]
    snaps, single = os.path.join(run_dir, "snapshots"), os.path.join(run_dir, "one.pt")
    consolidate = [sys.executable, "-m", "mingpt_ddp.snapshots", "consolidate", snaps, single]
    result = c.run(consolidate)
    ok = ok and result.returncode == 0 and os.path.isfile(single)
    c.rows.append(
        {"name": name, "precision": half, "world_size": 1, "launcher": "torchrun", "ok": ok}
        | {"finite_loss": None, "val_loss": None, "seconds": round(time.perf_counter() - t0)}
        | ({} if ok else {"detail": detail + result.stderr[-1200:]})
    )
    print(f"{'pass' if ok else 'FAIL'} | {name} | {half}")
    sample = [sys.executable, os.path.join(REPO, "sample.py"), "--snapshot", single]
    c.command_row(
        f"sample.py on {c.device}",
        sample + ["--device", c.device, "--chars", "50"],
        expect=f"# step {2 * n}",
    )


def report_hardware(device: str) -> dict:
    """What the report says of the machine; every key present, null where it does not apply."""
    info = {**hardware(), "name": None, "capability": None, "arch_list": None, "driver": None}
    info |= {"cuda": torch.version.cuda, "nccl": None, "bf16_units": None, "memory_gib": None}
    info["built_for_this_gpu"] = None
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "arch_list": torch.cuda.get_arch_list(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "bf16_units": torch.cuda.is_bf16_supported(including_emulation=False),
            "memory_gib": round(props.total_memory / 2**30, 1),
        }
        # A CUDA build compiles kernels for a list of architectures; a GPU outside it (sm_70 in
        # a build without it) fails at the first kernel, or runs slower PTX.
        sm = f"sm_{props.major}{props.minor}"
        info["built_for_this_gpu"] = sm in info["arch_list"]
        if shutil.which("nvidia-smi"):
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            )
            info["driver"] = (smi.stdout.strip().splitlines() or [None])[0]
    else:
        info["name"] = info["device"]
    return info


def find_corpus(given: str) -> str:
    """The corpus to train on, found without the network: --data, $TINYSHAKESPEARE_PATH, the
    shared copy beside the checkout, or the checkout's data/; else a one-line error."""
    candidates = [
        given,
        os.environ.get("TINYSHAKESPEARE_PATH", ""),
        os.path.join(os.path.dirname(REPO), "shared", "data", "tinyshakespeare", "input.txt"),
        os.path.join(REPO, "data", "tinyshakespeare", "input.txt"),
    ]
    found = next((os.path.abspath(p) for p in candidates if p and os.path.isfile(p)), None)
    if given and not os.path.isfile(given):
        found = None  # a corpus asked for by name that is not there is an error, not a fallback
    if found is None:
        sys.exit(
            f"error: no corpus at {given or 'data/tinyshakespeare/input.txt'}; pass --data FILE "
            "or run python data/fetch_shakespeare.py where there is a network"
        )
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--only", default="", help="comma-separated parts of the row names to run")
    p.add_argument("--cpu-suite", action="store_true", help="also the CPU test suite, GPU hidden")
    p.add_argument("--data", default="", help="the corpus (default: found locally, see above)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "gpu_check.json"))
    args = p.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and gpus == 0:
        print("gpu_check | no CUDA device visible: nothing checked (--device cpu rehearses)")
        return 0
    hw = report_hardware(args.device)
    print("hardware | " + " | ".join(f"{k} {v}" for k, v in hw.items() if v is not None))
    if hw["built_for_this_gpu"] is False:
        print(
            f"warning | torch was built for {hw['arch_list']}, not compute capability "
            f"{hw['capability']}: install a build that lists it"
        )
    half = "bf16" if args.device == "cpu" or hw["bf16_units"] else "fp16"
    work = tempfile.mkdtemp(prefix="gpu-check-")
    c = Check(args.device, find_corpus(args.data), work, args.only)
    try:
        run_all(c, gpus, half, args.cpu_suite)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return write_report(c, hw, args.out)


def run_all(c: Check, gpus: int, half: str, cpu_suite: bool) -> None:
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if c.device == "cuda":
        # The tests find the corpus through the environment; without it they skip, and a row
        # of skips is no check (seen on the first H200 run).
        c.command_row(
            "CUDA-only tests",
            pytest + [os.path.join(REPO, "tests", "test_cuda.py")],
            " passed",
            env={"TINYSHAKESPEARE_PATH": c.data},
        )
    for row in plan_rows(c.device, gpus, half):
        c.row(row)
    cross_format(c, half)
    if c.device == "cuda":
        bench = [sys.executable, os.path.join(REPO, "benchmarks", "bench.py"), "--data", c.data]
        out = os.path.join(c.work, "bench.json")
        c.command_row(
            "bench.py --recipe shakespeare-gpu",
            bench + ["--recipe", "shakespeare-gpu", "--out", out],
            "| mode |",
        )
    if cpu_suite:
        c.command_row(
            "CPU suite, GPU hidden",
            pytest + [os.path.join(REPO, "tests")],
            " passed",
            env={"CUDA_VISIBLE_DEVICES": ""},
        )


def write_report(c: Check, hw: dict, out: str) -> int:
    failed = [r["name"] for r in c.rows if r["ok"] is False]
    skipped = sum(r["ok"] is None for r in c.rows)
    print(
        f"\n{len(c.rows) - len(failed) - skipped} passed, {len(failed)} failed, "
        f"{skipped} skipped  (device {c.device}: {hw['name']})"
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"hardware": hw, "device": c.device, "rows": c.rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
