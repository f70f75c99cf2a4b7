"""The launchers users have, each starting main.py with two CPU ranks: accelerate and deepspeed.

main.py reads only the standard variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT and the
ranks per node), so any launcher that sets them works; these tests prove it for the two the notes
time besides torchrun and mp.spawn.
"""

import os
import sys

import pytest
from conftest import MAIN, free_port, run, run_main, tiny_overrides

from mingpt_ddp.metrics import MetricsLog

pytestmark = pytest.mark.slow


def launch(cmd: list[str], env: dict | None = None) -> str:
    result = run(cmd, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def share_of_cores(ranks_per_node: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // ranks_per_node)


def test_accelerate_launch_starts_two_cpu_ranks(shakespeare, tmp_path):
    pytest.importorskip("accelerate")
    # --cpu alone runs one plain process (accelerate's simple launcher); --multi_gpu is the mode
    # that starts several ranks (it runs torchrun), and trainer_config.device=cpu keeps them on the
    # CPU.
    out = launch(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            MAIN,
            *tiny_overrides(shakespeare, tmp_path, max_steps=10, save_every=10),
        ]
    )
    assert (
        f"job | world size 2 | backend gloo | device cpu | {share_of_cores(2)} CPU threads per rank"
        in out
    )
    assert (
        "done | step 10" in out and out.count("done | step") == 1
    )  # one rank 0, not two solo runs


def test_the_deepspeed_launcher_starts_two_cpu_ranks(shakespeare, tmp_path):
    pytest.importorskip("deepspeed")
    # --no_local_rank: the launcher would otherwise add --local_rank=N to the command line, which is
    # not a Hydra override; main.py reads LOCAL_RANK from the environment, as under torchrun.
    out = launch(
        [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_accelerators",
            "2",
            "--no_local_rank",
            "--master_port",
            str(free_port()),
            MAIN,
            *tiny_overrides(shakespeare, tmp_path, max_steps=10, save_every=10),
        ],
        env={"DS_ACCELERATOR": "cpu"},
    )
    # The deepspeed launcher names the ranks per node LOCAL_SIZE: each rank takes its share of the
    # cores.
    assert (
        f"job | world size 2 | backend gloo | device cpu | {share_of_cores(2)} CPU threads per rank"
        in out
    )
    assert "done | step 10" in out and out.count("done | step") == 1


def test_the_suites_own_launcher_runs_a_job_as_python_and_torchrun_would(shakespeare, tmp_path):
    """run_main starts jobs that are not about a launcher from the fork server (a process that
    imported torch once) and their ranks with ranks.py (without torchrun's agent): a job's exit
    status and output are a fresh interpreter's, and a 2-rank job trains what torchrun's does."""
    bad = tiny_overrides(shakespeare, tmp_path / "bad") + ["trainer_config.bogus=1"]
    fresh, forked = run([sys.executable, MAIN, *bad]), run_main(bad)
    assert forked.returncode == fresh.returncode == 1
    assert (forked.stdout, forked.stderr) == (fresh.stdout, fresh.stderr)
    losses = {}
    for agent in (True, False):
        run_dir = tmp_path / f"agent-{agent}"
        args = tiny_overrides(shakespeare, run_dir, max_steps=6, log_every=1, save_every=3)
        assert run_main(args, nproc=2, agent=agent).returncode == 0
        records = MetricsLog.read(str(run_dir / "metrics.jsonl"))
        losses[agent] = [r["train_loss"] for r in records if "train_loss" in r]
    assert len(losses[True]) == 6 and losses[False] == losses[True]
