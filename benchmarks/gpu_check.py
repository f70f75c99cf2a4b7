"""The acceptance run for a GPU machine: one command, no network, a JSON report to quote.

    python benchmarks/gpu_check.py --out gpu_check.json   # >= 1 GPU (earlier rows: 13 min, H200)
    python benchmarks/gpu_check.py --device cpu           # the rehearsal: every row a CPU runs
    python benchmarks/gpu_check.py --device cpu --only "one process fp16,SIGTERM"   # a subset
    python benchmarks/gpu_check.py --cpu-suite            # also the CPU test suite, GPU hidden
    python benchmarks/gpu_check.py --plan --gpus 8 --out plan.json   # the rows; runs nothing

Every mode a GPU user can run is a row (the table, and which rows a machine runs and why not:
benchmarks/gpu_rows.py). A training row is a real run of main.py with its precision set (use_amp
and amp_dtype, never "auto"); it passes only if it exits cleanly, prints what its mode prints,
every logged loss is finite, and the final validation loss is below a ceiling (the untrained
loss, ln(vocabulary), less 0.3). Distributed rows run under torchrun (Horovod's: horovodrun).
The report: {"hardware": {name, capability, arch_list, driver, ...}, "rows": [{name, precision,
world_size, launcher, modes, finite_loss, val_loss, ok, ...}]}; fields that do not apply (a
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

import common
import gpu_rows
from common import MAIN, REPO, TINY_MODEL, job_env, main_command, start
from gpu_rows import GPU_MODEL, LEARN, PRECISION, Row, command_of, every_row, find_corpus

sys.path.insert(0, REPO)

import torch  # noqa: E402

from mingpt_ddp.metrics import MetricsLog  # noqa: E402

REPORT = "benchmarks/results/gpu_check.json"
COMMANDS = ("tests", "cross_format", "sample", "bench", "suite")  # rows that are commands


class Check:
    """Runs rows in a scratch directory and keeps their results."""

    def __init__(self, device: str, data: str, work: str, only: str):
        self.device, self.data, self.work, self.only, self.rows = device, data, work, only, []
        with open(data, encoding="utf-8") as f:
            self.ceiling = math.log(len(set(f.read()))) - 0.3  # below the untrained loss
        self.steps = 60 if device == "cuda" else 20

    def wanted(self, name: str) -> bool:
        return not self.only or any(p.strip().lower() in name.lower() for p in self.only.split(","))

    def args(self, row: Row, run_dir: str, more=()) -> list[str]:
        model = GPU_MODEL if self.device == "cuda" else [f"{k}={v}" for k, v in TINY_MODEL.items()]
        base = [*model, *LEARN, *PRECISION[row.precision], *row.overrides,
                f"data_config.path={self.data}", f"data_config.cache_dir={self.work}/prepared",
                f"trainer_config.run_dir={run_dir}",
                f"trainer_config.device={row.device or self.device}",
                "trainer_config.log_every=5", "trainer_config.eval_iters=4",
                "trainer_config.sample_chars=0", f"trainer_config.save_every={self.steps}",
                f"trainer_config.eval_every={self.steps // 2}"]  # fmt: skip
        # A row's own setting of a key replaces the base's, and a check's (more) both: Hydra
        # refuses a key given twice
        keys = lambda overrides: {o.split("=")[0] for o in overrides}
        base = [o for o in base if o.split("=")[0] not in keys(row.overrides) or o in row.overrides]
        return [o for o in base if o.split("=")[0] not in keys(more)] + list(more)

    def command(self, row: Row, args: list[str], ranks: int, flags=()) -> list[str]:
        if row.launcher == "horovodrun":  # gloo's controller; the NCCL build's ops on GPUs
            hosts = ["-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo"]
            return [gpu_rows.horovodrun(), *hosts, sys.executable, MAIN, *args]
        return main_command(ranks, args, tuple(flags), torchrun=row.launcher == "torchrun")

    def run(self, cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=job_env())

    def row(self, row: Row) -> None:
        if not self.wanted(row.name):
            return
        result = {"name": row.name, "precision": row.precision, "world_size": row.ranks}
        result |= {"launcher": row.launcher, "device": row.device or self.device}
        result |= {"modes": list(row.modes), "finite_loss": None, "val_loss": None, "ok": False}
        t0 = time.perf_counter()
        skip = row.skip or gpu_rows.missing(row, row.device or self.device)
        if skip:
            result.update(ok=None, skipped=skip)
        else:
            run_dir = os.path.join(self.work, re.sub(r"\W+", "_", row.name).strip("_"))
            try:
                getattr(self, f"check_{row.check}")(row, run_dir)
                result.update(self.judge(run_dir))
            except (AssertionError, subprocess.TimeoutExpired) as e:
                result["detail"] = str(e)[-2500:]
        result["seconds"] = round(time.perf_counter() - t0, 1)
        self.rows.append(result)
        say = "skip" if skip else "pass" if result["ok"] else "FAIL"
        numbers = skip or f"val {result['val_loss']} (ceiling {self.ceiling:.2f})"
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

    def expect(self, row: Row, out: str) -> None:
        """What the row's mode prints (its layout in the `train` line, a sample) was printed."""
        absent = [e for e in row.expect if e not in out]
        assert not absent, f"not printed: {absent}:\n{out[-2500:]}"

    def check_train(self, row: Row, run_dir: str) -> None:
        """One run: what a row shows in one run (a layout; a precision at several ranks)."""
        args = self.args(row, run_dir, [f"trainer_config.max_steps={self.steps}"])
        self.expect(row, self.ok(self.run(self.command(row, args, row.ranks))))

    def check_resume(self, row: Row, run_dir: str, resume_ranks: int = 0) -> None:
        """Train, snapshot, then resume from that snapshot (at resume_ranks ranks; 0: the same)
        to half as many steps again."""
        args, n = self.args(row, run_dir), self.steps
        first = self.run(self.command(row, args + [f"trainer_config.max_steps={n}"], row.ranks))
        self.expect(row, self.ok(first))
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
        common.wait_for_line(job, f"step {2 * 5:>6}/", timeout=300)
        job.send_signal(signal.SIGTERM)
        out = job.communicate(timeout=300)[0]
        saved = re.findall(r"snapshot \| step (\d+) ", out)
        assert job.returncode != 0 and saved, f"exit {job.returncode}:\n{out[-2500:]}"
        step = int(saved[-1])
        more = self.args(row, run_dir) + [f"trainer_config.max_steps={step + 10}"]
        self.ok(self.run(self.command(row, more, row.ranks)), f"resume | step {step} |")

    def check_restart(self, row: Row, run_dir: str) -> None:
        """A worker SIGKILLed mid-run: torchrun restarts the group, which resumes and finishes."""
        args = self.args(row, run_dir) + [f"trainer_config.max_steps={self.steps * 3}"]
        flags = ("--max-restarts=1", "--monitor-interval=1")
        job = start(self.command(row, args, row.ranks, flags))
        common.wait_for_line(job, f"step {2 * 5:>6}/", timeout=300)
        os.kill(common.worker_pid(job.pid, 1), signal.SIGKILL)
        out = job.communicate(timeout=600)[0]
        assert job.returncode == 0 and "restart | torchrun restarted" in out, out[-2500:]

    def check_stall(self, row: Row, run_dir: str) -> None:
        """A worker SIGSTOPped after its first logged step: within seconds rank 0's stall report
        (trainer_config.stall_report_s) names it; SIGCONT, and the job finishes."""
        n = 10 * self.steps  # enough that the job is still training when rank 1 stops
        cadence = {"max_steps": n, "save_every": n, "eval_every": n // 2}
        args = self.args(row, run_dir, [f"trainer_config.{k}={v}" for k, v in cadence.items()])
        job = start(self.command(row, args, row.ranks))
        try:
            common.wait_for_line(job, f"step {5:>6}/", timeout=300)
            pid = common.worker_pid(job.pid, 1)
            assert pid is not None, "rank 1 ended before it could be stopped"
            os.kill(pid, signal.SIGSTOP)
            try:
                said = common.wait_for_line(job, "rank 1 silent for", timeout=120)[-1]
            finally:
                os.kill(pid, signal.SIGCONT)
            out = job.communicate(timeout=600)[0]
        except BaseException:
            common.kill_tree(job)
            raise
        named = said.startswith("stall | no step for")
        assert job.returncode == 0 and named, f"exit {job.returncode}: {said}\n{out[-2500:]}"

    def check_torchft(self, row: Row, run_dir: str) -> None:
        """Two replica groups of one rank, each a torchrun job, meeting at a lighthouse that waits
        for both (the survivor cannot finish before the killed group is back, however slow its
        restart); group 1 SIGKILLed mid-run: torchrun restarts it, and it heals from group 0."""
        from replica_jobs import Lighthouse

        jobs = []
        try:
            with Lighthouse(min_groups=2) as lighthouse:
                for g, where in enumerate((run_dir, run_dir + "_group1")):
                    jobs.append(self.replica_group(row, lighthouse.url, g, where))
                codes = [job.wait(timeout=600) for job in jobs]
        finally:
            for job in jobs:
                common.kill_tree(job.proc) if job.proc.poll() is None else None
        text = jobs[1].text()
        after = text.split("fault | rank 0 | kill", 1)
        healed = r"heal \| step \d+ -> \d+ \| copied from a live replica group"
        ok = codes == [0, 0] and len(after) == 2 and re.search(healed, after[1])
        assert ok, f"exits {codes}, group 1 killed and healed?\n{text[-2500:]}"

    def replica_group(self, row: Row, url: str, g: int, run_dir: str):
        """Group g of 2 (group 1 killed before step steps/2 + 1), its own GPU on a GPU row."""
        from replica_jobs import FAULTY, Stamped

        more = [f"trainer_config.max_steps={2 * self.steps}", f"torchft_config.group={g}"]
        env = {"TORCHFT_LIGHTHOUSE": url, "OMP_NUM_THREADS": "1"}
        env["FAULT"] = f"kill:0:{self.steps // 2}"  # read by faulty_main.py, group 1's alone
        if (row.device or self.device) == "cuda":  # each group sees one GPU, its cuda:0
            visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
            env["CUDA_VISIBLE_DEVICES"] = visible[g] if visible else str(g)
        flags = ("--max-restarts=1", "--monitor-interval=0.5")
        cmd = main_command(1, self.args(row, run_dir, more), flags, FAULTY if g else MAIN, True)
        return Stamped(cmd, env)

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
        row |= {} if ok else {"detail": out[-2500:]}
        self.rows.append(row)
        print(f"{'pass' if ok else 'FAIL'} | {name} | {row['seconds']} s")


def cross_format(c: Check, planned: Row) -> None:
    """One snapshot through every format: DDP, resumed by FSDP, consolidated into one file (the
    sample row resumes it in one process and samples from it)."""
    name, half = planned.name, planned.precision
    if not c.wanted(name):
        return
    run_dir = os.path.join(c.work, "cross")
    t0, n, ok, detail = time.perf_counter(), c.steps, True, ""
    for steps, mode in [(n, "ddp"), (2 * n, "fsdp")]:
        row = Row(name, half, (f"trainer_config.parallel={mode}",))
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
        | {"modes": list(planned.modes), "finite_loss": None, "val_loss": None}
        | {"seconds": round(time.perf_counter() - t0)}
        | ({} if ok else {"detail": detail + result.stderr[-1200:]})
    )
    print(f"{'pass' if ok else 'FAIL'} | {name} | {half}")


