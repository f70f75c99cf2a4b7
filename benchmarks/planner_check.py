"""The planner held against what runs here: its bytes and peak memory beside the parallelism
benchmark's counted bytes and tracked peaks, layout by layout.

    python benchmarks/planner_check.py --out benchmarks/results/planner_check.json     # ~3 min
    python benchmarks/planner_check.py --from parallelisms.json                        # its rows

For every row of benchmarks/parallelisms.py --quick: rank 0's bytes per step
from the planner's formulas (mingpt_ddp/planner/traffic.py, from the shapes alone) against the
bytes CountBytes counted on rank 0; rank 0's peak memory by category as the planner predicts it
(traced under the fake process group where one process can run the layout, estimated from a
traced block elsewhere: mingpt_ddp/planner/memory.py) against the peak the same trackers
recorded in the real gloo run (probes.tracked_peak; DDP's bucket copy, which no tracker sees,
left out of both). A pipeline's schedule does not run under the trackers (probes.tracked_peak
says why): its peak is probes.LivePeak's, the bytes alive at once ("measured_by": "live bytes").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import hardware  # noqa: E402
from mingpt_ddp.planner.memory import calibrate, estimate, trace, traceable  # noqa: E402
from mingpt_ddp.planner.shapes import Layout, Model  # noqa: E402
from mingpt_ddp.planner.traffic import per_dimension  # noqa: E402

VOCAB = 65  # parallelisms.py's
ROWS_OP = "_c10d_functional::all_to_all_single"  # the routed rows' all-to-all (expert.py)


def layout_of(row: dict) -> Layout:
    """The planner's Layout for a benchmark row (fp32: the benchmark runs without autocast)."""
    g = row["degrees"]
    dp = g["dp_replicate"] * g["dp_shard"]
    return Layout(
        g["dp_replicate"], g["dp_shard"], g["tp"], g["pp"], g["cp"],
        row["sequence_parallel"], row["microbatches"] or 1, row["schedule"] or "1f1b",
        row["stages_per_rank"] or 1, batch=row["global_batch"] // dp,
        ac=row.get("activation_checkpointing", "none"), dtype="fp32",
        parallel="fsdp" if row["parallel"] == "fsdp" else "ddp", ep=g.get("ep", 1),
    )  # fmt: skip


def routed_rows(row: dict, predicted: dict) -> dict:
    """Expert parallelism's rows (the all-to-all of parallel/expert.py's tokens) counted on rank
    0 beside the planner's, which assumes an even spread over the experts: where the tokens go
    is data, so these two differ by the routing's imbalance and are held apart from the rest."""
    counted = row["sent_bytes_by_op"][0].get(ROWS_OP, 0.0)
    if not counted and not predicted["ep"]:
        return {}
    return {
        "routed_rows_counted": counted,
        "routed_rows_predicted": predicted["ep"],
        "routed_rows_ratio": round(counted / predicted["ep"], 4),
    }


def predicted_memory(model: Model, layout: Layout) -> tuple[dict, str]:
    if traceable(model, layout):
        return trace(model, layout, buckets=False), "traced"
    return estimate(model, layout, calibrate(model, layout)), "estimated"


def check(row: dict, model: Model) -> dict:
    layout = layout_of(row)
    model = dataclasses.replace(model, n_experts=row["experts"])
    by_dimension = per_dimension(model, layout)
    rows = routed_rows(row, by_dimension)
    counted = row["sent_bytes_per_rank"][0] - rows.get("routed_rows_counted", 0.0)
    predicted = sum(by_dimension.values()) - by_dimension["ep"]
    found = {
        "layout": row["layout"],
        "sent_bytes_rank0": counted,  # without the routed rows (routed_rows)
        "sent_bytes_predicted": predicted,
        "bytes_equal": abs(predicted - counted) < 0.5,
        **rows,
    }
    measured, live = row.get("tracked_peak_by_category") or {}, row.get("live_peak")
    if not measured and not live:
        return found | {"memory": None}
    memory, source = predicted_memory(model, layout)
    peak, guess = sum(measured.values()) if measured else live, sum(memory.values())
    return found | {
        "memory_from": source,
        "measured_by": "trackers" if measured else "live bytes",  # probes.tracked_peak, LivePeak
        "peak_measured": peak,
        "peak_predicted": round(guess),
        "peak_ratio": round(guess / peak, 3),
        "live_peak": live,  # beside a tracked peak: the two measurements held together
        "measured_by_category": measured,
        "predicted_by_category": {k: round(v) for k, v in memory.items()},
    }


def parallelisms(out: Path) -> dict:
    script = REPO / "benchmarks" / "parallelisms.py"
    cmd = [sys.executable, script, "--quick", "--steps", "4", "--out", out]
    subprocess.run([str(c) for c in cmd], check=True, cwd=REPO)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="source", help="a parallelisms.py --quick JSON (else run it)")
    p.add_argument("--out", help="write the rows and the worst ratio as JSON here")
    args = p.parse_args()
    if args.source:
        bench = json.loads(Path(args.source).read_text())
    else:  # kept beside --out: the measured rows the check read
        kept = (
            Path(args.out).with_name(Path(args.out).stem + "_parallelisms.json")
            if args.out
            else None
        )
        with tempfile.TemporaryDirectory() as tmp:
            bench = parallelisms(kept or Path(tmp) / "p.json")
    size = bench["size"]
    model = Model(size["n_layer"], size["n_head"], size["n_embd"], VOCAB, size["T"])
    rows = [check(r, model) for r in bench["rows"]]
    ratios = [r["peak_ratio"] for r in rows if r.get("peak_ratio")]
    worst = max(ratios, key=lambda x: abs(x - 1)) if ratios else None
    print(f"{'layout':40s} {'bytes rank 0':>12s} {'predicted':>12s}  peak KB: measured predicted")
    for r in rows:
        mem = (
            f"{r['peak_measured'] / 1e3:9.1f} {r['peak_predicted'] / 1e3:9.1f} "
            f"({r['peak_ratio']:.3f}, {r['memory_from']})"
            if r.get("peak_ratio")
            else "(no tracked peak: a pipeline)"
        )
        print(
            f"{r['layout']:40s} {r['sent_bytes_rank0']:12,.0f} "
            f"{r['sent_bytes_predicted']:12,.0f}  {mem}"
        )
    equal = sum(r["bytes_equal"] for r in rows)
    print(f"bytes equal in {equal} of {len(rows)} layouts; worst peak ratio {worst}")
    if args.out:
        result = {"hardware": hardware(), "size": size, "worst_peak_ratio": worst, "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
