"""Every parallelism as a picture: one traced step of each layout, a row per rank, one clock.

    python benchmarks/gallery.py --out docs/images/gallery             # every layout, < 1 min
    python benchmarks/gallery.py --out /tmp/gallery --only ddp,zbv     # some of them

Each layout is a short run of main.py (a GPT of 4 blocks, width 128, on Tiny Shakespeare) with
trainer_config.profile_steps=1: every rank writes a Chrome trace of one step
(mingpt_ddp/runtime/profiling.py), which timeline.py draws as <name>.png and <name>.txt; and a
torchft heal, drawn from its log lines' arrival times. The command of each picture, the machine
and what to look for go to gallery.json beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import hardware, run_main  # noqa: E402
from benchmarks.timeline import draw, read, text  # noqa: E402

DATA = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
MODEL = [
    "gpt_config.n_layer=4",
    "gpt_config.n_head=4",
    "gpt_config.n_embd=128",
    "data_config.block_size=64",
    "trainer_config.batch_size=8",
]


def pipeline(schedule: str, microbatches: int = 4) -> list[str]:
    return ["mesh_config.pp=2", f"pipeline_config.schedule={schedule}",
            f"pipeline_config.microbatches={microbatches}"]  # fmt: skip


# name: (ranks, overrides, what the picture shows)
LAYOUTS = {
    "ddp": (2, [], "DDP: gradient buckets all-reduced while backward computes earlier layers"),
    "fsdp": (
        2,
        ["trainer_config.parallel=fsdp"],
        "FSDP: each block all-gathered before its forward and backward, reduce-scattered after",
    ),
    "tp": (2, ["mesh_config.tp=2"], "Tensor parallelism: two all-reduces per block each way"),
    "ring": (
        2,
        ["mesh_config.cp=2"],
        "Ring attention (context parallelism): K and V sent to the next rank, block by block",
    ),
    "gpipe": (2, pipeline("gpipe"), "GPipe: every forward, then every backward; the bubble"),
    "1f1b": (2, pipeline("1f1b"), "1F1B: a backward as soon as the last stage has a loss"),
    "interleaved1f1b": (
        2,
        pipeline("interleaved1f1b"),
        "Interleaved 1F1B: 2 smaller stages a rank, a smaller bubble, more hand-offs",
    ),
    "zbv": (
        2,
        pipeline("zbv"),
        "ZBV zero bubble: backward split in input (I) and weight (W) halves; W fills the bubble",
    ),
    "dualpipev": (
        2,
        pipeline("dualpipev"),
        "DualPipeV: a V; one microbatch's forward paired with another's backward (in turn here)",
    ),
    "torchft": (
        2,
        ["torchft_config.groups=2"],
        "torchft: group 1 killed, restarted by its torchrun, healed from group 0's live state",
    ),
}
HEAL_STEPS, KILL = 120, 40  # the torchft run: its steps, and the step group 1 dies before


def command(name: str, run_dir: Path) -> tuple[int, list[str]]:
    """The ranks and main.py overrides of a layout's traced run under run_dir."""
    ranks, extra, _ = LAYOUTS[name]
    base = [
        f"data_config.path={DATA}",
        f"trainer_config.run_dir={run_dir}",
        "trainer_config.max_steps=4",
        "trainer_config.eval_every=1000",
        "trainer_config.save_every=1000",
        "trainer_config.profile_steps=1",  # profiling.WARMUP steps first, then one traced
    ]
    return ranks, base + MODEL + extra


