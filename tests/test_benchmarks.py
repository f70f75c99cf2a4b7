"""Benchmark scripts run end to end in their smoke mode and produce their tables."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def run_smoke(script: str, shakespeare, out) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--smoke", "--data", str(shakespeare),
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_snapshot_benchmark_smoke_mode_produces_a_table_and_json(shakespeare, tmp_path):
    result = run_smoke("snapshot_bench.py", shakespeare, tmp_path / "snap.json")
    assert "| model | params_M | storage | size_MB |" in result.stdout
    rows = json.loads((tmp_path / "snap.json").read_text())["rows"]
    assert {r["storage"].split(" ")[0] for r in rows} == {"local", "S3"}
    assert all(r["size_MB"] > 0 and r["load_s"] > 0 and r["save_s"] > 0 for r in rows)


def test_fsdp_benchmark_smoke_mode_reports_memory_speed_and_save_time(shakespeare, tmp_path):
    result = run_smoke("fsdp_bench.py", shakespeare, tmp_path / "fsdp.json")
    assert "| config | params_M | mem_MB_rank0 |" in result.stdout
    rows = {r["parallel"]: r for r in json.loads((tmp_path / "fsdp.json").read_text())}
    assert rows["fsdp"]["optimizer_MB"] < rows["ddp"]["optimizer_MB"]  # sharded: each rank holds a part
    assert all(r["tokens_per_sec"] > 0 and r["save_s"] > 0 for r in rows.values())
