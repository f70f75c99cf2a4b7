"""The decisions a GPU machine depends on, made by small functions tested here without a GPU:
which device a rank uses, which backends its process group gets, TF32, whether bf16 is native and
how attention computes under bf16 autocast, the torch version, and the fp16 loss-scaling path
(which runs on CPU too); and how a CPU process's allocator keeps memory."""

import math
import os
import platform
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_main, tiny_overrides

from char_dataset import CharDataset, DataConfig
from mingpt_ddp.config.deepspeed import DeepSpeedConfig
from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.config.trainer import TrainerConfig
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.parallel.grid import GridStrategy
from mingpt_ddp.parallel.plan import (
    Plan,
    autocast_attention_fp32,
    bf16_native,
    choose_precision,
    set_tf32,
)
from mingpt_ddp.parallel.strategy import StrategyArgs
from mingpt_ddp.runtime.distributed import ControlPlane, DistContext, backend_for, choose_device
from mingpt_ddp.runtime.versions import MIN_TORCH, torch_version_problem
from mingpt_ddp.snapshots.store import SnapshotStore
from model import GPT, GPTConfig
from trainer import Trainer

GLIBC = platform.libc_ver()[0] == "glibc"


def test_auto_uses_one_gpu_per_rank_picked_by_local_rank():
    assert choose_device("auto", gpus=4, local_rank=3, local_world_size=4) == torch.device(
        "cuda", 3
    )
    assert choose_device("cuda", gpus=8, local_rank=0, local_world_size=2) == torch.device(
        "cuda", 0
    )


def test_auto_without_gpus_and_cpu_on_a_gpu_machine_use_the_cpu():
    assert choose_device("auto", gpus=0, local_rank=0, local_world_size=4) == torch.device("cpu")
    assert choose_device("cpu", gpus=8, local_rank=5, local_world_size=8) == torch.device("cpu")


def test_more_ranks_than_gpus_is_refused_on_every_rank_naming_the_fix(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    for local_rank in range(4):  # rank 0 too: nobody is left waiting for a rank that failed alone
        with pytest.raises(
            ConfigError,
            match=r"4 ranks on this node need one GPU each, but 2 GPU\(s\) are visible "
            r"\(CUDA_VISIBLE_DEVICES=0,1\); start at most 2 per node "
            r"\(torchrun --nproc_per_node=2\) or set trainer_config.device=cpu",
        ):
            choose_device("auto", gpus=2, local_rank=local_rank, local_world_size=4)


def test_cuda_requested_without_a_gpu_is_refused():
    with pytest.raises(ConfigError, match="trainer_config.device=cuda, but no GPU is visible"):
        choose_device("cuda", gpus=0, local_rank=0, local_world_size=1)


def test_gpu_jobs_get_gloo_beside_nccl_for_cpu_tensors():
    # CPU-offloaded FSDP gradients, object collectives and the per-step vote are CPU tensors:
    # an nccl-only group fails on them ("No backend type associated with device type cpu").
    assert backend_for(torch.device("cuda", 0)) == "cuda:nccl,cpu:gloo"
    assert backend_for(torch.device("cpu")) == "gloo"


def strategy_args(plan: Plan, device: str) -> StrategyArgs:
    ctx = DistContext(rank=0, local_rank=0, world_size=2, device=torch.device(device))
    return StrategyArgs(plan, ctx, OptimizerConfig(), 4, 1, ControlPlane(), DeepSpeedConfig())


def test_fsdp_cpu_offload_is_for_gpu_jobs_and_refused_on_the_cpu():
    with pytest.raises(ConfigError, match="fsdp_cpu_offload=true .* needs parallel=fsdp on GPUs"):
        GridStrategy.check(strategy_args(Plan(parallel="fsdp", cpu_offload=True), "cpu"))
    fp16 = Plan(parallel="fsdp", use_amp=True, amp_dtype="fp16", cpu_offload=True)
    GridStrategy.check(strategy_args(fp16, "cuda"))  # fp16 too


def test_tf32_is_a_gpu_setting_that_leaves_cpu_matmuls_alone():
    before = torch.get_float32_matmul_precision()
    set_tf32(Plan(tf32=True), torch.device("cpu"))
    assert torch.get_float32_matmul_precision() == before == "highest"


@pytest.mark.parametrize(
    "version, ok",
    [
        ("2.5.1", False),
        ("2.4.1+cpu", False),
        ("1.13.1", False),
        ("2.8.0", False),
        ("2.9.0", True),
        ("2.9.1+cu128", True),
        ("2.13.0a0+git1234", True),
        ("3.0.0", True),
    ],
)
def test_the_torch_version_check_names_installed_and_required(version, ok):
    problem = torch_version_problem(version)
    if ok:
        assert problem is None
    else:
        assert problem == (
            f"torch {version} is installed; this project needs torch >= {MIN_TORCH} "
            f"(pip install 'torch>={MIN_TORCH}')"
        )


def tiny_trainer(tmp_path, shakespeare, **trainer) -> Trainer:
    dataset = CharDataset(
        DataConfig(path=str(shakespeare), block_size=16, cache_dir=str(tmp_path / "prepared")),
        log=lambda _: None,
    )
    gcfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=dataset.vocab_size, block_size=16)
    torch.manual_seed(0)
    tcfg = TrainerConfig(
        batch_size=4, metrics_path="none", **{"use_amp": False, **trainer}
    )  # fp32 unless asked
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    store = SnapshotStore(str(tmp_path / "snapshots"))
    return Trainer(
        GPT(gcfg),
        dataset,
        tcfg,
        OptimizerConfig(grad_clip=1.0),
        ctx,
        {"gpt_config": vars(gcfg)},
        store,
    )


