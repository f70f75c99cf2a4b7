"""DeepSpeed ZeRO as a parallel mode (mingpt_ddp/parallel/deepspeed.py): it trains like DDP, splits
the optimizer state as ZeRO promises, and its snapshots keep this project's promises: exact
resume, one format that any layout resumes (and that ZeRO resumes from any layout), and DeepSpeed's
own files of older snapshots checked before they are read and refused where they cannot resume.

Real torchrun jobs at world size 2 on CPU (DS_ACCELERATOR=cpu, gloo), tiny models, seconds each; one
run per mode (ddp_run, zero_run) serves every test that only reads it or starts from a copy of its
snapshots.
"""

import hashlib
import json
import os
import pickle
import shutil
import sys

import pytest
import torch
from conftest import REPO, kill_tree, run, run_main, start_main, tiny_overrides, wait_for_line

from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.parallel.state import pick
from mingpt_ddp.snapshots.manifest import MANIFEST
from mingpt_ddp.snapshots.store import SnapshotStore

pytest.importorskip("deepspeed", reason='pip install -e ".[deepspeed]"')
pytestmark = pytest.mark.slow

STEPS = dict(max_steps=30, save_every=10, log_every=1, eval_every=10)
OLD_ZERO2 = REPO / "tests" / "fixtures" / "old_snapshots" / "deepspeed"  # DeepSpeed's own files


def train(shakespeare, run_dir, parallel, nproc=2, **settings):
    result = run_main(
        tiny_overrides(shakespeare, run_dir, **{**STEPS, **settings}) + [f"parallel={parallel}"],
        nproc=nproc,
    )
    return result


def losses(run_dir):
    return [
        r["train_loss"]
        for r in MetricsLog.read(str(run_dir / "metrics.jsonl"))
        if "train_loss" in r
    ]


def optimizer_mb(stdout: str) -> float:
    return float(stdout.split("memory | optimizer state ")[1].split(" MB")[0])


def trained(shakespeare, tmp_path_factory, parallel):
    run_dir = tmp_path_factory.mktemp(parallel)
    result = train(shakespeare, run_dir, parallel)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result.stdout


# One run per mode at world size 2 (STEPS: 30 steps, saved every 10), shared by the tests below:
# DeepSpeed's start-up costs more than these steps, and each test only reads the run or copies its
# snapshots.
@pytest.fixture(scope="module")
def ddp_run(shakespeare, tmp_path_factory):
    return trained(shakespeare, tmp_path_factory, "ddp")


@pytest.fixture(scope="module")
def zero_run(shakespeare, tmp_path_factory):
    """zero_run(stage): (run_dir, stdout) of the ZeRO-`stage` run, trained on first use."""
    runs = {}

    def get(stage: int):
        if stage not in runs:
            runs[stage] = trained(shakespeare, tmp_path_factory, f"zero{stage}")
        return runs[stage]

    return get


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_train_like_ddp_and_split_the_optimizer_state(stage, ddp_run, zero_run):
    ddp_dir, ddp_out = ddp_run
    run_dir, stdout = zero_run(stage)
    assert f"deepspeed ZeRO-{stage} | fp32 | world size 2" in stdout
    # The same global batch, the same data order, the same AdamW: the same losses, to rounding.
    assert losses(run_dir) == pytest.approx(losses(ddp_dir), rel=1e-4)
    # AdamW's moments: DDP keeps all of them on every rank, ZeRO (any stage) half of them on each
    # of 2.
    assert optimizer_mb(stdout) == pytest.approx(optimizer_mb(ddp_out) / 2, rel=0.02)
    # One format: a ZeRO run's snapshot holds what a DDP run's does, by the same names.
    zero, ddp = (SnapshotStore(str(d / "snapshots")).load_latest() for d in (run_dir, ddp_dir))
    assert zero["model"].keys() == ddp["model"].keys()
    assert all(torch.allclose(zero["model"][k], ddp["model"][k], atol=1e-4) for k in ddp["model"])
    moments = ddp["optimizer"]["state"]
    assert {k for k in moments if k != "lm_head.weight"} <= zero["optimizer"]["state"].keys()
    for name, state in moments.items():
        assert torch.allclose(
            pick(zero["optimizer"]["state"], name)["exp_avg"], state["exp_avg"], atol=1e-5
        )


