"""Slow and broken links between replica groups (torchft_config): semi-synchronous training
against per-step averaging, and a network partition between two hosts.

    python benchmarks/fault_tolerance.py --quick --only local_sgd,diloco,partition --out F
    python benchmarks/fault_tolerance.py --quick --only slow_link --out F

Two replica groups of one process each (the default model, fp32, the same tokens in every run):
- step, local_sgd, diloco (loopback): for H in SIZES' sync_every, the groups meet every H steps
  (step: every step, gradients averaged). Per row: sent_bytes_per_step (what a group handed to
  the all-reduces between groups, over its steps: the payload; a ring over 2 groups puts as much
  on each link), val_loss, wall_s, finished. And for one H > 1, group 1 SIGKILLed after step
  `kill`: steps_lost (its steps since the last meeting, <= H) and the steps it trained after its
  restart before it healed at its first meeting (replaced by the peer's weights).
- partition (needs root: benchmarks/hosts.py): group 0 and the lighthouse on host A, group 1 on
  host B; once group 0 passes step `cut_at`, the link goes down for cut_s seconds. What decides
  the outcome is in the row: the lighthouse's heartbeat timeout (HEARTBEAT_MS) drops the silent
  group from the next quorum, and torchft_config.timeout_s fails the all-reduce in flight and
  group 1's quorum calls, which end its process; torchrun restarts it (until the link is back) and
  it heals from group 0. healed, steps_lost (steps not committed, trained again), restarts,
  survivor_pause_s (group 0's longest gap between steps), finished.
- slow_link (needs root): the two hosts' link limited to RATE_MBIT by tc; step against diloco.
"""

from __future__ import annotations

import math
import re
import sys
import time
from pathlib import Path

from benchmarks.common import MAIN, free_port
from benchmarks.hosts import Hosts, available
from benchmarks.replica_jobs import HEARTBEAT_MS, Lighthouse, Stamped, group, overrides
from mingpt_ddp.metrics import MetricsLog

SIZES = {
    "quick": dict(steps=100, batch=16, sync_every=(1, 10, 50), kill_every=10, kill=35,
                  kill_steps=300, cut_at=40, save_every=25, cut_s=(8.0, 20.0), partition_steps=400,
                  slow_steps=40),
    "full": dict(steps=500, batch=16, sync_every=(1, 10, 50), kill_every=10, kill=135,
                 kill_steps=800, cut_at=100, save_every=60, cut_s=(8.0, 20.0), partition_steps=1000,
                 slow_steps=100),
}  # fmt: skip
TIMEOUT_S = 5.0  # torchft_config.timeout_s in the partition: a cut longer than this is a failure
# A restart during the cut fails too (its process group waits TIMEOUT_S for the other node) and
# spends one of torchrun's restarts: 3 ran out in an 8 s cut once. Budget them for the outage.
RESTARTS = 10
RATE_MBIT = 50  # the slow link: a model's gradients (3.2 MB) take about half a second


def sync_flags(sync: str, every: int) -> list[str]:
    return (
        []
        if sync == "step"
        else [f"torchft_config.sync={sync}", f"torchft_config.sync_every={every}"]
    )


