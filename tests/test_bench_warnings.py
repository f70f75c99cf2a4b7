"""benchmarks/bench.py says when its numbers were taken on a busy machine (benchmarks/measure.py):
a load average above the cores, a matmul peak whose repeats disagree, an MFU above 100%, a row
faster than its process count allows. In process, the runs and the peak's timings injected: the
numbers a learner saw on a busy 2-core machine (MFU 104.7%, DDP x2 at 4.6x one process)."""

import json
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import bench  # noqa: E402
import measure  # noqa: E402 - the module bench.py uses (not benchmarks.measure, a second copy)

AGAIN = "rerun on an idle machine or pass --peak-gflops"


def fake_row(name: str, nproc: int, overrides: dict, *_args) -> dict:
    """A row as run_mode returns it, at the tokens/s each test sets in fake_row.tokens_per_sec."""
    tokens = fake_row.tokens_per_sec[name]
    return {"mode": name, "processes": nproc, "precision": bench.precision_of(overrides),
            "ms_per_step": 256e3 / tokens, "tokens_per_sec": tokens, "data_pct": 1.0,
            "first_window_extra_s": 0.1, "wall_s": 1.0, "final_loss": 4.0}  # fmt: skip


@pytest.fixture
def corpus(tmp_path):
    """A corpus of Shakespeare's vocabulary size (65 characters): bench.py reads only that."""
    path = tmp_path / "corpus.txt"
    path.write_text("".join(chr(32 + i) for i in range(65)) * 4)
    return path


def smoke_flops_per_token() -> int:
    return bench.flops_per_token(bench.recipe_shape(bench.SMOKE), 65)


def run_bench(monkeypatch, tmp_path, corpus, load, fp32_repeats, tokens) -> dict:
    """bench.py --smoke with the load, the fp32 peak's timings and each row's tokens/s given."""
    import torch

    monkeypatch.setattr(bench.measure, "load_average", lambda: load)
    monkeypatch.setattr(bench.measure, "cpu_cores", lambda: 2)
    peaks = {torch.float32: fp32_repeats, torch.bfloat16: [400.0] * 5}
    monkeypatch.setattr(bench.measure, "peak_repeats", lambda dtype, n: peaks[dtype])
    monkeypatch.setattr(bench, "run_mode", fake_row)
    fake_row.tokens_per_sec = tokens
    out = tmp_path / "bench.json"
    argv = ["bench.py", "--smoke", "--data", str(corpus), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv + ["--chart", str(tmp_path / "bench.png")])
    assert bench.main() == 0
    return json.loads(out.read_text())


def test_a_busy_machine_is_named_in_one_line_per_symptom(monkeypatch, tmp_path, corpus, capsys):
    # fp32 peak: one repeat at 209 GFLOP/s, the others at ~119 (the machine busy meanwhile); the
    # single process at 104.7% MFU of 209, DDP x2 at 4.6x its tokens/s
    single = round(1.047 * 209e9 / smoke_flops_per_token(), 1)
    report = run_bench(monkeypatch, tmp_path, corpus, load=5.0,
                       fp32_repeats=[209.0, 117.0, 119.0, 120.0, 118.0],
                       tokens={"single process": single, "DDP x2": 4.6 * single})  # fmt: skip
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("bench | warning: ")]
    assert warnings == [f"bench | warning: {w}" for w in report["warnings"]]
    load, peak, mfu_single, mfu_ddp, speedup = report["warnings"]
    assert load == f"load average 5.0 on 2 cores: timings will be noisy; {AGAIN}"
    assert out.index(load) < out.index("matmul peak")  # said before anything is measured
    assert peak == (
        "fp32 matmul peak unstable: best 209, median 119 GFLOP/s, 76% apart over 5 repeats "
        f"(more than 15%): the machine was busy; {AGAIN}"
    )
    assert mfu_single == (
        "MFU 104.7% above 100% (single process): the measured peak was low: the machine was "
        f"busy; {AGAIN}"
    )
    assert mfu_ddp.startswith("MFU 481.6% above 100% (DDP x2)")
    assert speedup.startswith("DDP x2 at 4.6x the tokens/s of single process on 2 processes")
    spread = {"best": 209.0, "median": 119.0, "worst": 117.0, "repeats": 5}
    assert report["peak_repeats"]["fp32"] == {**spread, "best_over_median_pct": 75.6}
    assert report["load_average"] == 5.0
    # the fields and lines that were there before stay
    assert report["peak_gflops"] == {"bf16": 400.0, "fp32": 209.0}
    assert {"hardware", "recipe", "flops_per_token", "steps", "rows"} <= set(report)
    assert "matmul peak bf16 400 / fp32 209 GFLOP/s" in out
    assert "| mode | ms/step | tokens/s | MFU | data % |" in out


def test_a_quiet_machine_gets_no_warning(monkeypatch, tmp_path, corpus, capsys):
    report = run_bench(monkeypatch, tmp_path, corpus, load=0.4,
                       fp32_repeats=[190.0, 185.0, 188.0, 180.0, 187.0],
                       tokens={"single process": 60e3, "DDP x2": 70e3})  # fmt: skip
    assert report["warnings"] == [] and "warning" not in capsys.readouterr().out
    assert report["peak_repeats"]["fp32"]["best_over_median_pct"] == 1.6


def test_a_given_peak_below_what_a_row_reached_is_named_as_given():
    row = {"mode": "single process", "mfu": 1.2}
    assert measure.mfu_warning(row, measured=False) == (
        "MFU 120.0% above 100% (single process): the --peak-gflops given is below what this row "
        "reached"
    )
    assert measure.mfu_warning({**row, "mfu": 0.99}, measured=True) is None


@pytest.mark.parametrize(("load", "warned"), [(None, False), (2.0, False), (2.1, True)])
def test_the_load_is_noisy_only_above_the_core_count(load, warned):
    assert (measure.load_warning(load, cores=2) is not None) == warned


def test_a_speedup_is_compared_with_the_fastest_single_process_row_of_its_precision():
    rows = [("single process", 1, "fp32", 100.0), ("single + torch.compile", 1, "fp32", 150.0),
            ("DDP x2", 2, "fp32", 250.0), ("single + bf16 autocast", 1, "bf16", 50.0),
            ("DDP x2 + bf16 autocast", 2, "bf16", 101.0)]  # fmt: skip
    keys = ("mode", "processes", "precision", "tokens_per_sec")
    lines = measure.speedup_warnings([dict(zip(keys, r)) for r in rows])
    assert lines == [
        "DDP x2 + bf16 autocast at 2.0x the tokens/s of single + bf16 autocast on 2 processes, "
        "more than 2x: the load changed between rows; rerun on an idle machine"
    ]  # DDP x2 fp32: 2.5x the plain single process, but 1.7x the compiled one


def test_the_peak_is_timed_in_repeats_after_a_warm_up():
    import torch

    repeats = measure.peak_repeats(torch.float32, 64, repeats=3)
    assert len(repeats) == 3 and all(r > 0 for r in repeats)
    peaks, spreads = measure.measure_peaks(["fp32"], 64)
    assert peaks["fp32"] == pytest.approx(spreads["fp32"]["best"], abs=0.1)
    assert measure.measure_peaks(["bf16", "fp32"], 64, given=300.0) == (
        {"bf16": 300.0, "fp32": 300.0},
        {},
    )
