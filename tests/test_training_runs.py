"""Real training runs of main.py: one process and torchrun with 2 ranks on CPU (gloo).

These start real processes, so they are marked slow; `pytest -m "not slow"` skips them. Process
start-up (torch, Hydra) costs more than these tiny runs' steps, so tests share runs: single_run
below, and conftest's ddp_reference (two ranks, 30 steps), which test_resume.py compares with too.
"""

import shutil
import sys

import pytest
import torch
from conftest import REPO, kill_tree, run, run_main, start_main, tiny_overrides, wait_for_line

from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.snapshots.store import SnapshotStore

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def single_run(shakespeare, tmp_path_factory):
    """One process, 60 steps (evaluated and saved at 30 and 60, logged every 10), with TensorBoard
    on and one CPU thread: the run several tests below inspect, each for what it checks."""
    run_dir = tmp_path_factory.mktemp("single")
    result = run_main(
        tiny_overrides(
            shakespeare,
            run_dir,
            max_steps=60,
            eval_every=30,
            save_every=30,
            log_every=10,
            tensorboard="true",
            cpu_threads=1,
        )
        + ["optimizer_config.learning_rate=3e-3", "optimizer_config.warmup_steps=5"]
    )
    assert result.returncode == 0, result.stderr
    return run_dir, result.stdout