def test_fp16_on_cpu_scales_the_loss_and_an_overflow_skips_the_step_and_halves_the_scale(
    shakespeare, tmp_path
):
    trainer = tiny_trainer(tmp_path, shakespeare, use_amp=True, amp_dtype="fp16", parallel="none")
    assert trainer.strategy.scaler.is_enabled() and trainer.strategy.scaler.get_scale() == 2.0**16
    trainer.train_step()  # a normal step: the weights move
    trainer.strategy.scaler.update(
        2.0**40
    )  # a loss scale no fp16 gradient survives: inf in backward
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train_step()
    after = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert all(
        torch.equal(before[k], after[k]) for k in before
    )  # the overflowing step was skipped...
    assert trainer.strategy.scaler.get_scale() == 2.0**39  # ...and the scale halved
    assert not math.isfinite(
        trainer.strategy.grad_norm()
    )  # the norm is measured on the (overflowed) gradients
    trainer.strategy.scaler.update(2.0**8)  # (2^39 would keep overflowing for ~24 more halvings)
    trainer.train_step()  # at a scale fp16 can hold, the step goes through
    assert any(not torch.equal(after[k], v) for k, v in trainer.model.state_dict().items())
    assert math.isfinite(trainer.strategy.grad_norm())


def test_gradients_are_unscaled_before_clipping(shakespeare, tmp_path):
    fp32 = tiny_trainer(tmp_path / "a", shakespeare, parallel="none")
    fp16 = tiny_trainer(
        tmp_path / "b", shakespeare, use_amp=True, amp_dtype="fp16", parallel="none"
    )
    fp32.train_step()
    fp16.train_step()
    # The reported norm is the true gradient's, not 65536 times it: clipping saw the unscaled
    # gradients.
    assert fp16.strategy.grad_norm() == pytest.approx(fp32.strategy.grad_norm(), rel=0.05)


@pytest.mark.parametrize(
    "flags, native",
    [
        ({"avx512f", "avx2"}, False),
        ({"avx512f", "avx512_bf16"}, True),
        ({"amx_bf16", "amx_tile"}, True),
        (set(), False),
    ],
)
def test_bf16_counts_as_native_on_a_cpu_only_with_avx512_bf16_or_amx(flags, native):
    found, evidence = bf16_native(torch.device("cpu"), flags)
    assert found is native
    assert ("CPU has" if native else "CPU lacks AVX-512 BF16 and AMX") in evidence


CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"avx512f", "avx2"}, (False, "bf16")),
        (set(), (False, "bf16")),
        ({"avx512_bf16"}, (True, "bf16")),
        ({"amx_bf16"}, (True, "bf16")),
    ],
)
def test_auto_precision_is_bf16_only_where_the_cpu_computes_it_natively(flags, expected):
    use_amp, dtype, why = choose_precision("auto", "auto", CPU, flags)
    assert (use_amp, dtype) == expected
    assert why.startswith(
        "auto: CPU "
        + ("has" if use_amp else "lacks AVX-512 BF16 and AMX, so bf16 would be emulated")
    )


