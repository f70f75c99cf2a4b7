"""A traced step's timeline: a row per rank, compute and communication apart, on one clock.

    python main.py ... trainer_config.profile_steps=2  # <run_dir>/traces/rank<R>.json.gz
    python benchmarks/timeline.py runs/x/traces              # the last traced step, as text
    python benchmarks/timeline.py runs/x/traces --out ddp.png --text-width 120

From each rank's Chrome trace (mingpt_ddp/runtime/profiling.py): compute is the time the
training thread spends in torch ops (`aten::...`, autograd's `evaluate_function: ...`),
communication the time a collective runs on the backend's own thread (`gloo:all_reduce`, ...; on
GPUs the NCCL kernels), coloured by its kind. A pipeline stage's actions are the regions
`stage S F3` (stages.Stage: forward of microbatch 3; B a whole backward, I and W its input and
weight halves). The window is rank 0's last `ProfilerStep#N`; the ranks of one machine share its
clock, so their rows line up. In text, each character is window / width: `#` compute (a
pipeline's action letter instead: F, B, I, W), `=` communication, `X` both at once (overlap: what
DDP's buckets are for), `.` neither.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

COMM = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")
# Communication by kind (the backend's op name holds it), and its colour in the picture.
KINDS = {
    "all_reduce": "tab:red",
    "all_gather": "tab:purple",
    "reduce_scatter": "tab:pink",
    "all_to_all": "tab:olive",
    "send": "tab:brown",
    "recv": "tab:gray",
    "broadcast": "tab:cyan",
}
ACTION = re.compile(r"^stage (\d+) ([FBIW])(\d+)$")  # stages.Stage's regions
LETTERS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:orange", "W": "tab:green"}
# The project's own regions (trainer.py, snapshots/protocol.py), drawn as a thin lane on top.
PHASES = {
    "forward": "tab:blue",
    "backward": "tab:orange",
    "gradient sync": "tab:red",
    "optimizer step": "tab:green",
    "snapshot": "tab:gray",
}


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def window(events: list[dict]) -> tuple[float, float]:
    """The last traced step's (start, end), in the trace's microseconds."""
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        sys.exit("timeline: no ProfilerStep in the trace: was trainer_config.profile_steps set?")
    last = max(steps, key=lambda e: e["ts"])
    return last["ts"], last["ts"] + last["dur"]


def kind(name: str, issued: list = (), ts: float = 0.0) -> str:
    """A communication op's kind ("all_reduce", "send", ...; "other" if none matches). Gloo runs
    a reduce-scatter (FSDP's) under the name gloo:all_reduce: such an op is named by the c10d
    call issued last before it (issued: sorted (ts, name) of the c10d:: ops)."""
    name = name.lower().replace("allreduce", "all_reduce").replace("allgather", "all_gather")
    name = name.replace("reducescatter", "reduce_scatter").replace("alltoall", "all_to_all")
    found = next((k for k in KINDS if k in name), "other")
    before = [n for t, n in issued if t <= ts]
    if found == "all_reduce" and before and kind(before[-1]) == "reduce_scatter":
        return "reduce_scatter"
    return found


def busy(events: list[dict], start: float, end: float) -> dict[str, list]:
    """The spans inside the window: "compute" (a, b), "comm" (a, b, kind), "actions" (a, b,
    letter + microbatch, stage), "phases" (a, b, the project's region)."""
    main = {e["tid"] for e in events if e["name"].startswith("ProfilerStep#")}
    issued = sorted((e["ts"], e["name"]) for e in events if e["name"].startswith("c10d::"))
    found: dict[str, list] = {"compute": [], "comm": [], "actions": [], "phases": []}
    for e in events:
        a, b = max(e["ts"], start), min(e["ts"] + e["dur"], end)
        if a >= b:
            continue
        if e["name"].startswith(COMM):
            found["comm"].append((a, b, kind(e["name"], issued, e["ts"])))
        elif e["name"] in PHASES:
            found["phases"].append((a, b, e["name"]))
        elif action := ACTION.match(e["name"]):
            found["actions"].append((a, b, action[2] + action[3], int(action[1])))
        elif e["tid"] in main and e["name"].startswith(("aten::", "autograd::engine")):
            found["compute"].append((a, b))
    return found


def read(folder: Path) -> tuple[dict[int, dict], float, float]:
    """Every rank's spans in rank 0's last traced step: ({rank: busy(...)}, start, end)."""
    number = lambda q: int(q.name[len("rank") :].split(".")[0])  # rank3.json.gz -> 3
    traces = {number(q): load(q) for q in sorted(Path(folder).glob("rank*.json*"), key=number)}
    if not traces:
        sys.exit(f"timeline: no rank*.json(.gz) under {folder}")
    start, end = window(traces[min(traces)])
    return {rank: busy(events, start, end) for rank, events in traces.items()}, start, end


def any_actions(rows: dict[int, dict]) -> bool:
    return any(spans["actions"] for spans in rows.values())


def text(rows: dict[int, dict], start: float, end: float, width: int) -> str:
    """A line per rank: each character one width-th of the window."""
    step = (end - start) / width
    lines = [f"window {(end - start) / 1e3:.1f} ms; one character {step / 1e3:.2f} ms"]
    for rank, spans in sorted(rows.items()):
        marks = []
        for i in range(width):
            a, b = start + i * step, start + (i + 1) * step
            hit = lambda s, a=a, b=b: s[0] < b and a < s[1]  # noqa: E731
            comm = any(hit(s) for s in spans["comm"])
            acts = [s[2][0] for s in spans["actions"] if hit(s)]
            if acts:  # a pipeline's action (its sends and receives in flight not marked)
                marks.append(acts[0])
            elif any(hit(s) for s in spans["compute"]):
                marks.append("X" if comm else "#")
            else:
                marks.append("=" if comm else ".")
        lines.append(f"rank {rank} |{''.join(marks)}|")
    legend = "# compute   = communication   X both at once   . neither"
    if any_actions(rows):
        legend += "   F forward, B backward, I and W its input and weight halves"
    lines.append(legend)
    return "\n".join(lines)


def phases(ax, y: float, spans: list[tuple], window: float) -> None:
    """The project's regions (x ms, width ms, name) as a thin lane, named where there is room."""
    for x, w, name in spans:
        ax.broken_barh([(x, w)], (y + 0.8, 0.1), color=PHASES[name], alpha=0.6)
        if w > 0.05 * window / 1e3:
            ax.text(x + w / 2, y + 0.95, name, ha="center", va="bottom", fontsize=6)


def draw(rows: dict[int, dict], start: float, end: float, out: str, title: str = "") -> None:
    """The same as a picture: per rank a compute lane (a pipeline's actions labelled) and a
    communication lane coloured by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = lambda a, b: ((a - start) / 1e3, (b - a) / 1e3)  # noqa: E731
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.0 * len(rows)))
    seen = set()
    for rank, spans in rows.items():
        y = 1.2 * (len(rows) - 1 - rank)  # rank 0 on top
        ax.broken_barh([ms(a, b) for a, b in spans["compute"]], (y + 0.4, 0.35), color="#9ecae1")
        phases(ax, y, [(*ms(a, b), name) for a, b, name in spans["phases"]], end - start)
        first = min((stage for *_, stage in spans["actions"]), default=0)
        for a, b, label, stage in spans["actions"]:  # a rank's later stage pale
            alpha = 0.45 if stage != first else 1.0
            box = dict(color=LETTERS[label[0]], edgecolor="k", alpha=alpha)
            ax.broken_barh([ms(a, b)], (y + 0.4, 0.35), **box)
            x, w = ms(a, b)
            ax.text(x + w / 2, y + 0.575, label, ha="center", va="center", fontsize=6)
        for a, b, k in spans["comm"]:
            color = KINDS.get(k, "black")
            name = k.replace("_", "-") if k not in seen else None
            seen.add(k)
            ax.broken_barh([ms(a, b)], (y + 0.05, 0.3), color=color, label=name)
    ax.set(xlabel="ms into the step", xlim=(0, (end - start) / 1e3), title=title)
    ax.set_yticks([1.2 * (len(rows) - 1 - r) + 0.4 for r in rows])
    ax.set_yticklabels([f"rank {r}" for r in rows])
    heading = "top: the step's regions,\nthen compute" + (
        "\n(pale: a later stage)" if any_actions(rows) else ""
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), title=heading + "\nbottom:")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", help="a run's traces folder: rank<R>.json.gz files")
    p.add_argument("--out", help="also draw it to this PNG (matplotlib)")
    p.add_argument("--text-width", type=int, default=100, help="characters of the text timeline")
    args = p.parse_args()
    rows, start, end = read(Path(args.traces))
    print(text(rows, start, end, args.text_width))
    if args.out:
        draw(rows, start, end, args.out)


if __name__ == "__main__":
    main()