def test_cpu_offload_of_optimizer_state_and_parameters_trains_the_same_losses(
    ddp_run, shakespeare, tmp_path
):
    # Offloading moves where the state lives (for GPU jobs: into CPU memory), not what is computed.
    result = run_main(
        tiny_overrides(shakespeare, tmp_path, **{**STEPS, "max_steps": 10})
        + [
            "parallel=zero3",
            "deepspeed_config.offload_optimizer=true",
            "deepspeed_config.offload_params=true",
        ],
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "deepspeed ZeRO-3 + optimizer offload + parameter offload" in result.stdout
    # Within the 100 warm-up steps the learning rate does not depend on max_steps: 10 steps of 30
    # compare.
    assert losses(tmp_path) == pytest.approx(losses(ddp_run[0])[:10], rel=1e-4)


def test_a_killed_zero3_job_resumes_exactly(zero_run, shakespeare, tmp_path):
    straight, _ = zero_run(3)  # the same job, never interrupted
    killed = tmp_path / "killed"
    args = tiny_overrides(shakespeare, killed, **STEPS) + ["parallel=zero3"]
    job = start_main(args, nproc=2)
    wait_for_line(job, "snapshot | step 10")
    kill_tree(job)  # a power cut, somewhere after the step-10 snapshot
    resumed = train(shakespeare, killed, "zero3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume | step 10 |" in resumed.stdout or "resume | step 20 |" in resumed.stdout
    records = MetricsLog.read(str(killed / "metrics.jsonl"))
    assert [r["step"] for r in records if "train_loss" in r] == list(
        range(1, 31)
    )  # every step once
    assert losses(killed) == losses(straight)
    wa, wb = (
        SnapshotStore(str(d / "snapshots")).load_latest()["model"] for d in (straight, killed)
    )
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_any_layout_resumes_a_zero_snapshot_and_zero_resumes_any(
    ddp_run, zero_run, shakespeare, tmp_path
):
    """Step 30's snapshot of each run, resumed to step 40 in another layout, stage and world size
    (the global batch kept by more micro-steps), continues as the DDP run resumed by DDP does:
    weights, fp32 master weights and AdamW's moments all carried over."""
    legs = {
        "ddp": (ddp_run[0], "ddp", 2),  # the reference
        "zero3 in ddp x1": (zero_run(3)[0], "ddp", 1),
        "ddp in zero1 x1": (ddp_run[0], "zero1", 1),
    }
    continued = {}
    for name, (source, parallel, nproc) in legs.items():
        run_dir = tmp_path / name.replace(" ", "-")
        shutil.copytree(source / "snapshots", run_dir / "snapshots")
        result = train(shakespeare, run_dir, parallel, nproc=nproc, max_steps=40)
        assert result.returncode == 0, (name, result.stderr[-3000:])
        assert "resume | step 30 |" in result.stdout, name
        continued[name] = losses(run_dir)
        assert len(continued[name]) == 10, name
    for name in list(legs)[1:]:
        assert continued[name] == pytest.approx(continued["ddp"], rel=1e-4), name


def test_deepspeed_files_of_old_snapshots_are_refused_where_they_cannot_resume(
    shakespeare, tmp_path
):
    shutil.copytree(OLD_ZERO2, tmp_path / "snapshots")

    def snapshots():
        return json.loads((tmp_path / "snapshots" / MANIFEST).read_text())["snapshots"]

    before = snapshots()
    cases = {
        "ddp": (
            2,
            "resume it once with trainer_config.parallel=deepspeed deepspeed_config.zero_stage=2",
        ),
        "zero2": (1, "holds DeepSpeed partitions for 2 ranks, and this job has 1"),
    }
    for parallel, (nproc, advice) in cases.items():
        result = train(shakespeare, tmp_path, parallel, nproc=nproc, max_steps=8)
        assert result.returncode == 1 and advice in result.stderr, (parallel, result.stderr[-2000:])
    # refused before any snapshot was written or deleted
    assert snapshots() == before


@pytest.mark.parametrize("source", ["zero3", "old zero2"])
def test_consolidate_and_sample_read_a_zero_snapshot(source, zero_run, tmp_path):
    """A ZeRO run's snapshot (one format), and DeepSpeed's own files of an older one."""
    snapshots, step = (zero_run(3)[0] / "snapshots", 30) if source == "zero3" else (OLD_ZERO2, 4)
    out = tmp_path / "model.pt"
    done = run(
        [sys.executable, "-m", "mingpt_ddp.snapshots", "consolidate", snapshots, out], timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and f"step {step}" in done.stdout
    state = torch.load(out, weights_only=True)
    assert state["deepspeed"]["zero_stage"] == int(source.split("zero")[1])
    assert state["model"]["wte.weight"].dtype == torch.float32
    for where in (out, snapshots):
        sampled = run(
            [
                sys.executable,
                REPO / "sample.py",
                "--snapshot",
                where,
                "--chars",
                "30",
                "--device",
                "cpu",
            ],
            timeout=120,
        )
        assert sampled.returncode == 0 and len(sampled.stdout) >= 30, sampled.stderr[-2000:]


class RunsCode:
    """What a crafted checkpoint file could hold: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_deepspeed_file_is_never_unpickled(shakespeare, tmp_path):
    shutil.copytree(OLD_ZERO2, tmp_path / "snapshots")
    snap_dir, marker = tmp_path / "snapshots", tmp_path / "payload-ran"
    manifest = json.loads((snap_dir / MANIFEST).read_text())
    newest = manifest["snapshots"][-1]
    name = next(n for n in newest["files"] if "optim_states" in n)
    data = pickle.dumps({"optimizer_state_dict": RunsCode(marker)})
    (snap_dir / newest["file"] / name).write_bytes(data)
    # The manifest is rewritten to match: the file passes the size and sha256 checks.
    newest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (snap_dir / MANIFEST).write_text(json.dumps(manifest))
    result = train(shakespeare, tmp_path, "zero2", max_steps=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "holds more than DeepSpeed's checkpoint data" in result.stderr + result.stdout
    assert "starting fresh" in result.stdout + result.stderr  # the only snapshot was skipped
    assert not marker.exists()
