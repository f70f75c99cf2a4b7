"""bench.py's matmul peak, and the checks that say when its numbers were taken on a busy machine.

bench.py divides each row's FLOP/s by the device's matmul peak, measured once at the start. On a
machine that other work shares, the peak and the rows are timed at different moments under
different loads: a peak measured while the machine was busy comes out low and a row's MFU above
100% (104.7% on a shared 2-core VM whose measured fp32 peak moved from 117 to 209 GFLOP/s between
two runs), and a row slowed by another job makes a later row look faster than its process count
allows (DDP x2 at 4.6x one process). bench.py cannot quiet the machine; it says, one line each:

- before measuring: a load average above the core count;
- a peak whose repeats disagree: the best (the peak used) more than SPREAD above their median;
- a row whose MFU is above 100%;
- a row of N processes more than N times as fast as every one-process row of its precision.

Imported by bench.py as `measure` (its folder is on sys.path), by the tests as `benchmarks.measure`;
torch is imported only when a peak is measured.
"""

from __future__ import annotations

import os
import statistics
import time

REPEATS = 5  # timings of the peak's matmuls; the best is the peak
SPREAD = 0.15  # best above median by more than this: the timings disagree (an idle 2-core VM: < 9%)
WARM_UP_S = 0.3  # matmuls before timing: threads started, clocks up (cold: 25% slower at first)
AGAIN = "rerun on an idle machine or pass --peak-gflops"
BUSY = f"the measured peak was low: the machine was busy; {AGAIN}"


def peak_repeats(dtype, n: int, repeats: int = REPEATS) -> list[float]:
    """GFLOP/s of each of `repeats` timings of three n x n matmuls in this precision, using every
    core (or the GPU), after WARM_UP_S of untimed ones. fp32 on a GPU is measured as the runs
    compute it: TF32 where the GPU has it (trainer_config.tf32's default), so that an fp32 row's
    MFU is not divided by a full-precision peak."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_float32_matmul_precision("high" if device == "cuda" else "highest")
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    start = time.perf_counter()
    while time.perf_counter() - start < WARM_UP_S:
        a @ b
        sync()
    timings = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(3):
            a @ b
        sync()
        timings.append(2 * n**3 / ((time.perf_counter() - t0) / 3) / 1e9)
    return timings


def measure_peaks(precisions: list[str], n: int, given: float = 0.0) -> tuple[dict, dict]:
    """{precision: peak GFLOP/s} (the given peak, or the best of peak_repeats) and {precision:
    spread of the repeats} (empty when given)."""
    if given:
        return {p: given for p in precisions}, {}
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    repeats = {p: peak_repeats(dtypes[p], n) for p in precisions}
    return {p: max(r) for p, r in repeats.items()}, {p: spread(r) for p, r in repeats.items()}


def spread(repeats: list[float]) -> dict:
    """The repeats' best (the peak bench.py divides by), median and worst GFLOP/s, and how far the
    best is above the median, in percent."""
    best, median = max(repeats), statistics.median(repeats)
    return {
        "best": round(best, 1),
        "median": round(median, 1),
        "worst": round(min(repeats), 1),
        "repeats": len(repeats),
        "best_over_median_pct": round(100 * (best / median - 1), 1),
    }


def load_average() -> float | None:
    """The 1-minute load average: processes running or waiting for a core (None on Windows)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def cpu_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_warning(load: float | None, cores: int) -> str | None:
    """One line when the load average exceeds the cores: other work competes for them."""
    if load is None or load <= cores:
        return None
    return f"load average {load:.1f} on {cores} cores: timings will be noisy; {AGAIN}"


def warn(line: str | None, warnings: list[str]) -> None:
    """Print a warning below (None: nothing to say) as one line, and keep it for the JSON."""
    if line:
        print(f"bench | warning: {line}", flush=True)
        warnings.append(line)


def print_peaks(hw: dict, peaks: dict, spreads: dict, tf32: bool, warnings: list[str]) -> None:
    """bench.py's first line (the device and each precision's peak), the repeats' spread, and a
    warning for each unstable peak."""
    print(
        f"bench | {hw['device']} | "
        f"{hw.get('cores', hw.get('gpus'))} {'cores' if 'cores' in hw else 'GPUs'} | "
        f"torch {hw['torch']} | "
        "matmul peak "
        + " / ".join(f"{p}{' (TF32)' * (p == 'fp32' and tf32)} {v:.0f}" for p, v in peaks.items())
        + " GFLOP/s"
    )
    if spreads:
        print(
            "bench | matmul peak repeats (best / median / worst GFLOP/s): "
            + ", ".join(
                f"{p} {s['best']:.0f} / {s['median']:.0f} / {s['worst']:.0f} "
                f"({s['best_over_median_pct']:.0f}% apart)"
                for p, s in spreads.items()
            )
        )
    for p, s in spreads.items():
        warn(peak_warning(p, s), warnings)


def peak_warning(precision: str, s: dict) -> str | None:
    """One line when the best of a peak's repeats is more than SPREAD above their median."""
    if s["best_over_median_pct"] <= 100 * SPREAD:
        return None
    return (
        f"{precision} matmul peak unstable: best {s['best']:.0f}, median {s['median']:.0f} "
        f"GFLOP/s, {s['best_over_median_pct']:.0f}% apart over {s['repeats']} repeats "
        f"(more than {100 * SPREAD:.0f}%): the machine was busy; {AGAIN}"
    )


def mfu_warning(row: dict, measured: bool) -> str | None:
    """One line when a row's MFU is above 100%: the peak it was divided by is too low."""
    if row["mfu"] <= 1:
        return None
    why = BUSY if measured else "the --peak-gflops given is below what this row reached"
    return f"MFU {100 * row['mfu']:.1f}% above 100% ({row['mode']}): {why}"


def speedup_warnings(rows: list[dict]) -> list[str]:
    """One line per row of N processes more than N times as fast (tokens/s, the same global batch)
    as the fastest one-process row of its precision: more than linear, which a process count
    cannot give; the load changed between the rows."""
    single: dict[str, dict] = {}
    for r in sorted(rows, key=lambda r: r["tokens_per_sec"]):
        if r["processes"] == 1:
            single[r["precision"]] = r  # the fastest last
    lines = []
    for r in rows:
        one = single.get(r["precision"])
        if (
            one
            and r["processes"] > 1
            and r["tokens_per_sec"] > r["processes"] * one["tokens_per_sec"]
        ):
            lines.append(
                f"{r['mode']} at {r['tokens_per_sec'] / one['tokens_per_sec']:.1f}x the tokens/s "
                f"of {one['mode']} on {r['processes']} processes, more than "
                f"{r['processes']}x: the load changed between rows; rerun on an idle machine"
            )
    return lines
