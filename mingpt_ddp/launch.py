"""Hydra around main.py's task function: a sweep job's own directory, the exception a failed
sweep job raises, Hydra's errors in one line, and the shutdown of joblib's idle workers.

main.py (the story) calls these; they know Hydra, not the training.
"""

from __future__ import annotations

import atexit
import os
import re
import sys

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mingpt_ddp.config import schema as config
from mingpt_ddp.runtime.distributed import launched_with_ranks


def give_sweep_job_its_own_directory(cfg: DictConfig) -> str:
    """In a --multirun sweep, put this job's files under its own directory (Hydra's job directory:
    runs/sweep/<its overrides>), so jobs never share snapshots, metrics or TensorBoard events and a
    rerun of the sweep resumes each from its own. Returns a problem, or "" if none."""
    if launched_with_ranks():
        return (
            "--multirun under torchrun would run every rank's sweep in lockstep through one "
            "process group; run sweeps as python main.py --multirun ... (one process per job), "
            "or one torchrun per setting"
        )
    job_dir = HydraConfig.get().runtime.output_dir
    tcfg = cfg.trainer_config
    for key in ("snapshot_path", "metrics_path"):
        if tcfg[key] and tcfg[key] != "none" and job_dir not in os.path.abspath(tcfg[key]):
            return (
                f"trainer_config.{key}={tcfg[key]} would be shared by every job of this sweep; "
                "leave it empty (each job's goes under its own trainer_config.run_dir) or build "
                "it from the run_dir"
            )
    tcfg.run_dir = job_dir
    return ""


class JobFailed(Exception):
    """A sweep job that did not finish. Raised from the task function, so that every launcher
    (in this process, joblib's worker processes, submitit's SLURM jobs) records the job as failed
    and the sweep exits non-zero; a module-level record would stay in the process that ran it."""

    def __init__(self, code: int, job_dir: str):
        super().__init__(code, job_dir)
        self.code, self.job_dir = code, job_dir

    def __str__(self) -> str:
        return f"a sweep job failed with exit code {self.code} (its directory: {self.job_dir})"


def hydra_error_line(e: Exception) -> str:
    """One line for a config Hydra could not compose: the unknown key as to_job says it, else
    Hydra's own words (the key and its problem)."""
    plugin = re.search(r"Could not find '(hydra/(?:launcher|sweeper))/([\w-]+)'", str(e))
    if plugin:  # Hydra's launchers and sweepers are plugins, in the [sweeps] extra
        return (
            f"error: {plugin[1]}={plugin[2]} is not installed; Hydra's joblib and submitit "
            "launchers and Optuna sweeper come with: pip install -e '.[sweeps]'"
        )
    for cause in _causes(
        e
    ):  # OmegaConf's "Key 'max_step' not in 'TrainerConfig'", with its full_key
        if getattr(cause, "full_key", "") and re.match(r"Key '[^']*' not in ", str(cause)):
            return f"error: {config.unknown_key_error(cause.full_key)}"
    return "\n".join(str(c).strip() for c in _causes(e)[:2])  # Hydra's words and OmegaConf's


def _causes(e: BaseException | None) -> list[BaseException]:
    """e and what led to it (Hydra re-raises OmegaConf's errors, sometimes only as the context)."""
    chain = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def stop_sweep_workers() -> None:
    """Shut down the worker processes of Hydra's joblib launcher, if it ran. joblib keeps them for
    reuse for 5 minutes; left running, they hold this process's stdout open that long, and
    whatever reads it (a pipe, a test) waits for them."""
    loky = sys.modules.get("joblib.externals.loky.reusable_executor")
    executor = getattr(
        loky, "_executor", None
    )  # the one executor joblib reuses (loky's module global)
    if executor is not None:
        executor.shutdown(wait=True)
        # joblib's exit functions remove its shared-memory folder (exit_process skips them)
        atexit._run_exitfuncs()