def picture(name: str, out: Path, width: int) -> dict:
    """Run one layout, draw its traced step; what gallery.json records of it."""
    if name == "torchft":
        return heal_picture(out, width)
    with tempfile.TemporaryDirectory(prefix=f"gallery-{name}-") as run_dir:
        ranks, overrides = command(name, Path(run_dir))
        result = run_main(overrides, nproc=ranks, timeout=300)
        if result.returncode:
            sys.exit(f"gallery: {name} failed\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
        rows, start, end = read(Path(run_dir) / "traces")
    drawn = text(rows, start, end, width)
    (out / f"{name}.txt").write_text(drawn + "\n")
    draw(rows, start, end, str(out / f"{name}.png"), title=LAYOUTS[name][2])
    shown = " ".join(
        o for o in overrides if not o.startswith(("data_config.path", "trainer_config.run_dir"))
    )
    return {
        "command": f"torchrun --standalone --nproc_per_node={ranks} main.py {shown}",
        "shows": LAYOUTS[name][2],
        "step_ms": round((end - start) / 1e3, 1),
        "text": drawn,
    }


def heal_picture(out: Path, width: int) -> dict:
    """torchft's heal on the project's own event clock (each output line's arrival time): two
    replica groups of one rank through a lighthouse (fault_tolerance.py's run), group 1
    SIGKILLed before step KILL + 1; a tick per logged step, the kill, the heal."""
    from benchmarks.fault_tolerance import SIZES
    from benchmarks.replica_jobs import Lighthouse, group, overrides

    size = {**SIZES["quick"], "steps": HEAL_STEPS}
    with tempfile.TemporaryDirectory(prefix="gallery-torchft-") as work, Lighthouse() as house:
        args = [overrides(str(DATA), Path(work) / f"group{g}", size) for g in (0, 1)]
        jobs = [group(house, 0, args[0]), group(house, 1, args[1], f"kill:0:{KILL}")]
        if any(codes := [job.wait(timeout=300) for job in jobs]):
            sys.exit(f"gallery: torchft failed (exit codes {codes})\n{jobs[1].text()[-3000:]}")
    t0 = min(t for job in jobs for t, _ in job.steps())
    killed = jobs[1].first("fault | rank 0 | kill")
    heal = next((t, x) for t, x in jobs[1].lines if t > killed and "heal |" in x)
    rows = {
        g: {
            "steps": [t - t0 for t, _ in job.steps()],
            "redone": [t - t0 for t, x in job.lines if "not committed" in x],
            "events": [(killed - t0, "K"), (heal[0] - t0, "H")] if g == 1 else [],
        }
        for g, job in enumerate(jobs)
    }
    end = max(t for r in rows.values() for t in r["steps"])
    drawn = heal_text(rows, end, width)
    (out / "torchft.txt").write_text(drawn + "\n")
    heal_draw(rows, end, heal[1].split("| ", 1)[1], str(out / "torchft.png"))
    return {
        "command": "python benchmarks/fault_tolerance.py (its torchft run: 2 replica groups, "
        f"{HEAL_STEPS} steps, group 1 killed before step {KILL + 1})",
        "shows": LAYOUTS["torchft"][2],
        "heal": heal[1],
        "seconds_lost": round(heal[0] - killed, 2),
        "text": drawn,
    }


def heal_text(rows: dict, end: float, width: int) -> str:
    """A line per replica group over the run: `|` steps logged, `!` one the quorum did not commit,
    `K` the kill, `H` the heal, `.` nothing."""
    lines = [f"{end:.1f} s; one character {end / width:.2f} s"]
    for g, r in rows.items():
        marks = ["."] * width
        at = lambda t: min(width - 1, int(t / end * width))  # noqa: E731
        for kind, times in (("|", r["steps"]), ("!", r["redone"])):
            for t in times:
                marks[at(t)] = kind
        for t, letter in r["events"]:
            marks[at(t)] = letter
        lines.append(f"group {g} |{''.join(marks)}|")
    lines.append("| steps logged   ! not committed   K killed   H healed   . nothing")
    return "\n".join(lines)


def heal_draw(rows: dict, end: float, heal: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 2.6))
    for g, r in rows.items():
        y = len(rows) - 1 - g
        ax.vlines(r["steps"], y + 0.1, y + 0.6, color="tab:green", lw=0.6)
        ax.vlines(r["redone"], y + 0.1, y + 0.6, color="tab:red", lw=1.5)
        for t, letter in r["events"]:
            what = "SIGKILL" if letter == "K" else heal
            ax.plot([t], [y + 0.35], marker="X" if letter == "K" else "*", ms=12, color="k")
            ax.annotate(what, (t, y + 0.7), fontsize=8, ha="left")
    ax.set(xlabel="seconds", xlim=(0, end * 1.02), ylim=(0, len(rows) + 0.1))
    ax.set_title(LAYOUTS["torchft"][2] + " (a tick per step)")
    ax.set_yticks([len(rows) - 1 - g + 0.35 for g in rows])
    ax.set_yticklabels([f"group {g}" for g in rows])
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for <layout>.png, .txt and gallery.json")
    p.add_argument("--only", help=f"comma-separated layouts, of: {', '.join(LAYOUTS)}")
    p.add_argument("--text-width", type=int, default=100, help="characters of the text timelines")
    args = p.parse_args()
    names = [n.strip() for n in args.only.split(",")] if args.only else list(LAYOUTS)
    if unknown := [n for n in names if n not in LAYOUTS]:
        sys.exit(f"gallery: unknown layout {', '.join(unknown)}; pick from {', '.join(LAYOUTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "gallery.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {"layouts": {}}
    report["hardware"] = hardware()
    for name in names:
        t0 = time.perf_counter()
        report["layouts"][name] = picture(name, out, args.text_width)
        print(f"{name}: {out / name}.png ({time.perf_counter() - t0:.0f} s)", flush=True)
        print(report["layouts"][name]["text"], flush=True)
    report_path.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
