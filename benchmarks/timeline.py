"""A traced step's timeline: a row per rank, compute and communication apart, on one clock.

    python main.py ... trainer_config.profile_steps=2  # <run_dir>/traces/rank<R>.json.gz
    python benchmarks/timeline.py runs/x/traces              # the last traced step, as text
    python benchmarks/timeline.py runs/x/traces --out ddp.png --text-width 120

From each rank's Chrome trace (mingpt_ddp/runtime/profiling.py): compute is the time the
training thread spends in torch ops (`aten::...`, autograd's `evaluate_function: ...`),
communication the time a collective runs on the backend's own thread (`gloo:all_reduce`, ...; on
GPUs the NCCL kernels). The window is rank 0's last `ProfilerStep#N`; the ranks of one machine
share its clock, so their rows line up. In text, each character is window / width: `#` compute,
`=` communication, `X` both at once (overlap: what DDP's buckets are for), `.` neither.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

COMM = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")


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


def busy(events: list[dict], start: float, end: float) -> dict[str, list]:
    """{"compute": [(a, b)...], "comm": [...]}: the intervals inside the window."""
    main = {e["tid"] for e in events if e["name"].startswith("ProfilerStep#")}
    found: dict[str, list] = {"compute": [], "comm": []}
    for e in events:
        a, b = max(e["ts"], start), min(e["ts"] + e["dur"], end)
        if a >= b:
            continue
        if e["name"].startswith(COMM):
            found["comm"].append((a, b))
        elif e["tid"] in main and e["name"].startswith(("aten::", "autograd::engine")):
            found["compute"].append((a, b))
    return found


def text(rows: dict[int, dict], start: float, end: float, width: int) -> str:
    """A line per rank: each character one width-th of the window."""
    step = (end - start) / width
    lines = [f"window {(end - start) / 1e3:.1f} ms; one character {step / 1e3:.2f} ms"]
    for rank, kinds in sorted(rows.items()):
        marks = []
        for i in range(width):
            a, b = start + i * step, start + (i + 1) * step
            on = {k for k, spans in kinds.items() if any(x < b and a < y for x, y in spans)}
            marks.append("X" if len(on) == 2 else "#" if "compute" in on else "=" if on else ".")
        lines.append(f"rank {rank} |{''.join(marks)}|")
    lines.append("# compute   = communication   X both at once   . neither")
    return "\n".join(lines)


def draw(rows: dict[int, dict], start: float, end: float, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 0.8 + 0.7 * len(rows)))
    colors = {"compute": "tab:blue", "comm": "tab:orange"}
    for rank, kinds in rows.items():
        for k, (offset, color) in zip(kinds, [(0.0, colors["compute"]), (0.35, colors["comm"])]):
            spans = [((a - start) / 1e3, (b - a) / 1e3) for a, b in kinds[k]]
            ax.broken_barh(spans, (rank + offset, 0.3), color=color, label=k if rank == 0 else None)
    ax.set(xlabel="ms into the step", yticks=[r + 0.3 for r in rows], xlim=(0, (end - start) / 1e3))
    ax.set_yticklabels([f"rank {r}" for r in rows])
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", help="a run's traces folder: rank<R>.json.gz files")
    p.add_argument("--out", help="also draw it to this PNG (matplotlib)")
    p.add_argument("--text-width", type=int, default=100, help="characters of the text timeline")
    args = p.parse_args()
    number = lambda q: int(q.name[len("rank") :].split(".")[0])  # rank3.json.gz -> 3
    traces = {number(q): load(q) for q in sorted(Path(args.traces).glob("rank*.json*"), key=number)}
    if not traces:
        sys.exit(f"timeline: no rank*.json(.gz) under {args.traces}")
    start, end = window(traces[min(traces)])
    rows = {rank: busy(events, start, end) for rank, events in traces.items()}
    print(text(rows, start, end, args.text_width))
    if args.out:
        draw(rows, start, end, args.out)


if __name__ == "__main__":
    main()
