"""What a lost worker costs: torchft's replica groups against torchrun's restart + snapshot.

    python benchmarks/fault_tolerance.py --quick --out benchmarks/results/fault_tolerance.json

The same model, data and machine, two ways to survive a SIGKILLed worker:
- restart: one torchrun job of 2 ranks (DDP) under --max-restarts=1; rank 1 is killed, torchrun
  stops the other rank and restarts both, and they resume from the last snapshot;
- torchft: 2 replica groups of 1 rank (torchft_config), each its own torchrun job, meeting
  through a lighthouse whose heartbeat timeout is HEARTBEAT_MS; group 1 is killed, group 0 trains
  on alone, and group 1's torchrun restarts it, to heal from group 0.
Each mode is killed early in a snapshot interval (just after a snapshot) and late (just before
the next). Per run (every output line is timestamped as it arrives):
- steps_retrained: optimizer steps whose work is done again after the kill. restart: the steps
  since the last snapshot, trained again after the resume; torchft: the steps a survivor's quorum
  did not commit (each says "not committed"), trained again;
- seconds_lost: from the kill until the job trains at full strength again. restart: until it
  logs the killed step again; torchft: until the killed group logs its heal (the survivor trains
  on meanwhile: survivor_pause_s is the longest gap between its steps, bounded by the heartbeat
  timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import MAIN, free_port, hardware, main_command, start  # noqa: E402

FAULTY = REPO / "tests" / "faulty_main.py"
HEARTBEAT_MS = 2000  # the lighthouse's: how long a silent group stays in the quorum
SIZES = {
    # The survivor must still be training when the killed group is back (a restart takes ~6 s
    # here), so that it heals from it: 16 windows a step, and 100+ steps after each kill.
    "quick": dict(steps=200, save_every=50, kills=(55, 95), batch=16),
    "full": dict(steps=400, save_every=100, kills=(105, 195), batch=16),
}
STEP = re.compile(r"^step +(\d+)/")


class Stamped:
    """A process whose output lines are kept with the time each arrived (time.monotonic)."""

    def __init__(self, cmd: list, env: dict | None = None):
        self.proc = start(cmd, env)  # stdout and stderr in one text pipe
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return code

    def first(self, needle: str, after: float = 0.0) -> float | None:
        """When the first line containing needle (at or after `after`) arrived."""
        return next((t for t, line in self.lines if t >= after and needle in line), None)

    def steps(self) -> list[tuple[float, int]]:
        return [(t, int(m.group(1))) for t, line in self.lines if (m := STEP.match(line))]

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


class Lighthouse:
    """torchft's lighthouse on a free loopback port, for as long as the `with` lasts."""

    def __init__(self, heartbeat_ms: int = HEARTBEAT_MS):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        flags = ["--min_replicas", "1", "--bind", f"[::]:{self.port}", "--join_timeout_ms", "1000"]
        flags += ["--heartbeat_timeout_ms", str(heartbeat_ms), "--quorum_tick_ms", "100"]
        self.cmd = [shutil.which("torchft_lighthouse") or "torchft_lighthouse", *flags]

    def __enter__(self) -> Lighthouse:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


def overrides(data: str, run_dir: Path, size: dict) -> list[str]:
    """The run both modes train: the default model (gpt-micro), fp32, a step logged each."""
    return [
        f"data_config.path={data}",
        f"data_config.cache_dir={run_dir.parent / 'prepared'}",
        f"trainer_config.run_dir={run_dir}",
        f"trainer_config.max_steps={size['steps']}",
        f"trainer_config.save_every={size['save_every']}",
        "trainer_config.log_every=1",
        f"trainer_config.eval_every={size['steps']}",
        "trainer_config.eval_iters=2",
        "trainer_config.sample_chars=0",
        "trainer_config.use_amp=false",
        f"trainer_config.batch_size={size['batch']}",
        "trainer_config.device=cpu",
    ]


def group(lighthouse: Lighthouse, g: int, args: list[str], fault: str | None = None) -> Stamped:
    """Replica group g of 2: a torchrun job of one process that may restart once."""
    flags = ("--max-restarts=1", "--monitor-interval=0.5")
    ft = ["torchft_config.groups=2", f"torchft_config.group={g}"]
    env = {"TORCHFT_LIGHTHOUSE": lighthouse.url, "OMP_NUM_THREADS": "1"}
    if fault:
        env["FAULT"] = fault
    script = FAULTY if fault else MAIN
    return Stamped(main_command(1, args + ft, flags, script, torchrun=True), env)


def run_torchft(data: str, work: Path, size: dict, kill: int) -> dict:
    """Two replica groups; group 1 SIGKILLed before step kill + 1."""
    with Lighthouse() as lighthouse:
        jobs = [
            group(lighthouse, g, overrides(data, work / f"group{g}", size), fault)
            for g, fault in ((0, None), (1, f"kill:0:{kill}"))
        ]
        codes = [job.wait(timeout=600) for job in jobs]
    killed = jobs[1].first("fault | rank 0 | kill")
    healed = jobs[1].first("heal |", after=killed or 0.0)
    survivor = [t for t, _ in jobs[0].steps()]
    pause = max((b - a for a, b in zip(survivor, survivor[1:]) if killed and b > killed), default=0)
    redone = sum(job.text().count("not committed by the quorum") for job in jobs)
    resumed = re.search(r"resume \| step (\d+) \|", jobs[1].text())  # no live peer: a snapshot
    redone += kill - int(resumed.group(1)) if resumed and not healed else 0
    return row("torchft", kill, codes, jobs, redone, killed, healed, pause)


def run_restart(data: str, work: Path, size: dict, kill: int) -> dict:
    """One DDP job of 2 ranks; rank 1 SIGKILLed before step kill + 1, torchrun restarts both."""
    flags = ("--max-restarts=1", "--monitor-interval=0.5")
    cmd = main_command(2, overrides(data, work / "ddp", size), flags, FAULTY, torchrun=True)
    job = Stamped(cmd, {"FAULT": f"kill:1:{kill}", "OMP_NUM_THREADS": "1"})
    code = job.wait(timeout=600)
    killed = job.first("fault | rank 1 | kill")
    resumed = re.search(r"resume \| step (\d+) \|", job.text())
    back = job.first(f"step {kill:>6}/", after=killed or 0.0)
    redone = kill - int(resumed.group(1)) if resumed else None
    return row("restart", kill, [code], [job], redone, killed, back, None)


def row(mode, kill, codes, jobs, redone, killed, back, pause) -> dict:
    """One row of the table (the issue's schema, and the pause and the final steps)."""
    finals = [max((s for _, s in job.steps()), default=0) for job in jobs]
    return {
        "mode": mode,
        "kill_step": kill,
        "steps_retrained": redone,
        "seconds_lost": round(back - killed, 2) if back and killed else None,
        "survivor_pause_s": round(pause, 2) if pause is not None else None,
        "finished": all(code == 0 for code in codes),
        "final_step": min(finals),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="200 steps, kills at 55 and 95")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--data", default=str(REPO.parent / "shared/data/tinyshakespeare/input.txt"))
    args = p.parse_args()
    size, rows = SIZES["quick" if args.quick else "full"], []
    for kill in size["kills"]:
        for run in (run_restart, run_torchft):
            with tempfile.TemporaryDirectory(prefix="ft-") as work:
                rows.append(run(args.data, Path(work), size, kill))
            print(json.dumps(rows[-1]), flush=True)
    result = {"hardware": hardware(), "heartbeat_timeout_ms": HEARTBEAT_MS, "size": size}
    result["rows"] = rows
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    sys.exit(0 if all(r["finished"] for r in rows) else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
