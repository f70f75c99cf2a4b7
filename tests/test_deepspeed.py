"""DeepSpeed ZeRO as a parallel mode (mingpt_ddp/parallel/deepspeed.py): it trains like DDP, splits the optimizer state as ZeRO
promises, and its snapshots keep this project's promises (exact resume, checked files, clear refusals).

Real torchrun jobs at world size 2 on CPU (DS_ACCELERATOR=cpu, gloo), tiny models, seconds each.
"""

import hashlib
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from conftest import REPO, kill_tree, run_main, tiny_overrides, torchrun_cmd, wait_for_line
from mingpt_ddp.snapshots.manifest import MANIFEST
from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.snapshots.store import SnapshotStore

pytest.importorskip("deepspeed", reason="pip install -e \".[deepspeed]\"")
pytestmark = pytest.mark.slow

STEPS = dict(max_steps=20, save_every=10, log_every=1, eval_every=10)


def train(shakespeare, run_dir, parallel, nproc=2, **settings):
    result = run_main(tiny_overrides(shakespeare, run_dir, **{**STEPS, **settings}) + [f"parallel={parallel}"],
                      nproc=nproc)
    return result


def losses(run_dir):
    return [r["train_loss"] for r in MetricsLog.read(str(run_dir / "metrics.jsonl")) if "train_loss" in r]


def optimizer_mb(stdout: str) -> float:
    return float(stdout.split("memory | optimizer state ")[1].split(" MB")[0])


@pytest.fixture(scope="module")
def ddp_run(shakespeare, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ddp")
    result = train(shakespeare, run_dir, "ddp")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result.stdout


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_train_like_ddp_and_split_the_optimizer_state(stage, ddp_run, shakespeare, tmp_path):
    ddp_dir, ddp_out = ddp_run
    result = train(shakespeare, tmp_path, f"zero{stage}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"deepspeed ZeRO-{stage} | fp32 | world size 2" in result.stdout
    # The same global batch, the same data order, the same AdamW: the same losses, to rounding.
    assert losses(tmp_path) == pytest.approx(losses(ddp_dir), rel=1e-4)
    # AdamW's moments: DDP keeps all of them on every rank, ZeRO (any stage) half of them on each of 2.
    assert optimizer_mb(result.stdout) == pytest.approx(optimizer_mb(ddp_out) / 2, rel=0.02)
    entry = json.loads((tmp_path / "snapshots" / MANIFEST).read_text())["snapshots"][-1]
    assert entry["kind"] == "deepspeed" and entry["file"].endswith(".zero") and len(entry["files"]) >= 4


def test_cpu_offload_of_optimizer_state_and_parameters_trains_the_same_losses(ddp_run, shakespeare, tmp_path):
    # Offloading moves where the state lives (for GPU jobs: into CPU memory), not what is computed.
    result = run_main(tiny_overrides(shakespeare, tmp_path, **{**STEPS, "max_steps": 10}) +
                      ["parallel=zero3", "deepspeed_config.offload_optimizer=true",
                       "deepspeed_config.offload_params=true"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "deepspeed ZeRO-3 + optimizer offload + parameter offload" in result.stdout
    assert losses(tmp_path) == pytest.approx(losses(ddp_run[0])[:10], rel=1e-4)


def test_a_killed_zero3_job_resumes_exactly(shakespeare, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    settings = dict(max_steps=30, save_every=10, log_every=1, eval_every=10)
    assert train(shakespeare, straight, "zero3", **settings).returncode == 0
    args = tiny_overrides(shakespeare, killed, **settings) + ["parallel=zero3"]
    job = subprocess.Popen(torchrun_cmd(2, *args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wait_for_line(job, "snapshot | step 10")
    kill_tree(job)  # a power cut, somewhere after the step-10 snapshot
    resumed = train(shakespeare, killed, "zero3", **settings)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume | step 10 |" in resumed.stdout or "resume | step 20 |" in resumed.stdout
    records = MetricsLog.read(str(killed / "metrics.jsonl"))
    assert [r["step"] for r in records if "train_loss" in r] == list(range(1, 31))  # every step once
    assert losses(killed) == losses(straight)
    wa, wb = (SnapshotStore(str(d / "snapshots")).load_latest()["model"] for d in (straight, killed))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_zero_snapshot_is_refused_where_it_cannot_resume_naming_what_to_do(shakespeare, tmp_path):
    assert train(shakespeare, tmp_path, "zero2", max_steps=10).returncode == 0
    def snapshots():
        return json.loads((tmp_path / "snapshots" / MANIFEST).read_text())["snapshots"]

    before = snapshots()
    cases = {"ddp": (2, "resume with trainer_config.parallel=deepspeed deepspeed_config.zero_stage=2"),
             "zero3": (2, "resume with deepspeed_config.zero_stage=2"),
             "zero2": (1, "holds DeepSpeed partitions for 2 ranks, and this job has 1; resume with 2 ranks")}
    for parallel, (nproc, advice) in cases.items():
        result = train(shakespeare, tmp_path, parallel, nproc=nproc, max_steps=20)
        assert result.returncode == 1 and advice in result.stderr, (parallel, result.stderr[-2000:])
    assert snapshots() == before  # refused before any snapshot was written or deleted


def test_consolidate_and_sample_read_a_zero_snapshot(shakespeare, tmp_path):
    assert train(shakespeare, tmp_path, "zero3", max_steps=10).returncode == 0
    out = tmp_path / "model.pt"
    done = subprocess.run([sys.executable, "-m", "mingpt_ddp.snapshots", "consolidate", str(tmp_path / "snapshots"),
                           str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "step 10" in done.stdout
    state = torch.load(out, weights_only=True)
    assert state["deepspeed"] == {"zero_stage": 3} and state["model"]["wte.weight"].dtype == torch.float32
    for source in (str(out), str(tmp_path / "snapshots")):
        sampled = subprocess.run([sys.executable, str(REPO / "sample.py"), "--snapshot", source, "--chars", "30",
                                  "--device", "cpu"], capture_output=True, text=True, timeout=120)
        assert sampled.returncode == 0 and len(sampled.stdout) >= 30, sampled.stderr[-2000:]


class RunsCode:
    """What a crafted checkpoint file could hold: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_deepspeed_file_is_never_unpickled_and_the_run_falls_back(shakespeare, tmp_path):
    assert train(shakespeare, tmp_path, "zero2", max_steps=20).returncode == 0
    snap_dir, marker = tmp_path / "snapshots", tmp_path / "payload-ran"
    manifest = json.loads((snap_dir / MANIFEST).read_text())
    newest = manifest["snapshots"][-1]
    name = next(n for n in newest["files"] if "optim_states" in n)
    data = pickle.dumps({"optimizer_state_dict": RunsCode(marker)})
    (snap_dir / newest["file"] / name).write_bytes(data)
    # The manifest is rewritten to match: the file passes the size and sha256 checks.
    newest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (snap_dir / MANIFEST).write_text(json.dumps(manifest))
    result = train(shakespeare, tmp_path, "zero2", max_steps=30)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "holds more than DeepSpeed's checkpoint data" in result.stderr + result.stdout
    assert "resume | step 10 |" in result.stdout  # the snapshot before it
    assert not marker.exists()