def test_single_process_run_learns_and_leaves_a_snapshot_sample_py_can_use(single_run):
    run_dir, stdout = single_run
    assert "starting fresh at step 0" in stdout
    records = MetricsLog.read(str(run_dir / "metrics.jsonl"))
    assert {"step", "epoch", "train_loss", "lr", "tokens_per_sec"} <= set(records[0])
    evals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(evals) == 2 and evals[-1] < 3.3 < 4.17  # well below uniform guessing, ln(65) = 4.17
    # sample.py needs only the snapshot: no data file, no config.
    out = run(
        [
            sys.executable,
            REPO / "sample.py",
            "--snapshot",
            run_dir / "snapshots",
            "--prompt",
            "ROMEO:",
            "--chars",
            "40",
        ],
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ROMEO:") and len(out.stdout.rstrip("\n")) == 46


def test_a_snapshot_of_another_model_shape_is_a_clear_error(single_run, shakespeare, tmp_path):
    shutil.copytree(single_run[0] / "snapshots", tmp_path / "snapshots")  # a snapshot of n_embd 32
    result = run_main(
        tiny_overrides(shakespeare, tmp_path, max_steps=70) + ["gpt_config.n_embd=48"]
    )
    assert result.returncode == 1
    assert "another model shape: n_embd (snapshot 32, config 48)" in result.stderr
    assert "Traceback" not in result.stderr


def test_metrics_record_data_time_and_each_snapshot_stall(single_run):
    run_dir, stdout = single_run
    assert "| 1 CPU threads per rank |" in stdout  # trainer_config.cpu_threads=1
    path = str(run_dir / "metrics.jsonl")
    assert all(0 < r["data_ms"] < r["ms_per_step"] for r in MetricsLog.read(path))
    saves = MetricsLog.read(path, event="snapshot")
    assert [s["step"] for s in saves] == [30, 60] and all(s["stall_ms"] > 0 for s in saves)


def test_tensorboard_switch_writes_event_files_with_the_logged_scalars(single_run):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    events = event_accumulator.EventAccumulator(
        str(single_run[0] / "tensorboard")
    )  # under the run's run_dir
    events.Reload()
    assert {"train_loss", "val_loss", "tokens_per_sec", "snapshot/stall_ms"} <= set(
        events.Tags()["scalars"]
    )
    assert [e.step for e in events.Scalars("train_loss")] == [
        10,
        20,
        30,
        40,
        50,
        60,
    ]  # every log_every


def test_killed_torchrun_job_resumes_at_the_saved_step_and_data_position_and_matches_an_uninterrupted_run(  # noqa: E501
    ddp_reference, shakespeare, tmp_path
):
    """Two ranks: the uninterrupted run's snapshot holds the step, the data position and both ranks'
    RNG states; a job SIGKILLed after its step-10 snapshot, run again, resumes at a saved step and
    data position and ends with the very losses and weights of the uninterrupted run."""
    straight, settings, extra = ddp_reference
    assert "world size 2 | backend gloo" in straight.stdout
    snap = SnapshotStore(str(straight.run_dir / "snapshots")).load_latest()
    assert (
        snap["step"] == 30
        and snap["data_cursor"]["samples_consumed"] == 30 * 2 * 4
        and len(snap["rng"]) == 2
    )

    args = tiny_overrides(shakespeare, tmp_path, **settings) + extra
    job = start_main(args, nproc=2)
    wait_for_line(job, "snapshot | step 10")
    kill_tree(job)  # SIGKILL launcher and workers, wherever they are in step 10..30
    resumed = run_main(args, nproc=2)  # the same command again
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "starting fresh" not in resumed.stdout
    step = int(resumed.stdout.split("resume | step ")[1].split(" |")[0])
    assert (
        step in (10, 20)
        and f"resume | step {step} | epoch 0 | {step * 2 * 4} samples into the epoch"
        in resumed.stdout
    )

    a = MetricsLog.read(str(straight.run_dir / "metrics.jsonl"))
    b = MetricsLog.read(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in b] == list(range(1, 31))  # every step once, none lost or duplicated
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    assert [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]
    final_a = SnapshotStore(str(straight.run_dir / "snapshots")).load_latest()["model"]
    final_b = SnapshotStore(str(tmp_path / "snapshots")).load_latest()
    assert final_b["data_cursor"]["samples_consumed"] == 30 * 2 * 4
    assert all(torch.equal(final_a[k], final_b["model"][k]) for k in final_a)


def test_target_val_loss_stops_at_the_first_evaluation_that_reaches_it_after_a_snapshot(
    shakespeare, tmp_path
):
    # Learning rate high enough that a tiny model passes 3.0 within a few evaluations.
    args = tiny_overrides(
        shakespeare,
        tmp_path,
        max_steps=400,
        eval_every=10,
        save_every=1000,
        log_every=10,
        target_val_loss=3.0,
    ) + ["optimizer_config.learning_rate=1e-2", "optimizer_config.warmup_steps=5"]
    result = run_main(args)
    assert result.returncode == 0, result.stderr
    evals = [r for r in MetricsLog.read(str(tmp_path / "metrics.jsonl")) if "val_loss" in r]
    assert evals[-1]["val_loss"] <= 3.0 and all(r["val_loss"] > 3.0 for r in evals[:-1])
    stop = evals[-1]["step"]
    assert stop < 400 and f"at step {stop} | stopping" in result.stdout
    assert (
        SnapshotStore(str(tmp_path / "snapshots")).load_latest()["step"] == stop
    )  # the work is saved
    again = run_main(args)  # the same command: the job is done, it must not train on
    assert again.returncode == 0, again.stderr
    assert (
        "already meets trainer_config.target_val_loss" in again.stdout
        and "step " not in again.stdout.split("train |")[-1]
    )
    assert SnapshotStore(str(tmp_path / "snapshots")).load_latest()["step"] == stop


def test_dataparallel_style_reduction_through_rank0_trains_like_the_ring_all_reduce(
    ddp_reference, shakespeare, tmp_path
):
    straight, settings, extra = (
        ddp_reference  # the ring all-reduce (DDP's default), the same settings
    )
    result = run_main(
        tiny_overrides(shakespeare, tmp_path, **settings, grad_reduce="via_rank0") + extra, nproc=2
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ddp (gradients via rank 0)" in result.stdout
    losses = {
        name: [(r["train_loss"], r["grad_norm"]) for r in MetricsLog.read(str(d / "metrics.jsonl"))]
        for name, d in (("all_reduce", straight.run_dir), ("via_rank0", tmp_path))
    }
    assert len(losses["via_rank0"]) == len(losses["all_reduce"]) == settings["max_steps"]
    # The same mean gradient by another route: the same losses and gradient norms (a sum instead of
    # a mean would double the norm; clipping and Adam would hide it from the losses alone).
    for (loss_a, norm_a), (loss_b, norm_b) in zip(losses["all_reduce"], losses["via_rank0"]):
        assert loss_a == pytest.approx(loss_b, abs=1e-4) and norm_a == pytest.approx(
            norm_b, rel=1e-3
        )
    assert losses["via_rank0"][-1][0] < losses["via_rank0"][0][0]


def test_a_validation_region_above_2_to_the_24_windows_evaluates(shakespeare, tmp_path):
    # A float32 linspace of evaluation starts rounded the last one past the end above 2^24
    # windows (IndexError at the first evaluation of a 200 MB corpus). Here: 17.0 M windows,
    # an odd last start that float32 cannot hold, in a corpus prepared in a fraction of a second.
    n, text = 17_900_000, shakespeare.read_bytes()
    corpus = tmp_path / "long.txt"
    corpus.write_bytes((text * (n // len(text) + 1))[:n])
    n_train = n * 5 // 100
    val_windows = n - n_train - 32  # TINY's block_size
    assert (
        val_windows > 2**24
        and float(torch.tensor(val_windows - 1, dtype=torch.float32)) != val_windows - 1
    )
    result = run_main(
        tiny_overrides(corpus, tmp_path, max_steps=1, eval_every=1)
        + ["data_config.train_split=0.05"]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{n_train - 32:,} train / {val_windows:,} val windows" in result.stdout
    assert "eval | step 1 | val loss" in result.stdout


def test_a_snapshot_from_before_the_data_cursor_resumes_with_a_warning(
    single_run, shakespeare, tmp_path
):
    shutil.copytree(single_run[0] / "snapshots", tmp_path / "snapshots")  # step 60, one process
    store = SnapshotStore(str(tmp_path / "snapshots"))
    state = store.load_latest()
    cursor = state.pop("data_cursor")  # the layout format_version 2 wrote
    state.update(
        format_version=2, epoch=cursor["epoch"], samples_consumed=cursor["samples_consumed"]
    )
    store.save(state, 60)
    result = run_main(tiny_overrides(shakespeare, tmp_path, max_steps=62, save_every=62))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resume | step 60 | epoch 0 | 240 samples into the epoch" in result.stdout
    assert "walked epoch 0 in another order" in result.stderr
    assert store.load_latest()["data_cursor"] == {
        "epoch": 0,
        "samples_consumed": 248,
        "order": "feistel-v1",
    }
