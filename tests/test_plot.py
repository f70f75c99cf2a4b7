"""plot.py draws loss and throughput from metrics files; mistakes get a one-line error."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("matplotlib")


def write_metrics(path, losses):
    with open(path, "w") as f:
        for step, loss in enumerate(losses, start=1):
            record = {"step": step * 10, "train_loss": loss, "tokens_per_sec": 1000.0 + step, "ms_per_step": 5.0}
            if step % 2 == 0:
                record["val_loss"] = loss + 0.1
            f.write(json.dumps(record) + "\n")
        f.write(json.dumps({"step": 20, "event": "snapshot", "stall_ms": 3.0}) + "\n")  # events are skipped


def test_plot_draws_one_png_from_several_runs(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_metrics(tmp_path / name / "metrics.jsonl", [4.0, 3.0, 2.5, 2.2])
    out = tmp_path / "compare.png"
    result = subprocess.run([sys.executable, str(REPO / "plot.py"), str(tmp_path / "a" / "metrics.jsonl"),
                             str(tmp_path / "b" / "metrics.jsonl"), "-o", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_of_a_missing_file_is_a_one_line_error(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "plot.py"), str(tmp_path / "nope.jsonl")],
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert result.stderr.strip().startswith("error: no metrics file at") and "Traceback" not in result.stderr
