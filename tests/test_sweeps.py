"""Sweeps through Hydra's launcher and sweeper plugins: joblib (jobs in worker processes at once),
submitit (each job a SLURM job on a real one-node cluster), Optuna (the job's final validation loss
is the objective). Every job gets its own directory, and a failed job makes the sweep exit non-zero
whatever process ran it."""

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from conftest import MAIN, start, sweep_jobs, sweep_overrides
from conftest import sweep as run_sweep

pytestmark = pytest.mark.slow


def sweep(args: list[str], tmp_path: Path, env: dict | None = None):
    """python main.py --multirun ARGS, with its jobs under tmp_path/sweep; returns the finished
    process."""
    return run_sweep(args, tmp_path / "sweep", env=env)


def jobs(tmp_path: Path) -> dict[Path, list[dict]]:
    return sweep_jobs(tmp_path / "sweep")


def final_val_loss(records: list[dict]) -> float:
    return [r["val_loss"] for r in records if "val_loss" in r][-1]


def tiny(shakespeare: Path, tmp_path: Path, **trainer) -> list[str]:
    return sweep_overrides(shakespeare, tmp_path, **{"max_steps": 10, **trainer})


def test_joblib_runs_jobs_at_once_in_worker_processes_and_a_refused_one_fails_the_sweep(
    shakespeare, tmp_path
):
    pytest.importorskip(
        "hydra_plugins.hydra_joblib_launcher", reason="pip install hydra-joblib-launcher"
    )
    # Three jobs on two workers: two train at once, the third (refused: a negative learning rate)
    # runs in a worker that already ran a job. The basic launcher's case is in test_config.py.
    result = sweep(
        [
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            *tiny(shakespeare, tmp_path),
            "optimizer_config.learning_rate=1e-3,8e-3,-1",
        ],
        tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "error: optimizer_config: need learning_rate > 0" in result.stderr
    assert "error: a sweep job failed with exit code 1" in result.stderr
    found = jobs(tmp_path)
    assert len(found) == 2 and all(final_val_loss(records) > 0 for records in found.values())
    # Each job ran in a worker process of its own (the lease names the process that held it).
    pids = {json.loads((job / "snapshots" / "lease.json").read_text())["pid"] for job in found}
    assert len(pids) == 2 and os.getpid() not in pids


def test_an_optuna_sweep_minimises_the_final_validation_loss(shakespeare, tmp_path):
    pytest.importorskip(
        "hydra_plugins.hydra_optuna_sweeper", reason="pip install hydra-optuna-sweeper"
    )
    result = sweep(
        [
            "hydra/sweeper=optuna",
            "hydra.sweeper.n_trials=3",
            "hydra.sweeper.sampler.seed=1",
            "optimizer_config.learning_rate=tag(log,interval(1e-4,1e-2))",
            *tiny(shakespeare, tmp_path),
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    best = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())[
        "best_value"
    ]
    losses = [final_val_loss(records) for records in jobs(tmp_path).values()]
    assert len(losses) == 3 and best == min(losses) and best < float("inf")


def test_submitit_runs_each_job_as_a_slurm_job_and_a_preempted_one_resumes(shakespeare, tmp_path):
    pytest.importorskip(
        "hydra_plugins.hydra_submitit_launcher", reason="pip install hydra-submitit-launcher"
    )
    from slurm_cluster import SlurmCluster
    from test_slurm import wait_until

    cluster = SlurmCluster()
    try:
        # timeout_min 60: submitit counts a signal in the last 10 minutes as a time-out, not
        # preemption.
        args = [
            "hydra/launcher=submitit_slurm",
            f"hydra.launcher.submitit_folder={tmp_path / 'submitit'}",
            "hydra.launcher.timeout_min=60",
            "hydra.launcher.mem_gb=null",
            "hydra.launcher.cpus_per_task=1",
            "optimizer_config.learning_rate=1e-3,8e-3",
            # 1500 steps (a few seconds): time for the signal to land while the job trains.
            *tiny(shakespeare, tmp_path, max_steps=1500, save_every=100000, eval_every=100000),
        ]
        proc = start(
            [sys.executable, MAIN, "--multirun", f"hydra.sweep.dir={tmp_path / 'sweep'}", *args],
            env={"SLURM_CONF": cluster.conf},
        )
        logs = lambda: "".join(p.read_text() for p in (tmp_path / "submitit").glob("*_log.out"))  # noqa: E731
        # The signal goes to a job that trains (its handler installed): one still starting would
        # be requeued by submitit's own handler and start over, never saying it was preempted.
        training = lambda: [  # noqa: E731
            p for p in (tmp_path / "submitit").glob("*_log.out") if "| loss " in p.read_text()
        ]
        wait_until(training, "a job to train", logs)
        victim = training()[0].name.removesuffix("_log.out").rsplit("_", 1)[0]  # <job>_<task>
        cluster.run("scancel", "--signal=USR2", victim)  # what SLURM sends before a time limit
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-3000:]
        found = jobs(tmp_path)
        assert len(found) == 2 and all(records[-1]["step"] == 1500 for records in found.values())
        assert "preempted | SIGUSR2 received | saving step " in logs(), logs()[-3000:]
        saved = int(logs().split("preempted | SIGUSR2 received | saving step ")[1].split(";")[0])
        assert f"resume | step {saved} |" in logs()  # the requeued job went on from its snapshot
    finally:
        cluster.stop()
