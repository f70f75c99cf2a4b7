"""parallel=horovod under horovodrun: the ranks horovodrun names, and a real run against DDP's.

The first tests are pure Python (how HOROVOD_* become torchrun's variables) and always run. The
slow one needs Horovod built for this torch (tools/build_horovod.sh, about 3-5 minutes on 2
cores: not in CI) and skips, naming the script, without it.
"""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import MAIN, REPO, run, tiny_overrides

from mingpt_ddp.config.deepspeed import DeepSpeedConfig
from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.parallel.horovod import HorovodStrategy
from mingpt_ddp.parallel.plan import Plan
from mingpt_ddp.parallel.strategy import StrategyArgs
from mingpt_ddp.runtime import distributed, horovodrun
from mingpt_ddp.runtime.distributed import ControlPlane, DistContext
from mingpt_ddp.snapshots.store import SnapshotStore

HOROVODRUN_ENV = {  # what horovodrun's gloo launcher sets for rank 1 of 2 on one host
    "HOROVOD_RANK": "1",
    "HOROVOD_SIZE": "2",
    "HOROVOD_LOCAL_RANK": "1",
    "HOROVOD_LOCAL_SIZE": "2",
    "HOROVOD_CROSS_RANK": "0",
    "HOROVOD_CROSS_SIZE": "1",
    "HOROVOD_HOSTNAME": "localhost",
}


def test_horovodruns_ranks_become_torchruns_variables():
    assert horovodrun.horovod_ranks(HOROVODRUN_ENV) == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    bare = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "4"}  # local ones missing: one per host
    assert horovodrun.horovod_ranks(bare)["LOCAL_WORLD_SIZE"] == "1"


def test_torchruns_variables_win_and_no_launcher_means_no_ranks():
    assert horovodrun.horovod_ranks({**HOROVODRUN_ENV, "RANK": "0", "WORLD_SIZE": "2"}) == {}
    assert horovodrun.horovod_ranks({"PATH": "/bin"}) == {}
    assert horovodrun.horovod_ranks({"HOROVOD_RANK": "0"}) == {}  # no size: not horovodrun's


def test_a_horovodrun_rank_is_a_launched_rank_and_only_rank_0_prints_before_set_up(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(distributed, "_IS_MAIN", None)  # not set up yet
    assert not distributed.launched_with_ranks() and distributed.is_main_process()
    for key, value in HOROVODRUN_ENV.items():
        monkeypatch.setenv(key, value)
    assert distributed.launched_with_ranks() and not distributed.is_main_process()


def test_without_horovod_the_error_names_the_build_script(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod.torch", None)  # import fails, as when not built
    with pytest.raises(ConfigError, match=r"parallel=horovod .*run tools/build_horovod\.sh"):
        horovodrun.import_horovod()
    assert (REPO / horovodrun.BUILD_SCRIPT).is_file()


def test_a_gpu_run_needs_a_horovod_built_with_nccl(monkeypatch):
    """A CPU-only Horovod (tools/build_horovod.sh's) would all-reduce CUDA gradients through host
    memory without waiting for their copy: refused in one line naming both ways out. A fake
    horovod.torch stands in for the build, so the refusal shows without a GPU or Horovod."""
    hvd = types.ModuleType("horovod.torch")
    hvd.init, hvd.size, hvd.nccl_built = (lambda: None), (lambda: 1), (lambda: 0)
    monkeypatch.setitem(sys.modules, "horovod", types.ModuleType("horovod"))
    monkeypatch.setitem(sys.modules, "horovod.torch", hvd)
    on = lambda device: StrategyArgs(  # noqa: E731
        Plan(parallel="horovod"),
        DistContext(0, 0, 1, torch.device(device)),
        OptimizerConfig(),
        2,
        1,
        ControlPlane(),
        DeepSpeedConfig(),
    )
    with pytest.raises(ConfigError) as refused:
        HorovodStrategy.check(on("cuda:0"))
    assert str(refused.value) == (
        "parallel=horovod on cuda:0 needs a Horovod built with NCCL, and this one is not "
        "(tools/build_horovod.sh builds for CPUs): build it with HOROVOD_GPU_OPERATIONS=NCCL, "
        "or set trainer_config.device=cpu"
    )
    HorovodStrategy.check(on("cpu"))  # the CPU build's own device
    hvd.nccl_built = lambda: 21805  # NCCL_VERSION_CODE of a build with NCCL
    HorovodStrategy.check(on("cuda:0"))


# ----------------------------------------------------------------------------- real runs
def horovod_missing() -> str:
    """Why the real runs cannot run here ("" when they can): decided at collection, so that a
    skipped test does not first pay for the DDP reference run it would compare with."""
    try:
        import horovod.torch  # noqa: F401 - only whether it loads against this torch
    except ImportError as e:
        return f"Horovod is not built for this torch ({e}): run {horovodrun.BUILD_SCRIPT}"
    launcher = shutil.which("horovodrun", path=str(Path(sys.executable).parent))
    return "" if launcher or shutil.which("horovodrun") else "horovodrun is not on PATH"


MISSING = horovod_missing()
needs_horovod = pytest.mark.skipif(bool(MISSING), reason=MISSING)


def horovodrun_command(args: list[str], script: Path = MAIN) -> list[str]:
    launcher = shutil.which("horovodrun", path=str(Path(sys.executable).parent))
    launcher = launcher or shutil.which("horovodrun")
    return [launcher, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, script, *args]


def losses(run_dir: Path, key: str) -> list:
    return [r.get(key) for r in MetricsLog.read(str(run_dir / "metrics.jsonl"))]


@pytest.mark.slow
@needs_horovod
def test_horovodrun_killed_and_resumed_trains_like_ddp(ddp_reference, shakespeare, tmp_path):
    """Two ranks under horovodrun, rank 1 SIGKILLed before step 16 (after the step-10 snapshot),
    the same command again: it resumes at step 10 and ends with DDP's losses (the same global
    batch, data order and dropout streams) to rel 1e-5; the gradients' average is all that
    differs: Horovod's ring over gloo instead of DDP's buckets."""
    straight, settings, extra = ddp_reference
    args = tiny_overrides(shakespeare, tmp_path, **settings) + extra
    args += ["trainer_config.parallel=horovod"]
    killed = run(
        horovodrun_command(args, REPO / "tests" / "faulty_main.py"),
        env={"FAULT": "kill:1:15"},
        timeout=240,
    )
    assert killed.returncode != 0 and "fault | rank 1 | kill before step 16" in killed.stdout
    assert "world size 2 | backend gloo" in killed.stdout
    assert killed.stdout.count("job | world size") == 1  # rank 0 speaks, rank 1 knows its rank
    resumed = run(horovodrun_command(args), timeout=240)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert "resume | step 10 | epoch 0 | 80 samples into the epoch" in resumed.stdout
    assert "| horovod | fp32 | world size 2 |" in resumed.stdout  # the start-up line's mode
    steps = [r["step"] for r in MetricsLog.read(str(tmp_path / "metrics.jsonl"))]
    assert steps == list(range(1, 31))  # every step once
    for key in ("train_loss", "val_loss"):
        a, b = losses(straight.run_dir, key), losses(tmp_path, key)
        assert [x is None for x in a] == [x is None for x in b]
        assert [y for y in b if y is not None] == pytest.approx(
            [x for x in a if x is not None], rel=1e-5
        ), key
    assert SnapshotStore(str(tmp_path / "snapshots")).load_latest()["step"] == 30
