"""What a lost worker costs: torchft's replica groups against torchrun's restart + snapshot.

    python benchmarks/fault_tolerance.py --quick --out benchmarks/results/fault_tolerance.json
    python benchmarks/fault_tolerance.py --quick --only local_sgd,diloco,partition --out F

--only picks modes: restart and torchft (the default, below), and slow_links.py's: step,
local_sgd, diloco (semi-synchronous groups), partition and slow_link (two hosts).

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
import math
import os
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import slow_links  # noqa: E402
from benchmarks.common import FAULTY, hardware, main_command, worker_pid  # noqa: E402
from benchmarks.replica_jobs import (  # noqa: E402
    HEARTBEAT_MS,
    Lighthouse,
    Stamped,
    group,
    lighthouse_program,
    overrides,
)
from mingpt_ddp.metrics import MetricsLog  # noqa: E402

LINKS = ("step", "local_sgd", "diloco", "partition", "slow_link")  # slow_links.py's modes
MODES = ("restart", "torchft", *LINKS)

SIZES = {
    # The survivor must still be training when the killed group is back (a restart takes ~6 s
    # here), so that it heals from it: 16 windows a step, and 100+ steps after each kill.
    "quick": dict(steps=200, save_every=50, kills=(55, 95), batch=16, kill_steps=(10, 40)),
    "full": dict(steps=400, save_every=100, kills=(105, 195), batch=16, kill_steps=(10, 80)),
}


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


def run_pair(data: str, work: Path, size: dict, seed: int, kills: int, rng, extra=()) -> dict:
    """Two replica groups for size["steps"] steps; with kills > 0, SIGKILL a random group's worker
    kills times, each when its peer passes a random step in size["kill_steps"] after the last heal
    (a step, not a time: a random moment the peer reaches on any machine). With
    size["min_groups"] 2 the lighthouse waits for both groups, so the peer cannot finish before
    the killed group is back however slow its restart. The final validation loss (every group
    evaluates every window), how each group ended, and the steps of each kill and heal."""
    with Lighthouse(min_groups=size.get("min_groups", 1)) as lighthouse:
        flags = ["trainer_config.seed=" + str(seed), *extra]
        jobs = [
            group(lighthouse, g, overrides(data, work / f"group{g}", size) + flags, restarts=kills)
            for g in (0, 1)
        ]
        events = [kill_and_heal(jobs, size, rng) for _ in range(kills)]
        codes = [job.wait(timeout=600) for job in jobs]
    finals = [max((s for _, s in job.steps()), default=0) for job in jobs]
    val = [
        r["val_loss"]
        for r in MetricsLog.read(str(work / "group0" / "metrics.jsonl"))
        if "val_loss" in r
    ]
    return {
        "seed": seed,
        "kills": kills,
        "killed_at_healed_at": events,
        "heals": sum(job.text().count("heal |") for job in jobs),  # the start's included
        "restarts": sum(job.text().count("restart | torchrun restarted") for job in jobs),
        "finished": codes == [0, 0],
        "final_steps": finals,
        "val_loss": val[-1] if val else None,
    }


def kill_and_heal(jobs: list[Stamped], size: dict, rng) -> list[int | None]:
    """SIGKILL a random group's worker when its peer passes a random step after the last heal;
    wait for the killed group's heal. [the peer's step at the kill, the step healed to]."""
    victim = rng.randrange(2)
    peer = jobs[1 - victim]
    healed = [int(n) for n in re.findall(r"heal \| step \d+ -> (\d+)", "\n".join(
        job.text() for job in jobs))]  # fmt: skip
    at = max(healed, default=0) + rng.randint(*size["kill_steps"])
    while peer.proc.poll() is None and max((s for _, s in peer.steps()), default=0) < at:
        time.sleep(0.02)  # polling the peer's output: its step, not a wait standing in for one
    pid = worker_pid(jobs[victim].proc.pid, 0)
    if pid is None or peer.proc.poll() is not None:
        return [None, None]
    killed, at = time.monotonic(), max(s for _, s in peer.steps())
    os.kill(pid, signal.SIGKILL)
    t = jobs[victim].wait_for("heal |", after=killed, timeout=120)
    line = next((x for u, x in jobs[victim].lines if u == t and "heal |" in x), "")
    step = re.search(r"-> (\d+)", line)
    return [at, int(step.group(1)) if step else None]


def chaos(data: str, trials: int, size: dict, extra=(), seed: int = 0) -> dict:
    """Three undisturbed pairs (seeds 1-3), then `trials` pairs (seed 1) with 2 random kills each:
    every trial must finish at the last step with a finite final loss within the undisturbed
    spread. The spread is their range widened by its own width on each side: a fourth run of the
    same kind lands inside the bare range of three only half the time (each of the 4 is equally
    likely to be the lowest or the highest)."""
    rng = random.Random(seed)
    runs = []
    for run_seed, kills in [(1, 0), (2, 0), (3, 0)] + [(1, 2)] * trials:
        with tempfile.TemporaryDirectory(prefix="ft-chaos-") as work:
            runs.append(run_pair(data, Path(work), size, run_seed, kills, rng, extra))
        print(json.dumps(runs[-1]), flush=True)
    calm = [r["val_loss"] for r in runs if not r["kills"]]
    width = max(calm) - min(calm)
    low, high = min(calm) - width, max(calm) + width
    for r in runs:
        loss = r["val_loss"]
        r["within_spread"] = loss is not None and math.isfinite(loss) and low <= loss <= high
    return {"spread": [low, high], "runs": runs}


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
    p.add_argument("--chaos", type=int, default=0, help="also N trials of 2 random kills each")
    p.add_argument("--only", default="restart,torchft", help=f"modes, of {','.join(MODES)}")
    p.add_argument("--chart", help="with partition: the partitions' timelines (PNG) here")
    args = p.parse_args()
    modes = [m.strip() for m in args.only.split(",") if m.strip()]
    if unknown := sorted(set(modes) - set(MODES)):
        sys.exit(f"error: --only: no mode {', '.join(unknown)}; the modes: {', '.join(MODES)}")
    lighthouse_program()  # before the first run: exits naming the extra if torchft is missing
    size, rows = SIZES["quick" if args.quick else "full"], []
    for kill in size["kills"]:
        for run in [run for run in (run_restart, run_torchft) if run.__name__[4:] in modes]:
            with tempfile.TemporaryDirectory(prefix="ft-") as work:
                rows.append(run(args.data, Path(work), size, kill))
            print(json.dumps(rows[-1]), flush=True)
    with tempfile.TemporaryDirectory(prefix="ft-links-") as work:  # slow_links.py's modes
        rows += slow_links.rows_for(
            [m for m in modes if m in LINKS], args.data, Path(work), args.quick
        )
    if args.chart and any("timeline" in r for r in rows):
        slow_links.chart(rows, args.chart)
    result = {"hardware": hardware(), "heartbeat_timeout_ms": HEARTBEAT_MS, "size": size}
    result["rows"] = rows
    ok = all(r["finished"] is not False for r in rows)
    if args.chaos:
        result["chaos"] = chaos(args.data, args.chaos, size)
        ok = ok and all(r["finished"] and r["within_spread"] for r in result["chaos"]["runs"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