def run_groups(data, work: Path, steps: int, batch: int, extra, lighthouse, fault=None):
    """Both groups to the end; (jobs, exit codes, seconds)."""
    size = dict(steps=steps, save_every=max(steps // 2, 1), batch=batch)
    t0 = time.monotonic()
    jobs = [
        group(lighthouse, g, overrides(data, work / f"group{g}", size) + extra,
              fault if g == 1 else None, restarts=5)
        for g in (0, 1)
    ]  # fmt: skip
    return jobs, [job.wait(timeout=900) for job in jobs], time.monotonic() - t0


def outcome(work: Path, steps: int, codes) -> dict:
    """What group 0 logged: bytes a step, the final validation loss, the mean step time."""
    records = MetricsLog.read(str(work / "group0" / "metrics.jsonl"))
    trained = [r for r in records if "train_loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {
        "sent_bytes_per_step": round(trained[-1]["sent_bytes"] / steps) if trained else None,
        "val_loss": val[-1] if val else None,
        "ms_per_step": round(sum(r["ms_per_step"] for r in trained) / max(len(trained), 1), 1),
        "finished": codes == [0, 0] and bool(val) and math.isfinite(val[-1]),
    }


def semi_sync_row(data, work: Path, size: dict, sync: str, every: int, kill: int = 0) -> dict:
    """Two groups on loopback meeting every `every` steps; with kill, group 1 SIGKILLed then."""
    steps = size["kill_steps"] if kill else size["steps"]
    fault = f"kill:0:{kill}" if kill else None
    with Lighthouse(min_groups=1 if kill else 2) as lighthouse:  # 2: both start together
        jobs, codes, wall = run_groups(
            data, work, steps, size["batch"], sync_flags(sync, every), lighthouse, fault
        )
    row = {"mode": sync, "sync_every": every, "steps": steps, "wall_s": round(wall, 1)}
    row |= outcome(work, steps, codes)
    if kill:
        heal = re.search(r"heal \| step (\d+) -> (\d+)", jobs[1].text())
        start = re.findall(r"resume \| step (\d+) \|", jobs[1].text())  # the restart's snapshot
        row |= {
            "killed_after_step": kill,
            "steps_lost": kill - kill // every * every,  # since its last meeting
            "healed": heal is not None,
            "trained_before_heal": int(heal.group(1)) - int((start or [0])[-1]) if heal else None,
        }
    return row


def partition_row(data, work: Path, size: dict, cut_s: float) -> dict:
    """Group 0 on host A, group 1 on host B; the link cut for cut_s seconds at step cut_at."""
    extra = [f"torchft_config.timeout_s={TIMEOUT_S}"]
    steps, batch = size["partition_steps"], size["batch"]
    with Hosts() as hosts, Lighthouse(hosts=hosts) as lighthouse:
        size0 = dict(steps=steps, save_every=steps // 2, batch=batch)
        jobs = [
            group(lighthouse, g, overrides(data, work / f"group{g}", size0) + extra, restarts=10)
            for g in (0, 1)
        ]
        cut = wait_for_step(jobs[0], size["cut_at"])
        restored = hosts.partition(cut_s)
        codes = [job.wait(timeout=900) for job in jobs]
    survivor = [t for t, _ in jobs[0].steps()]
    late = jobs[1].text().split("restart 1 |", 1)[-1]
    healed = jobs[1].first("heal |", after=cut)
    return (
        {
            "mode": "partition",
            "how": "torchft",
            "cut_s": cut_s,
            "timeout_s": TIMEOUT_S,
            "heartbeat_timeout_ms": HEARTBEAT_MS,
            "healed": healed is not None,
            "healed_s_after_restore": round(healed - restored, 1) if healed else None,
            "resumed": "resume | step" in late and "starting fresh" not in late,
            "restarts": jobs[1].text().count("restart | torchrun restarted"),
            "steps_lost": sum(job.text().count("not committed") for job in jobs),
            "survivor_pause_s": round(
                max(b - a for a, b in zip(survivor, survivor[1:]) if b > cut), 2
            ),
            "finished": codes == [0, 0],
            "final_steps": [max((s for _, s in job.steps()), default=0) for job in jobs],
        }
        | timeline(jobs, ["group 0 (host A)", "group 1 (host B)"], cut, cut_s)
        | failed(jobs, codes)
    )


def restart_partition_row(data, work: Path, size: dict, cut_s: float, timeout_s: float) -> dict:
    """One DDP job of 2 nodes (a rank each, c10d rendezvous on host A), the link cut for cut_s
    at step cut_at. With collective_timeout_s above the cut the all-reduce in flight waits and
    goes on (TCP carries on once the link is back); below it, it fails, torchrun restarts both
    workers and they resume the last snapshot, if the agents meet again before their restarts
    run out (docs/fault-tolerance.md: 3 of 5 such runs here did not)."""
    steps, port = size["partition_steps"], free_port()
    flags = dict(steps=steps, save_every=size["save_every"], batch=size["batch"])
    args = overrides(data, work, flags) + [f"trainer_config.collective_timeout_s={timeout_s}"]
    with Hosts() as hosts:
        nodes = [Stamped(hosts.command(n, node_command(hosts, n, port, args)),
                         {"GLOO_SOCKET_IFNAME": hosts.nics[n], "OMP_NUM_THREADS": "1"})
                 for n in (0, 1)]  # fmt: skip
        cut = wait_for_step(nodes[0], size["cut_at"])
        reached = max(s for _, s in nodes[0].steps())
        restored = hosts.partition(cut_s)
        codes = [node.wait(timeout=900) for node in nodes]
    text = nodes[0].text()
    resumed = re.findall(r"resume \| step (\d+) \|", text.split("restart 1 |", 1)[-1])
    back = nodes[0].first(f"step {reached + 1:>6}/", after=cut)
    return (
        {
            "mode": "partition",
            "how": "ddp",
            "cut_s": cut_s,
            "timeout_s": timeout_s,
            "healed": False,
            "resumed": bool(resumed) and "restart 1 |" in text,
            "restarts": text.count("restart | torchrun restarted"),
            "steps_lost": reached - int(resumed[-1]) if resumed else 0 if codes == [0, 0] else None,
            "back_s_after_restore": round(back - restored, 1) if back else None,
            "finished": codes == [0, 0],
            "final_steps": [max(s for _, s in nodes[0].steps())],
        }
        | timeline(nodes[:1], ["the job (rank 0 logs)"], cut, cut_s)
        | failed(nodes, codes)
    )


def node_command(hosts: Hosts, n: int, port: int, args: list[str]) -> list[str]:
    """torchrun on host n of a 2-node job whose rendezvous store is on host A (is_host: the
    hosts share one hostname, so torchrun cannot tell from it which one serves the store)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
        "--rdzv_backend=c10d", f"--rdzv_endpoint={hosts.addresses[0]}:{port}",
        "--rdzv_id=partition", f"--rdzv_conf=is_host={int(n == 0)}", f"--max-restarts={RESTARTS}",
        "--monitor-interval=0.5", f"--local-addr={hosts.addresses[n]}", MAIN, *args,
    ]  # fmt: skip


def timeline(jobs: list[Stamped], names: list[str], cut: float, cut_s: float) -> dict:
    """Each job's logged steps as (seconds, step) from the first line, and the cut's window."""
    t0 = min(job.lines[0][0] for job in jobs)
    steps = {
        name: [(round(t - t0, 2), s) for t, s in job.steps()] for name, job in zip(names, jobs)
    }
    return {
        "timeline": steps,
        "cut_from_s": round(cut - t0, 2),
        "cut_to_s": round(cut - t0 + cut_s, 2),
    }


def failed(jobs: list[Stamped], codes: list[int]) -> dict:
    """The end of each job's output that did not exit 0 (what a failed row needs to be read)."""
    tails = [job.text()[-3000:] for job, code in zip(jobs, codes) if code != 0]
    return {"detail": tails} if tails else {}


def chart(rows: list[dict], path: str) -> None:
    """The partition rows' timelines, one panel each: steps against time, the cut shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [r for r in rows if "timeline" in r]
    fig, axes = plt.subplots(len(parts), 1, figsize=(9, 2.4 * len(parts)), squeeze=False)
    for ax, r in zip(axes[:, 0], parts):
        for size, (name, points) in zip((5, 2), r["timeline"].items()):  # group 1 over group 0
            ax.plot(*zip(*points), ".", ms=size, label=name)
        ax.axvspan(r["cut_from_s"], r["cut_to_s"], color="tab:red", alpha=0.15, label="link down")
        how = "torchft groups" if r["how"] == "torchft" else "one DDP job of 2 nodes"
        outcome = "healed" if r["healed"] else f"resumed, {r['steps_lost']} steps trained again"
        outcome = outcome if r["resumed"] or r["healed"] else "paused, nothing trained again"
        outcome = outcome if r["finished"] else "did not finish"
        ax.set_title(
            f"{how}: link down {r['cut_s']:g} s (timeouts {r['timeout_s']:g} s): {outcome}"
        )
        ax.set_ylabel("step")
        ax.legend(loc="lower right", fontsize=7, markerscale=4)
    axes[-1, 0].set_xlabel("seconds since start (2-core CPU, two network namespaces)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def wait_for_step(job: Stamped, step: int) -> float:
    """When the job logged `step` (polling its output for the line, not a timed guess)."""
    while job.proc.poll() is None:
        if any(s >= step for _, s in job.steps()):
            return time.monotonic()
        time.sleep(0.05)
    raise RuntimeError(f"the group exited before step {step}:\n{job.text()[-2000:]}")


def slow_link_rows(data, work: Path, size: dict) -> list[dict]:
    """Per-step averaging against DiLoCo every 10 steps over a link of RATE_MBIT."""
    rows = []
    for sync, every in (("step", 1), ("diloco", 10)):
        with Hosts() as hosts, Lighthouse(min_groups=2, hosts=hosts) as lighthouse:
            hosts.rate(RATE_MBIT)
            run = work / f"slow_{sync}"
            steps = size["slow_steps"]
            _, codes, wall = run_groups(
                data, run, steps, size["batch"], sync_flags(sync, every), lighthouse
            )
        rows.append({"mode": "slow_link", "sync": sync, "sync_every": every} | {
            "rate_mbit": RATE_MBIT, "steps": steps, "wall_s": round(wall, 1)
        } | outcome(run, steps, codes))  # fmt: skip
    return rows


def rows_for(modes: list[str], data: str, work: Path, quick: bool) -> list[dict]:
    """The rows of the modes asked for (fault_tolerance.py --only), printed as they finish."""
    size, rows = SIZES["quick" if quick else "full"], []
    why = available() if {"partition", "slow_link"} & set(modes) else ""
    for mode in modes:
        printed = len(rows)
        if mode in ("step", "local_sgd", "diloco"):
            for every in (1,) if mode == "step" else size["sync_every"]:
                rows.append(semi_sync_row(data, work / f"{mode}{every}", size, mode, every))
            if mode != "step":
                every, kill = size["kill_every"], size["kill"]
                rows.append(semi_sync_row(data, work / f"{mode}k", size, mode, every, kill))
        elif why:
            rows.append({"mode": mode, "skipped": why, "finished": None})
        elif mode == "partition":  # a cut shorter than the timeouts, then one longer
            for cut_s in size["cut_s"]:
                rows.append(partition_row(data, work / f"partition{cut_s:g}", size, cut_s))
            short = size["cut_s"][0]
            # The DDP job with its timeout above the cut: with it below, its restarts across the
            # partition ran out in 3 of 5 runs here (docs/fault-tolerance.md)
            rows.append(restart_partition_row(data, work / "restart", size, short, 3 * short))
        elif mode == "slow_link":
            rows += slow_link_rows(data, work, size)
        for row in rows[printed:]:
            print({k: v for k, v in row.items() if k != "timeline"}, flush=True)
    return rows
