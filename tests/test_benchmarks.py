"""Benchmark scripts run end to end in their smoke mode and produce their tables."""

import json
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


def run_smoke(script: str, shakespeare, out) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / script),
            "--smoke",
            "--data",
            str(shakespeare),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    assert (
        rows["fsdp"]["optimizer_MB"] < rows["ddp"]["optimizer_MB"]
    )  # sharded: each rank holds a part
    assert all(r["tokens_per_sec"] > 0 and r["save_s"] > 0 for r in rows.values())


def test_bench_smoke_mode_prints_the_mode_table_and_writes_json_and_chart(shakespeare, tmp_path):
    result = run_smoke("bench.py", shakespeare, tmp_path / "bench.json")
    assert "| mode | ms/step | tokens/s | MFU | data % |" in result.stdout
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [r["mode"] for r in report["rows"]] == ["single process", "DDP x2"]
    for row in report["rows"]:
        assert row["ms_per_step"] > 0 and 0 < row["mfu"] < 1 and 0 <= row["data_pct"] < 100
        assert row["snapshot_blocked_ms"] > 0  # the mid-run asynchronous save was timed
    # the peak's repeats and what they say about the machine (test_bench_warnings.py: the warnings)
    assert set(report["peak_repeats"]) == set(report["peak_gflops"]) == {"fp32", "bf16"}
    assert "bench | matmul peak repeats (best / median / worst GFLOP/s): bf16 " in result.stdout
    assert isinstance(report["warnings"], list) and "load_average" in report
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_time_to_quality_reports_steps_tokens_and_wall_time_to_the_target(shakespeare, tmp_path):
    out = tmp_path / "ttq.json"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "time_to_quality.py"),
            "--recipe",
            "smoke",
            "--target",
            "3.3",
            "--data",
            str(shakespeare),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["reached"] and report["val_loss"] <= 3.3 and report["step"] % 10 == 0
    assert report["tokens"] == report["step"] * 8 * 32 and report["wall_s"] > 0
    assert "reached 3.3" in result.stdout


def test_data_scale_smoke_mode_prepares_trains_and_measures_memory_per_rank(shakespeare, tmp_path):
    result = run_smoke("data_scale.py", shakespeare, tmp_path / "scale.json")
    assert "| corpus | vocab | dtype | prepare_s |" in result.stdout
    report = json.loads((tmp_path / "scale.json").read_text())
    assert [r["corpus"] for r in report["rows"]] == ["ascii-1MB", "cjk-1MB"]
    for row in report["rows"]:
        assert (
            row["ranks_seen"] == 2 and row["peak_rss_mb_per_rank"] > row["peak_pss_mb_per_rank"] > 0
        )
        assert (
            row["prepare_mb_per_s"] > 0
            and row["steady_ms_per_step"] > 0
            and row["launch_to_first_step_s"] > 0
        )
    assert report["rows"][1]["dtype"] == "int16" and report["rows"][1]["vocab"] > 256
    assert report["readers"]["pread_rss_growth_mb"] < report["readers"]["mmap_rss_growth_mb"]


def test_compare_smoke_mode_times_rows_end_to_end_and_says_why_a_row_cannot_run(
    shakespeare, tmp_path
):
    out = tmp_path / "compare.json"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "compare.py"),
            "--smoke",
            "--data",
            str(shakespeare),
            "--out",
            str(out),
            "--rows",
            "one process,spawn_launch,Horovod,no DDP in it",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "| the notes' row (their GPU minutes) | here | ranks | launch to exit, s |" in result.stdout
    )
    rows = {r["here"]: r for r in json.loads(out.read_text())["rows"]}
    assert (
        rows["one process"]["ranks"] == 1 and rows["DDP, tutorials/spawn_launch.py"]["ranks"] == 2
    )
    for timed in ("one process", "DDP, tutorials/spawn_launch.py"):
        assert (
            rows[timed]["wall_s"] > 0
            and rows[timed]["peak_host_mib"] > 0
            and rows[timed]["tokens"] > 0
        )
    horovod = rows["Horovod"]  # timed where tools/build_horovod.sh built Horovod, else why not
    assert "tools/build_horovod.sh" in horovod.get("skipped", "") or horovod["wall_s"] > 0
    # The notes' DDP+MP row: 2 stages, its batch per replica, so the same tokens as the others.
    pipeline = rows["pipeline, 2 stages, 1F1B (1 replica: no DDP in it)"]
    assert pipeline["tokens"] == rows["one process"]["tokens"]


# A stand-in for a nanoGPT checkout (CI has no internet to clone one): its model.py offers what
# step_time.py uses of nanoGPT's (GPT, GPTConfig, configure_optimizers), built on this project's
# GPT.
STAND_IN_NANOGPT = """
import torch
from dataclasses import dataclass
from model import GPT as _GPT, GPTConfig as _Config

@dataclass
class GPTConfig:
    block_size: int; vocab_size: int; n_layer: int; n_head: int; n_embd: int
    dropout: float; bias: bool

class GPT(_GPT):
    def __init__(self, c):
        super().__init__(_Config(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, bias=c.bias,
                                 vocab_size=c.vocab_size, block_size=c.block_size))

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        return torch.optim.AdamW(self.parameters(), lr=learning_rate, betas=betas,
                                 weight_decay=weight_decay)
"""


def test_step_time_times_both_models_in_turns_and_reports_ratios(tmp_path):
    (tmp_path / "nanoGPT").mkdir()
    (tmp_path / "nanoGPT" / "model.py").write_text(STAND_IN_NANOGPT)
    out = tmp_path / "step.json"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "step_time.py"),
            "--nanogpt",
            str(tmp_path / "nanoGPT"),
            "--eager-only",
            "--rounds",
            "2",
            "--steps",
            "3",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["ms"]) == {"nanoGPT", "ours, eager"}
    assert all(len(ms) == 2 and min(ms) > 0 for ms in report["ms"].values())
    assert report["ratio"]["nanoGPT"] == 1.0 and report["ratio"]["ours, eager"] > 0
    assert "x nanoGPT" in result.stdout and "this project:" in result.stdout


def test_the_readmes_comparison_tables_are_compare_json():
    """The notes' table in measured.md is benchmarks/results/compare.json, as compare.py prints it
    (the Chinese page: the same numbers, row by row); the READMEs quote it in words."""

    sys.path.insert(0, str(REPO / "benchmarks"))
    import compare

    rows = json.loads((REPO / "benchmarks/results/compare.json").read_text())["rows"]
    table = compare.markdown_table(rows)
    assert table in (REPO / "docs/measured.md").read_text()
    numbers = [table_numbers(line) for line in table.splitlines()[2:]]
    for page in ("docs/zh-CN/measured.md",):
        text = (REPO / page).read_text()
        start = text.index("| 笔记里的行")
        zh = text[start : text.index("\n\n", start)].splitlines()[2:]
        assert [table_numbers(line) for line in zh] == numbers, page


def table_numbers(line: str) -> list[str]:
    return [cell.strip() for cell in line.split("|")[3:8]]
