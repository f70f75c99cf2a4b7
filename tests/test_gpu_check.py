"""benchmarks/gpu_check.py, the acceptance run for a GPU machine: which rows it plans for a machine
(in process, for 0, 1, 4 and 8 GPUs: every mode a GPU user can run, the rows it skips and why,
the rehearsal's rows), what its report holds, and (slow) a short CPU rehearsal and its rows that
disturb a job (a stopped rank, a killed replica group)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_rows  # noqa: E402

NEEDS_2 = "skipped: needs 2 GPUs (NCCL: one per rank)"
OFFLOAD = "skipped: needs a GPU (offload moves shards out of GPU memory)"
LAYOUT = {"pipeline", "tensor", "sequence", "context", "torchft", "stall"}


def runnable(rows):
    return [r for r in rows if not r.skip]


def test_one_gpu_skips_nccl_rows_naming_the_gpus_and_runs_the_layout_rows_on_its_cpu():
    rows = gpu_rows.plan_rows("cuda", gpus=1, half="bf16")
    for row in rows:
        assert row.precision in ("fp32", "bf16", "fp16")  # set, never "auto"
        assert row.launcher != "python" or (row.ranks == 1 and "DDP" not in row.name)
        if row.ranks > 1 and row.device != "cpu":
            assert row.skip == NEEDS_2, row
    # The multi-rank logic still runs with one GPU: over gloo, on the host's CPU.
    on_cpu = runnable([r for r in rows if r.ranks > 1])
    assert all(r.device == "cpu" and r.name.startswith(gpu_rows.ON_CPU) for r in on_cpu)
    gloo = {gpu_rows.ON_CPU + "DDP x2 over gloo", gpu_rows.ON_CPU + "FSDP x2 over gloo"}
    assert gloo <= {r.name for r in on_cpu}
    assert LAYOUT <= {m for r in on_cpu for m in r.modes}
    names = " | ".join(r.name for r in runnable(rows))
    for wanted in ["fp16 + GradScaler", "FSDP fp16 + CPU offload", "ZeRO-2", "Muon",
                   "DDP + compile", "4 micro-steps"]:  # fmt: skip
        assert wanted in names


def test_several_gpus_run_the_nccl_rows_resume_sigterm_and_restart_included():
    rows = gpu_rows.plan_rows("cuda", gpus=4, half="fp16")
    assert not [r for r in rows if r.skip]
    checks = {r.check for r in rows if r.ranks == 4}
    assert {"resume", "world_size", "sigterm", "restart", "train"} == checks
    assert {r.name for r in rows if r.device == "cpu"} == {  # every other row on the GPUs
        "device=cpu on the GPU host: DDP x2 over gloo",
        "device=cpu on the GPU host: FSDP x2 over gloo",
    }
    assert "one process fp16 autocast" in {r.name for r in rows}  # V100/T4: fp16, not bf16


def test_the_cpu_rehearsal_runs_every_gloo_row_and_says_why_the_others_cannot():
    rows = gpu_rows.plan_rows("cpu", gpus=0, half="bf16")
    assert len(runnable(rows)) >= 30
    assert [r.skip for r in rows if r.skip] == [OFFLOAD] * 3  # FSDP's, ZeRO-3's x1 and x2
    assert {m for r in runnable(rows) for m in r.modes} == set(gpu_rows.MODES)
    horovod = [r for r in rows if "horovod" in r.modes]  # run where built: decided when it runs
    assert len(horovod) == 1 and "Horovod is built" in horovod[0].conditional


def plan(monkeypatch, tmp_path, *flags) -> dict:
    """`gpu_check.py --plan FLAGS --out F`, in process; nothing may start a process."""

    def no_process(*args, **kwargs):
        raise AssertionError(f"--plan started a process: {args}")

    monkeypatch.setattr(subprocess, "run", no_process)
    monkeypatch.setattr(subprocess, "Popen", no_process)
    out = tmp_path / "plan.json"
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--plan", *flags, "--out", str(out)])
    assert gpu_check.main() == 0
    return json.loads(out.read_text())


def test_the_plan_for_8_gpus_runs_every_mode_horovod_where_built_with_nccl(monkeypatch, tmp_path):
    planned = plan(monkeypatch, tmp_path, "--gpus", "8")
    rows = planned["rows"]
    assert planned["device"] == "cuda" and planned["modes_not_run"] == []
    assert not [r for r in rows if "skip" in r]
    assert {m for r in rows for m in r["modes"]} == set(gpu_rows.MODES)
    for r in rows:
        assert set(r) >= {"name", "world_size", "modes"} and set(r["modes"]) <= set(gpu_rows.MODES)
    (horovod,) = [r for r in rows if "horovod" in r["modes"]]
    assert horovod["world_size"] == 8 and "built with NCCL" in horovod["conditional"]
    assert [r["device"] for r in rows].count("cpu") == 2  # the DDP and FSDP x2 rows over gloo
    assert {r["world_size"] for r in rows if "pipeline" in r["modes"]} == {2, 4}


def test_the_plan_for_1_gpu_names_the_rows_it_skips_and_why(monkeypatch, tmp_path):
    rows = plan(monkeypatch, tmp_path, "--gpus", "1")["rows"]
    skipped = {r["name"]: r["skip"] for r in rows if "skip" in r}
    assert set(skipped.values()) == {NEEDS_2}
    assert {"torchrun x2 DDP", "torchrun x2 SIGTERM: saves its step, resumes",
            "torchrun x2 DDP fp16 + GradScaler, 4 micro-steps", "torchrun x2 DeepSpeed ZeRO-3 bf16",
            "horovodrun x2 Horovod"} <= set(skipped)  # fmt: skip
    on_cpu = [r for r in rows if r["device"] == "cpu" and "skip" not in r]
    assert LAYOUT <= {m for r in on_cpu for m in r["modes"]}
    on_gpu = [r for r in rows if "skip" not in r and r["device"] == "cuda"]
    assert {r["world_size"] for r in on_gpu} == {1, None}  # one process, or a command row


def test_the_plan_for_0_gpus_is_the_cpu_rehearsals_rows(shakespeare, tmp_path, monkeypatch):
    """What --plan lists for no GPU is what the rehearsal reports, row for row (the rows' runs
    replaced by recording their names)."""
    planned = plan(monkeypatch, tmp_path, "--device", "cpu", "--gpus", "0")
    assert planned["device"] == "cpu"
    check, ran = gpu_check.Check("cpu", str(shakespeare), str(tmp_path), only=""), []
    monkeypatch.setattr(check, "row", lambda row: ran.append(row.name))
    monkeypatch.setattr(check, "command_row", lambda name, *a, **k: ran.append(name))
    monkeypatch.setattr(gpu_check, "cross_format", lambda c, row: ran.append(row.name))
    gpu_check.run_all(check, gpus=0, half="bf16", cpu_suite=False)
    assert ran == [r["name"] for r in planned["rows"]]


def test_the_report_names_every_hardware_field_null_where_it_does_not_apply():
    hw = gpu_rows.report_hardware("cpu")
    for key in ("name", "capability", "arch_list", "driver"):
        assert key in hw
    assert hw["capability"] is None and hw["arch_list"] is None and hw["driver"] is None
    assert hw["name"]


def test_a_missing_corpus_is_one_line_naming_the_fix(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: no corpus at .*; pass --data FILE"):
        gpu_check.find_corpus(str(tmp_path / "absent.txt"))


def test_the_cuda_tests_row_is_given_the_corpus(shakespeare, tmp_path, monkeypatch):
    """The first H200 run: without TINYSHAKESPEARE_PATH the 7 CUDA tests skipped and the row
    failed; a row of skips is no check."""
    check = gpu_check.Check("cuda", str(shakespeare), str(tmp_path), only="CUDA-only")
    calls = []
    monkeypatch.setattr(check, "command_row", lambda name, cmd, expect, env=None: calls.append(
        (name, env)))  # fmt: skip
    gpu_check.run_all(check, gpus=1, half="bf16", cpu_suite=False)
    assert calls[0] == ("CUDA-only tests", {"TINYSHAKESPEARE_PATH": str(shakespeare)})


@pytest.mark.slow
def test_the_cpu_rehearsal_passes_its_rows_with_finite_losses_under_the_ceiling(
    shakespeare, tmp_path
):
    script = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--data", str(shakespeare)]
    if not torch.cuda.is_available():  # what it does on a machine without a GPU: nothing, rc 0
        idle = subprocess.run(script, capture_output=True, text=True, timeout=120)
        assert idle.returncode == 0 and "no CUDA device visible: nothing checked" in idle.stdout
    report = tmp_path / "gc.json"
    only = "one process fp16"  # FSDP + bf16 and SIGTERM: test_fsdp_amp.py, test_resume.py
    result = subprocess.run(
        script + ["--device", "cpu", "--only", only, "--out", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    rows = json.loads(report.read_text())["rows"]
    assert [r["name"] for r in rows] == ["one process fp16 + GradScaler"]
    for row in rows:
        assert row["ok"] and row["finite_loss"] and row["val_loss"] < 4.17 - 0.3, row
    assert json.loads(report.read_text())["hardware"]["capability"] is None


@pytest.mark.slow
def test_the_rehearsals_stall_and_torchft_rows_name_the_stopped_rank_and_heal(
    shakespeare, tmp_path
):
    """The check's own disturbances: a SIGSTOPped rank named by the stall report, then SIGCONT;
    a replica group SIGKILLed, restarted, and healed from its peer."""
    pytest.importorskip("torchft")
    script = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--data", str(shakespeare)]
    report = tmp_path / "gc.json"
    only = ["--only", "stall report,torchft", "--device", "cpu", "--out", str(report)]
    result = subprocess.run(script + only, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    rows = json.loads(report.read_text())["rows"]
    assert [(r["modes"], r["ok"]) for r in rows] == [(["ddp", "stall"], True), (["torchft"], True)]


def test_benchmark_rows_set_their_precision_and_fp32_rows_are_fp32():
    """bench.py's "single GPU fp32" row used to train under automatic AMP (bf16 on a GPU), and on
    V100/T4 its "bf16" rows trained in fp16; compare.py's DDP and DDP + AMP rows were one run."""
    import bench
    import compare

    for name, _, overrides in bench.CPU_MODES + bench.gpu_modes("fp16") + bench.SMOKE_MODES:
        assert isinstance(overrides["use_amp"], bool), name  # never "auto"
        half = "autocast" in name or "16 +" in name
        assert (bench.precision_of(overrides) == "fp32") == (not half), name
    assert [bench.precision_of(m[2]) for m in bench.gpu_modes("fp16")] == ["fp32", "fp16", "fp16"]
    assert [m[0] for m in bench.gpu_modes("fp16")][1:] == [
        "single GPU fp16 autocast",
        "single GPU fp16 + compile",
    ]
    rows = {row[2]: row[4] for row in compare.ROWS}
    assert compare.fp32_unless_amp(rows["DDP"]) == ["trainer_config.use_amp=false"]
    assert compare.fp32_unless_amp(rows["DDP + bf16 autocast"]) == []


def test_the_report_of_a_v100_under_a_build_without_sm_70(monkeypatch):
    """A V100 as torch describes it (injected): capability 7.0, bf16 only emulated, and a torch
    build whose arch list lacks sm_70."""
    from types import SimpleNamespace

    v100 = SimpleNamespace(name="Tesla V100-SXM2-16GB", major=7, minor=0, total_memory=16 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: v100.name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: v100)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_80", "sm_90"])
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(gpu_rows.shutil, "which", lambda name: None)
    hw = gpu_rows.report_hardware("cuda")
    assert (hw["name"], hw["capability"], hw["arch_list"]) == (v100.name, "7.0", ["sm_80", "sm_90"])
    assert hw["built_for_this_gpu"] is False and hw["bf16_units"] is False
    assert hw["driver"] is None  # no nvidia-smi: null, not missing
