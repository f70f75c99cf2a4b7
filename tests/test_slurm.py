"""The SLURM script: valid bash, it builds the torchrun command the README documents, and under a
real one-node SLURM cluster a preempted job is requeued and resumes from the snapshot taken on the
signal."""

import os
import subprocess
import time

import pytest
from conftest import REPO, free_port, tiny_overrides

SCRIPT = REPO / "slurm" / "train.sbatch"


def test_sbatch_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_the_command_built_for_a_slurm_allocation_is_the_one_in_the_readme():
    # SLURM's scontrol stands in as an exported bash function: it expands gpu[01-02].
    fake_scontrol = '() {  [ "$1 $2" = "show hostnames" ] && printf "gpu01\\ngpu02\\n"; }'
    env = {
        **os.environ,
        "BASH_FUNC_scontrol%%": fake_scontrol,
        "DRY_RUN": "1",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_GPUS_ON_NODE": "4",
    }
    out = subprocess.run(
        ["bash", str(SCRIPT), "trainer_config.snapshot_path=/shared/runs/shakespeare"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    readme = (REPO / "README.md").read_text()
    documented = readme.split("<!-- slurm-command -->")[1].split("```bash\n")[1].split("\n")[0]
    assert out.stdout.strip() == documented


def test_the_script_keeps_its_promises_on_gpu_nodes():
    """What a 2 x 8 GPU job needs from it: the GPUs per node overridable (sbatch --gpus-per-node),
    the workers given as long to save as the signal promises, srun's tasks their cores, and gloo
    an interface that reaches the other nodes."""
    text = SCRIPT.read_text()
    lead = int(text.split("--signal=TERM@")[1].split()[0])
    shutdown = int(text.split('--shutdown-timeout="${SHUTDOWN_TIMEOUT:-')[1].split("}")[0])
    assert shutdown < lead  # torchrun's default SIGKILLs 30 s after forwarding SIGTERM
    assert "export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK" in text  # Slurm >= 22.05
    assert "export GLOO_SOCKET_IFNAME=" in text
    assert "nproc_per_node=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE" in text
    assert "sbatch --nodes=2 --gpus-per-node=8 slurm/train.sbatch" in text


def wait_until(condition, what: str, detail=lambda: "", timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{detail()}"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_preempted_job_is_requeued_and_resumes_from_the_snapshot_taken_on_the_signal(
    shakespeare, tmp_path
):
    from slurm_cluster import SlurmCluster

    cluster = SlurmCluster()
    try:
        log = tmp_path / "slurm.out"
        text = lambda: log.read_text() if log.exists() else ""  # noqa: E731
        # The script's #SBATCH lines ask for 2 nodes with 4 GPUs; the command line overrides them
        # for this one CPU node. --open-mode=append: the requeued run adds to the same log.
        job = cluster.run(
            "sbatch",
            "--parsable",
            "--nodes=1",
            f"--cpus-per-task={os.cpu_count()}",
            "--gpus-per-node=0",
            "--open-mode=append",
            f"--output={log}",
            str(SCRIPT),
            *tiny_overrides(
                shakespeare,
                tmp_path,
                max_steps=100000,
                save_every=1000,
                log_every=20,
                eval_every=100000,
            ),
            env={"NPROC_PER_NODE": "2", "RDZV_PORT": str(free_port())},
            cwd=REPO,
        ).strip()
        wait_until(
            lambda: "| loss " in text(), "the job to train"
        )  # a step line: the loop is running
        cluster.run(
            "scancel", "--signal=TERM", job
        )  # what SLURM sends on preemption or before the time limit
        wait_until(
            lambda: cluster.job_state(job) not in ("PENDING", "RUNNING", "COMPLETING"),
            "the job to end",
        )
        assert "preempted | SIGTERM received | saving step " in text(), text()[-3000:]
        saved = int(text().split("preempted | SIGTERM received | saving step ")[1].split(";")[0])
        assert f"snapshot | step {saved} |" in text()
        cluster.run(
            "scontrol", "requeue", job
        )  # what SLURM does itself after a preemption (--requeue)
        wait_until(
            lambda: f"resume | step {saved} |" in text(),
            "the requeued job to resume",
            lambda: cluster.run("scontrol", "show", "job", job) + text()[-3000:],
        )
        assert (
            cluster.run("scontrol", "-o", "show", "job", job).split("Restarts=")[1].split()[0]
            == "1"
        )
    finally:
        cluster.stop()
