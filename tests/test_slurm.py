"""The SLURM script: valid bash, and it builds the torchrun command the README documents."""

import os
import subprocess

from conftest import REPO

SCRIPT = REPO / "slurm" / "train.sbatch"


def test_sbatch_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_the_command_built_for_a_slurm_allocation_is_the_one_in_the_readme():
    # SLURM's scontrol stands in as an exported bash function: it expands gpu[01-02].
    fake_scontrol = '() {  [ "$1 $2" = "show hostnames" ] && printf "gpu01\\ngpu02\\n"; }'
    env = {**os.environ, "BASH_FUNC_scontrol%%": fake_scontrol, "DRY_RUN": "1",
           "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
           "SLURM_GPUS_ON_NODE": "4"}
    out = subprocess.run(["bash", str(SCRIPT), "trainer_config.snapshot_path=/shared/runs/shakespeare"],
                         capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    readme = (REPO / "README.md").read_text()
    documented = readme.split("<!-- slurm-command -->")[1].split("```bash\n")[1].split("\n")[0]
    assert out.stdout.strip() == documented
