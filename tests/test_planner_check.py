"""The planner held against real runs (benchmarks/planner_check.py): its bytes from shapes equal
what the parallelism benchmark counts in gloo runs, and its peaks are within 15% of the peaks the
same trackers (or, for a pipeline, the bytes alive) measured. Apart from test_planner.py so that
the suite's workers can run the two slow files side by side."""

import json
import sys

import pytest
from conftest import REPO, parallelisms, run_python


@pytest.mark.slow
def test_the_planner_predicts_the_bytes_counted_and_the_peaks_tracked_in_real_runs(tmp_path):
    only = "dp2 ddp,dp2 fsdp,tp2 sp,pp2 zbv m=4,dp2 ddp x ep2 (4 experts)"
    _, measured = parallelisms(tmp_path, only)
    out = tmp_path / "check.json"
    check = REPO / "benchmarks" / "planner_check.py"
    result = run_python([sys.executable, check, "--from", measured, "--out", out], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r["bytes_equal"] for r in rows.values()), rows  # from the shapes alone
    ratios = {k: r["peak_ratio"] for k, r in rows.items() if "peak_ratio" in r}
    assert set(ratios) == set(rows)  # every layout's peak measured
    # The trackers where they run; a pipeline's schedule by the bytes alive (probes.LivePeak)
    live = [k for k, r in rows.items() if r["measured_by"] == "live bytes"]
    assert live == ["pp2 zbv m=4"]
    assert all(0.85 <= x <= 1.15 for x in ratios.values()), ratios
    # where the tokens went is data: the rows counted beside an even spread's, held apart
    experts = rows["dp2 ddp x ep2 (4 experts)"]
    assert 0.9 <= experts["routed_rows_ratio"] <= 1.1, experts
