"""benchmarks/parallelisms.py's report: a layout's row (its ranks' numbers against one process's
and the formulas), its label, and the markdown table."""

from __future__ import annotations

import statistics

from benchmarks.formulas import activation_bytes, bubble

DEGREES = ("dp_replicate", "dp_shard", "tp", "cp", "pp")  # a row's degrees (mesh_config's keys)


def row(layout: dict, ranks: list[dict], one: dict) -> dict:
    """One table row: the layout, its loss difference, bytes, memory and bubble (rank means)."""
    steps = zip(*[r["losses"] for r in ranks])  # per step: every rank's loss or None
    losses = [statistics.fmean(v for v in per_step if v is not None) for per_step in steps]
    idle = [r["idle"] for r in ranks if r["idle"] is not None]
    mean = lambda key: statistics.fmean(r[key] for r in ranks)
    pipeline, formula = layout["pp"] > 1, bubble(layout)  # None: only the table has one
    return {
        "layout": label(layout),
        "degrees": {**{k: layout[k] for k in DEGREES}, "ep": layout.get("ep", 1)},
        "experts": layout.get("experts", 0),
        "load_imbalance": imbalance([r["received"] for r in ranks]) if layout.get("ep") else None,
        "routing_flips": flips(ranks, one) if layout.get("experts") else None,
        "sequence_parallel": bool(layout.get("sp")),
        "activation_checkpointing": layout.get("ac", "none"),
        "global_batch": layout["G"],
        "steps": layout["steps"],
        "parallel": layout["parallel"],
        "schedule": layout.get("schedule") if pipeline else None,
        "microbatches": layout.get("m") if pipeline else None,
        "stages_per_rank": layout.get("v", 1) if pipeline else None,
        "max_abs_loss_diff": max(abs(a - b) for a, b in zip(losses, one["losses"])),
        "sent_bytes_per_step": mean("sent"),
        "sent_bytes_formula": mean("formula"),
        "sent_bytes_per_rank": [r["sent"] for r in ranks],
        "sent_bytes_formula_per_rank": [r["formula"] for r in ranks],
        "sent_bytes_by_op": [r["ops"] for r in ranks],  # per rank: {c10d op: bytes sent}
        "bubble_measured": statistics.fmean(idle) if idle else None,
        "bubble_per_rank": idle or None,
        "bubble_formula": formula if formula is not None else ranks[0]["table_bubble"],
        "bubble_from_table": ranks[0]["table_bubble"],  # the action table at unit cost
        "param_bytes_per_rank": max(r["params"] for r in ranks),
        "param_bytes_formula": ranks[0]["params_formula"],
        "grad_bytes_per_rank": max(r["params"] for r in ranks),
        "optimizer_bytes_per_rank": max(r["optimizer"] for r in ranks),
        "activation_bytes_per_rank": max(r["saved"] for r in ranks),
        "activation_bytes_formula": activation_bytes(layout, one["saved"]),
        "tracked_peak_by_category": ranks[0]["tracked"],  # rank 0's, as the planner predicts
        "live_peak": ranks[0].get("live"),  # rank 0's bytes alive at the peak (probes.LivePeak)
    }


def flips(ranks: list[dict], one: dict) -> list[int]:
    """The steps whose tokens per expert (any block) differ from one process's: a top-k choice
    flipped (near-tied scores, computed in another order)."""
    found = []
    for step, mine in enumerate(one["routed"]):
        theirs = {name: row for r in ranks for name, row in r["routed"][step].items()}
        if theirs != mine:
            found.append(step)
    return found


def imbalance(received: list[int]) -> float:
    """Max over mean of the rows each expert-parallel rank computed in the counted step."""
    return max(received) / statistics.fmean(received)


def label(layout: dict) -> str:
    """A layout in words: "dp2 ddp", "pp2 1f1b m=4", "dp2 ddp x pp2 gpipe m=4", "one process",
    "hsdp 2x2" (dp_replicate x dp_shard)."""
    parts = [f"dp{layout['dp']} {layout['parallel']}"] if layout["dp"] > 1 else []
    if layout["dp_replicate"] > 1 and layout["dp_shard"] > 1:
        parts = [f"hsdp {layout['dp_replicate']}x{layout['dp_shard']}"]
    if layout["pp"] > 1:
        v = f" v={layout['v']}" if layout["schedule"].startswith("interleaved") else ""
        parts.append(f"pp{layout['pp']} {layout['schedule']} m={layout['m']}{v}")
    if layout["tp"] > 1:
        parts.append(f"tp{layout['tp']}{' sp' if layout.get('sp') else ''}")
    if layout["cp"] > 1:
        parts.append(f"cp{layout['cp']}")
    if layout.get("experts"):
        bias = " bias only" if layout.get("aux") == 0 else ""  # no balance loss
        parts.append(f"ep{layout.get('ep', 1)} ({layout['experts']} experts){bias}")
    if layout.get("ac"):
        parts.append(f"ac {layout['ac']}")
    return " x ".join(parts) or "one process"


def table(rows: list[dict]) -> str:
    """The markdown table (bytes per rank; bubbles as idle shares of the schedule's step; the
    formulas in brackets)."""
    head = (
        "| layout | windows/step | max loss diff | sent B/step (counted) | formula | "
        "bubble measured | formula | params KB/rank (formula) | params+grads+optim KB/rank | "
        "activations KB/rank (formula) |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    fmt = lambda x, f: "-" if x is None else format(x, f)
    kb = lambda x: "-" if x is None else f"{x / 1e3:,.1f}"
    lines = [head]
    for r in rows:
        state = r["param_bytes_per_rank"] + r["grad_bytes_per_rank"] + r["optimizer_bytes_per_rank"]
        lines.append(
            f"| {r['layout']} | {r['global_batch']} | {r['max_abs_loss_diff']:.1e} | "
            f"{r['sent_bytes_per_step']:,.0f} | "
            f"{r['sent_bytes_formula']:,.0f} | {fmt(r['bubble_measured'], '.3f')} | "
            f"{fmt(r['bubble_formula'], '.3f')} | {kb(r['param_bytes_per_rank'])} "
            f"({kb(r['param_bytes_formula'])}) | {state / 1e3:,.1f} | "
            f"{kb(r['activation_bytes_per_rank'])} ({kb(r['activation_bytes_formula'])}) |"
        )
    return "\n".join(lines)