def run_command(c: Check, row: Row) -> None:
    """A row that is a command: cross-format, or one command (gpu_rows.command_of)."""
    if row.check == "cross_format":
        cross_format(c, row)
    else:
        c.command_row(row.name, *command_of(row, c.data, c.work, c.device, c.steps))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--only", default="", help="comma-separated parts of the row names to run")
    p.add_argument("--cpu-suite", action="store_true", help="also the CPU test suite, GPU hidden")
    p.add_argument("--data", default="", help="the corpus (default: found locally, see above)")
    p.add_argument("--out", default="", help=f"the JSON (default: {REPORT})")
    p.add_argument("--plan", action="store_true", help="list the rows (JSON to --out), run none")
    p.add_argument("--gpus", type=int, help="with --plan: GPUs to plan for (default: those seen)")
    args = p.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.plan:  # for --gpus, or the GPUs here
        gpus = gpus if args.gpus is None else args.gpus
        return gpu_rows.write_plan(args.device, gpus, args.cpu_suite, args.out)
    if args.device == "cuda" and gpus == 0:
        print("gpu_check | no CUDA device visible: nothing checked (--device cpu rehearses)")
        return 0
    hw = gpu_rows.report_hardware(args.device)
    print("hardware | " + " | ".join(f"{k} {v}" for k, v in hw.items() if v is not None))
    if hw["built_for_this_gpu"] is False:
        print(
            f"warning | torch was built for {hw['arch_list']}, not compute capability "
            f"{hw['capability']}: install a build that lists it"
        )
    half = "bf16" if args.device == "cpu" or hw["bf16_units"] else "fp16"
    work, out = tempfile.mkdtemp(prefix="gpu-check-"), args.out or os.path.join(REPO, REPORT)
    c = Check(args.device, find_corpus(args.data), work, args.only)
    try:
        run_all(c, gpus, half, args.cpu_suite, lambda: dump(c, hw, out))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return write_report(c, hw, out)


def run_all(c: Check, gpus: int, half: str, cpu_suite: bool, save=lambda: None) -> None:
    """Every row of the table for this machine, in its order (what --plan lists); the report is
    rewritten after each row, so a lease that ends mid-run still brings back the rows it ran."""
    for row in every_row(c.device, gpus, half, cpu_suite):
        run_command(c, row) if row.check in COMMANDS else c.row(row)
        save()


def dump(c: Check, hw: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"hardware": hw, "device": c.device, "rows": c.rows}, f, indent=1)


def write_report(c: Check, hw: dict, out: str) -> int:
    failed = [r["name"] for r in c.rows if r["ok"] is False]
    skipped = sum(r["ok"] is None for r in c.rows)
    print(f"\n{len(c.rows) - len(failed) - skipped} passed, {len(failed)} failed, "
          f"{skipped} skipped  (device {c.device}: {hw['name']})")  # fmt: skip
    dump(c, hw, out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