def test_an_explicit_precision_is_kept_whatever_the_cpu():
    assert choose_precision(True, "bf16", CPU, set())[:2] == (
        True,
        "bf16",
    )  # asked for: bf16 even if emulated
    assert choose_precision(False, "auto", CPU, {"amx_bf16"})[:2] == (False, "bf16")
    assert (
        choose_precision("auto", "fp16", CPU, {"amx_bf16"})[0] is False
    )  # fp16 is not native on these CPUs


def test_auto_precision_on_a_gpu_uses_bf16_units_or_else_fp16_tensor_cores(monkeypatch):
    for native, dtype in ((True, "bf16"), (False, "fp16")):
        monkeypatch.setattr(
            torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n
        )
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
        assert choose_precision("auto", "auto", GPU)[:2] == (True, dtype)


def test_trainer_config_refuses_a_precision_word_it_does_not_know():
    with pytest.raises(ConfigError, match="use_amp must be true, false or auto"):
        TrainerConfig(use_amp="sometimes")
    with pytest.raises(ConfigError, match="amp_dtype must be auto, bf16 or fp16"):
        TrainerConfig(amp_dtype="fp8")


def test_attention_precision_under_bf16_autocast_is_decided_by_timing_both():
    shape = (2, 2, 16, 8)  # (B, nh, T, hs)
    fp32, words = autocast_attention_fp32(
        Plan(use_amp=True, amp_dtype="bf16"), torch.device("cpu"), shape
    )
    bf16_ms, fp32_ms = (float(x) for x in re.findall(r"([\d.]+) ms", words))
    assert fp32 == (fp32_ms < bf16_ms) and words.startswith(
        f"attention {'fp32' if fp32 else 'bf16'}"
    )
    # Nothing to decide without bf16 autocast (FSDP and DeepSpeed cast the parameters themselves,
    # and never ask: GridStrategy.autocasts).
    for plan in (Plan(use_amp=False), Plan(use_amp=True, amp_dtype="fp16")):
        assert autocast_attention_fp32(plan, torch.device("cpu"), shape) == (False, "")


def test_the_job_line_says_which_precision_auto_picked_and_why(shakespeare, tmp_path):
    result = run_main(
        tiny_overrides(shakespeare, tmp_path, max_steps=2, parallel="none", use_amp="auto")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    use_amp, dtype, why = choose_precision("auto", "auto", CPU)  # what this machine's CPU flags say
    assert f"| precision {dtype + ' mixed' if use_amp else 'fp32'} ({why})" in result.stdout
    assert ("autocast" in result.stdout) == use_amp  # and the train line agrees
    assert (
        "| glibc malloc keeps freed memory" in result.stdout
    ) == GLIBC  # trainer_config.cpu_keep_freed_memory


# Training steps of a small GPT on the CPU (after 3 to warm up): prints the minor page faults, fresh
# 4 KiB pages the kernel had to map and zero, that 30 steps cost, and what the setting said.
TRAIN_STEPS = """
import resource, sys, torch
from mingpt_ddp.runtime.host import keep_freed_cpu_memory
from model import GPT, GPTConfig
said = keep_freed_cpu_memory(torch.device("cpu"), enabled=sys.argv[1] == "on")
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=65, block_size=64, bias=False))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 65, (12, 65))
def step():
    _, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, said or "-")
"""


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_keeping_freed_memory_stops_each_step_page_faulting_its_tensors_back():
    def faults(setting: str, env: dict | None = None) -> tuple[int, str]:
        out = subprocess.run(
            [sys.executable, "-c", TRAIN_STEPS, setting],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        count, said = out.stdout.split(maxsplit=1)
        return int(count), said.strip()

    default, _ = faults("off")
    kept, said = faults("on")
    assert default > 30 * 100  # glibc gave memory back, and the steps faulted fresh pages in again
    assert (
        kept < default / 5 and said == "glibc malloc keeps freed memory"
    )  # measured: ~20-60x fewer
    # The user's own allocator settings win: nothing is changed.
    assert faults("on", {"MALLOC_ARENA_MAX": "2"})[1] == "allocator as set in the environment"


def test_the_job_line_says_the_allocator_setting_and_false_leaves_glibc_alone(
    shakespeare, tmp_path
):
    result = run_main(
        tiny_overrides(shakespeare, tmp_path, max_steps=1, parallel="none")
        + ["trainer_config.cpu_keep_freed_memory=false"]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    job_line = next(line for line in result.stdout.splitlines() if line.startswith("job |"))
    assert "malloc" not in job_line
