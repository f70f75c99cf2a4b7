"""benchmarks/slow_links.py's parts that run without root: where two hosts cannot be made, the
partition and slow-link modes are rows that say why, and --only names the modes it knows. (The
semi-synchronous groups run in tests/test_torchft.py; the partition itself, which needs network
namespaces, is the benchmark's: python benchmarks/fault_tolerance.py --quick --only partition.)"""

import subprocess
import sys
from pathlib import Path

from benchmarks import hosts, slow_links

REPO = Path(__file__).resolve().parent.parent


def test_two_hosts_need_root_and_say_so(monkeypatch):
    monkeypatch.setattr(hosts.os, "geteuid", lambda: 1000)
    assert hosts.available() == "network namespaces need root"


def test_without_two_hosts_the_partition_is_a_row_that_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(slow_links, "available", lambda: "network namespaces need root")
    rows = slow_links.rows_for(["partition", "slow_link"], "unused", tmp_path, quick=True)
    assert rows == [
        {"mode": mode, "skipped": "network namespaces need root", "finished": None}
        for mode in ("partition", "slow_link")
    ]


def test_only_names_the_modes_it_knows():
    script = REPO / "benchmarks" / "fault_tolerance.py"
    result = subprocess.run(
        [sys.executable, str(script), "--only", "diloco,sometimes"], capture_output=True, text=True
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "error: --only: no mode sometimes; the modes: restart, torchft, step" in result.stderr
