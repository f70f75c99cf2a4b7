"""plot.py draws loss and throughput from metrics files; mistakes get a one-line error."""

import json
import subprocess
import sys

import pytest
from conftest import REPO


def write_metrics(path, losses):
    with open(path, "w") as f:
        for step, loss in enumerate(losses, start=1):
            record = {
                "step": step * 10,
                "train_loss": loss,
                "tokens_per_sec": 1000.0 + step,
                "ms_per_step": 5.0,
            }
            if step % 2 == 0:
                record["val_loss"] = loss + 0.1
            f.write(json.dumps(record) + "\n")
        f.write(
            json.dumps({"step": 20, "event": "snapshot", "stall_ms": 3.0}) + "\n"
        )  # events are skipped


@pytest.mark.slow
def test_plot_draws_one_png_from_several_runs(tmp_path):
    pytest.importorskip("matplotlib")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_metrics(tmp_path / name / "metrics.jsonl", [4.0, 3.0, 2.5, 2.2])
    out = tmp_path / "compare.png"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "plot.py"),
            str(tmp_path / "a" / "metrics.jsonl"),
            str(tmp_path / "b" / "metrics.jsonl"),
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.slow
def test_plot_of_a_missing_file_is_a_one_line_error(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "plot.py"), str(tmp_path / "nope.jsonl")],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert (
        result.stderr.strip().startswith("error: no metrics file at")
        and "Traceback" not in result.stderr
    )


def test_without_matplotlib_plot_prints_the_val_loss_as_a_text_chart(tmp_path, monkeypatch, capsys):
    import importlib.util

    import plot

    write_metrics(tmp_path / "metrics.jsonl", [4.0, 3.0, 2.5, 2.0])
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    assert plot.main([str(tmp_path / "metrics.jsonl")]) == 0
    out = capsys.readouterr().out.splitlines()
    bars = [line for line in out if line.startswith("step ")]
    assert [b.split(" | ")[1] for b in bars] == [
        "3.1000",
        "2.1000",
    ]  # the two evaluations, in order
    assert bars[0].count("#") == 50 and bars[1].count("#") == round(50 * 2.1 / 3.1)
    assert out[-1] == 'plot | no PNG: matplotlib is not installed (pip install -e ".[plot]")'
    assert not (tmp_path / "metrics.png").exists()
