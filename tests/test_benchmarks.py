"""Benchmark scripts run end to end in their smoke mode and produce their tables."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_snapshot_benchmark_smoke_mode_produces_a_table_and_json(shakespeare, tmp_path):
    out = tmp_path / "snap.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "snapshot_bench.py"), "--smoke",
                             "--data", str(shakespeare), "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| model | params_M | storage | size_MB |" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {r["storage"].split(" ")[0] for r in rows} == {"local", "S3"}
    assert all(r["size_MB"] > 0 and r["load_s"] > 0 and r["save_s"] > 0 for r in rows)
