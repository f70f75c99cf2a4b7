"""The CUDA paths: nccl beside gloo, one GPU per rank, pinned-memory batches, every precision, FSDP
CPU offload, cross-device snapshots. Each test skips cleanly on a machine without a GPU (CI); on
one, `python benchmarks/gpu_check.py` runs them as part of its matrix."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_main, tiny_overrides

from mingpt_ddp.metrics import MetricsLog

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]


def on_gpu(args: list[str]) -> list[str]:
    """tiny_overrides' arguments with the device switched from cpu (the suite's default) to cuda."""
    return [a for a in args if not a.startswith("trainer_config.device=")] + [
        "trainer_config.device=cuda"
    ]


def ok(result) -> str:
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    return result.stdout


@pytest.mark.parametrize(
    "precision, banner",
    [
        ([], "fp32 (TF32 matmuls)"),
        (["trainer_config.use_amp=true", "trainer_config.amp_dtype=bf16"], "bf16 autocast"),
        (
            ["trainer_config.use_amp=true", "trainer_config.amp_dtype=fp16"],
            "fp16 autocast + GradScaler",
        ),
    ],
)
def test_one_gpu_trains_in_each_precision_and_resumes(precision, banner, shakespeare, tmp_path):
    first = ok(
        run_main(
            on_gpu(tiny_overrides(shakespeare, tmp_path, max_steps=10, save_every=5)) + precision
        )
    )
    assert "device cuda:0" in first and banner in first
    second = ok(
        run_main(
            on_gpu(tiny_overrides(shakespeare, tmp_path, max_steps=20, save_every=5)) + precision
        )
    )
    assert "resume | step 10 |" in second
    records = MetricsLog.read(str(tmp_path / "metrics.jsonl"))
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in records)


def test_a_gpu_group_has_nccl_for_gpu_tensors_and_gloo_for_cpu_ones(shakespeare, tmp_path):
    out = ok(
        run_main(
            on_gpu(tiny_overrides(shakespeare, tmp_path, max_steps=6, save_every=3)), nproc=GPUS
        )
    )
    assert f"world size {GPUS} | backend cuda:nccl,cpu:gloo | device cuda:0" in out


def test_fsdp_with_cpu_offload_on_gpus_clips_and_logs_its_gradient_norm(shakespeare, tmp_path):
    args = on_gpu(tiny_overrides(shakespeare, tmp_path, max_steps=6, save_every=3, log_every=1)) + [
        "trainer_config.parallel=fsdp",
        "trainer_config.fsdp_cpu_offload=true",
    ]
    ok(
        run_main(args, nproc=GPUS)
    )  # CPU-resident gradient shards: their norm is all-reduced through gloo
    norms = [r["grad_norm"] for r in MetricsLog.read(str(tmp_path / "metrics.jsonl"))]
    assert len(norms) == 6 and all(n > 0 for n in norms)


def test_more_ranks_than_gpus_stops_at_once_naming_the_fix(shakespeare, tmp_path):
    result = run_main(
        on_gpu(tiny_overrides(shakespeare, tmp_path, max_steps=2)), nproc=GPUS + 1, timeout=120
    )
    assert result.returncode != 0
    assert f"need one GPU each, but {GPUS} GPU(s) are visible" in result.stderr
    assert f"--nproc_per_node={GPUS}" in result.stderr


def test_a_gpu_snapshot_resumes_on_cpu_and_sample_py_runs_on_the_gpu(shakespeare, tmp_path):
    ok(run_main(on_gpu(tiny_overrides(shakespeare, tmp_path, max_steps=6, save_every=6))))
    out = ok(
        run_main(tiny_overrides(shakespeare, tmp_path, max_steps=8, save_every=8))
    )  # the CPU now
    assert "resume | step 6 |" in out and "device cpu" in out
    sample = subprocess.run(
        [
            sys.executable,
            str(REPO / "sample.py"),
            "--snapshot",
            str(tmp_path / "snapshots"),
            "--device",
            "cuda",
            "--chars",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sample.returncode == 0, sample.stderr
    assert len(sample.stdout.rstrip("\n")) == 21  # the one-character prompt and 20 more
