"""Defects a reading of the GPU paths found (issue 28), tested where a CPU can test them: which
mesh FSDP shards on, where fp16's loss scale lives under CPU offload, the CPU threads of a GPU job
whose optimizer steps on the CPU, attention's precision across a resume, and resuming a
multi-file snapshot from a filesystem without a copy per rank."""

from __future__ import annotations

import dataclasses
import hashlib
import os

import pytest
import torch
import torch.distributed as dist

from mingpt_ddp.config.deepspeed import DeepSpeedConfig
from mingpt_ddp.config.mesh import MeshConfig
from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.config.replica_groups import TorchftConfig
from mingpt_ddp.config.trainer import TrainerConfig
from mingpt_ddp.parallel.grid import GridStrategy
from mingpt_ddp.parallel.plan import CPUScaleGradScaler, Plan, grad_scaler
from mingpt_ddp.parallel.strategy import StrategyArgs
from mingpt_ddp.runtime import host
from mingpt_ddp.runtime.distributed import ControlPlane, DistContext
from mingpt_ddp.snapshots.files import open_entry
from mingpt_ddp.snapshots.layout import META, FileLayout
from mingpt_ddp.snapshots.reader import SnapshotReader
from model import GPT, GPTConfig


def args_for(plan: Plan, device="cpu", world_size=1, local_world_size=1) -> StrategyArgs:
    ctx = DistContext(0, 0, world_size, torch.device(device), 0, local_world_size)
    return StrategyArgs(plan, ctx, OptimizerConfig(), 2, 1, ControlPlane(), DeepSpeedConfig())


def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=11, block_size=8))


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp_shards_on_the_ranks_own_device_not_the_accelerator_torch_finds(
    world_of_one, monkeypatch
):
    """Without a mesh, fully_shard builds one on torch._C._get_accelerator(): cuda on a GPU host,
    even for a job told trainer_config.device=cpu. The strategy must hand it its own."""
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

    def default_mesh(*_, **__):
        raise AssertionError("fully_shard fell back to the mesh of torch's accelerator")

    monkeypatch.setattr(_fsdp_init, "_init_default_mesh", default_mesh)
    monkeypatch.setattr(_fully_shard, "_init_default_mesh", default_mesh, raising=False)
    strategy = GridStrategy(tiny(), args_for(Plan(parallel="fsdp")))
    weight = strategy.model.blocks[0].mlp.fc.weight
    assert weight.device_mesh.device_type == "cpu" and weight.to_local().device.type == "cpu"


def test_fp16_under_cpu_offload_keeps_its_loss_scale_in_cpu_memory():
    """torch's GradScaler puts its scale beside the first loss (a GPU) and copies it to the CPU
    gradients with non_blocking=True, which the CPU kernels read before it lands. The offload
    scaler keeps the scale on the CPU whatever device the loss is on ("meta" stands in for a
    GPU here: a tensor on another device)."""
    fp16 = dict(use_amp=True, amp_dtype="fp16")
    plain = grad_scaler(Plan(parallel="fsdp", **fp16), torch.device("cpu"))
    offload = grad_scaler(Plan(parallel="fsdp", cpu_offload=True, **fp16), torch.device("cpu"))
    assert type(plain) is torch.amp.GradScaler and isinstance(offload, CPUScaleGradScaler)
    plain.scale(torch.ones((), device="meta"))
    offload.scale(torch.ones((), device="meta"))
    assert plain._scale.device.type == "meta" and offload._scale.device.type == "cpu"


def test_the_offload_scaler_skips_an_overflowed_step_and_backs_off():
    scaler = CPUScaleGradScaler("cpu", init_scale=1024.0)
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    scaler.scale((weight * float("inf")).sum()).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(weight.detach(), torch.ones(4)) and scaler.get_scale() == 512.0
    optimizer.zero_grad()
    scaler.scale((weight * 2).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(weight.detach(), torch.ones(4))  # a finite step is applied


@pytest.mark.parametrize("offloads, expected", [(True, "share"), (False, "default")])
def test_a_gpu_job_whose_optimizer_steps_on_the_cpu_gets_its_share_of_the_cores(
    offloads, expected, monkeypatch
):
    """torchrun's OMP_NUM_THREADS=1 is right for a GPU job, whose CPU only feeds the GPU, but not
    for FSDP CPU offload or DeepSpeed's offload_optimizer, whose update runs on the CPU."""
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    ctx = DistContext(0, 0, 2, torch.device("cuda", 0), 0, local_world_size=2)
    threads = host.set_cpu_threads(ctx, optimizer_on_cpu=offloads)
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    assert (set_to, threads) == (([share], share) if expected == "share" else ([], threads))


def test_attention_precision_is_kept_in_the_snapshot_not_re_timed_on_resume(monkeypatch):
    """Under bf16 autocast attention runs in whichever precision was faster when the run started;
    a resumed run must compute as the snapshot's run did, whatever its own timing says."""
    from mingpt_ddp.parallel import grid

    bf16 = Plan(parallel="none", use_amp=True, amp_dtype="bf16")
    monkeypatch.setattr(grid, "autocast_attention_fp32", lambda *a: (True, "attention fp32"))
    first = GridStrategy(tiny(), args_for(bf16))
    meta = first.snapshot_meta()
    assert meta["attention_fp32"] is True
    monkeypatch.setattr(grid, "autocast_attention_fp32", lambda *a: (False, "attention bf16"))
    resumed = GridStrategy(tiny(), args_for(bf16))
    assert not resumed.model.blocks[0].attn.fp32_under_autocast  # its own timing...
    resumed.load_snapshot_meta(meta)
    assert resumed.model.blocks[0].attn.fp32_under_autocast  # ...gives way to the snapshot's
    assert "as the snapshot's run" in resumed.precision()
    fp32 = GridStrategy(tiny(), args_for(Plan(parallel="none")))
    assert fp32.snapshot_meta()["attention_fp32"] is None  # nothing to keep without autocast


def folder_snapshot(root) -> tuple[dict, FileLayout]:
    """A two-file snapshot folder written by hand, its manifest entry, and a layout for it."""
    folder = root / "snapshot_00000010.g1.test"
    folder.mkdir(parents=True)
    torch.save({"step": 10}, folder / META)
    torch.save({"w": torch.arange(4.0)}, folder / "shard_0.pt")
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in folder.iterdir()
    }
    layout = FileLayout(
        kind="test",
        extension="test",
        file_names=__import__("re").compile(r"^shard_\d\.pt$"),
        full_tensors=lambda d: torch.load(os.path.join(d, "tag", "shard_0.pt")),
        subdir="tag",
    )
    return {"file": folder.name, "kind": "test", "step": 10, "files": files}, layout


def test_a_folder_snapshot_on_a_filesystem_is_resumed_in_place_not_copied_per_rank(tmp_path):
    entry, layout = folder_snapshot(tmp_path / "store")
    reader = SnapshotReader(str(tmp_path / "store"), layouts={"test": layout})
    snapshot = reader._open(entry, "cpu")
    staged = os.path.join(snapshot.directory, "tag", "shard_0.pt")
    assert os.path.islink(staged)  # where the reader expects it, but the store's own file
    assert os.path.realpath(staged) == str(tmp_path / "store" / entry["file"] / "shard_0.pt")
    assert snapshot.meta["step"] == 10 and torch.equal(snapshot.tensors()["w"], torch.arange(4.0))
    snapshot.close()
    assert (tmp_path / "store" / entry["file"] / "shard_0.pt").is_file()  # closing kept it


def test_a_damaged_file_is_still_caught_when_read_in_place(tmp_path):
    entry, layout = folder_snapshot(tmp_path / "store")
    shard = tmp_path / "store" / entry["file"] / "shard_0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    reader = SnapshotReader(str(tmp_path / "store"), layouts={"test": layout})
    with pytest.raises(Exception, match="shard_0.pt: checksum mismatch"):
        open_entry(entry, layout, reader._read_checked, "cpu", reader._checked_path)


@pytest.fixture
def pre_ampere(monkeypatch):
    """A V100 as torch would describe it: compute capability 7.0, no bf16 units (bf16 only
    emulated), no TF32."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2")
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation
    )


def test_a_pre_ampere_gpu_is_labelled_for_what_it_has(pre_ampere):
    from mingpt_ddp.parallel.plan import choose_precision
    from mingpt_ddp.parallel.strategy import Strategy

    gpu = torch.device("cuda", 0)
    assert choose_precision("auto", "auto", gpu) == (
        True,
        "fp16",
        "auto: Tesla V100-SXM2 lacks bf16 units, fp16 tensor cores",
    )
    use_amp, dtype, why = choose_precision("auto", "bf16", gpu)  # bf16 asked for: not fp16's cores
    assert (use_amp, dtype) == (True, "bf16") and "fp16 tensor cores" not in why
    assert "bf16 is emulated" in why
    fp32 = Strategy(tiny(), args_for(Plan(parallel="ddp"), device="cuda"))
    assert fp32.precision() == "fp32"  # no TF32 before Ampere, whatever trainer_config.tf32 says


@pytest.mark.parametrize(
    "sections, refusing",
    [
        ({"mesh": MeshConfig(pp=2)}, "the pipeline (mesh_config.pp=2)"),
        ({"mesh": MeshConfig(tp=2)}, "tensor parallelism (mesh_config.tp=2)"),
        ({"torchft": TorchftConfig(groups=2)}, "torchft"),
    ],
)
def test_auto_is_fp32_on_a_pre_ampere_gpu_where_the_mode_refuses_fp16(
    pre_ampere, sections, refusing
):
    """A V100 or T4 has fp16 or nothing; a pipeline, tensor parallelism and torchft refuse fp16,
    so auto is fp32 there (a default launch used to stop on the refusal), and the job line says
    why. DDP and FSDP keep fp16; amp_dtype=auto with use_amp=true is bf16 (emulated), not fp16."""
    from mingpt_ddp.parallel.grid import check_layout
    from mingpt_ddp.parallel.plan import precision_of

    gpu = torch.device("cuda", 0)
    plan = Plan.of(TrainerConfig(), gpu, **sections)
    assert (plan.use_amp, plan.amp_dtype) == (False, "bf16")
    assert precision_of(TrainerConfig(), gpu, sections) == (
        False,
        "bf16",
        f"auto: Tesla V100-SXM2 lacks bf16 units and {refusing} refuses fp16, so fp32",
    )
    asked = Plan.of(TrainerConfig(use_amp=True), gpu, **sections)
    assert (asked.use_amp, asked.amp_dtype) == (True, "bf16")
    if "mesh" in sections:  # the grid's refusal of fp16 is not met
        args = dataclasses.replace(args_for(plan, "cuda", world_size=2), batch_size=4)
        check_layout(args, plan.dims(2))
    for parallel in ("ddp", "fsdp"):
        kept = Plan.of(TrainerConfig(parallel=parallel), gpu)
        assert (kept.use_amp, kept.amp_dtype) == (True, "fp16")


def test_an_ampere_gpu_says_tf32(monkeypatch):
    from mingpt_ddp.parallel.strategy import Strategy

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    fp32 = Strategy(tiny(), args_for(Plan(parallel="ddp"), device="cuda"))
    assert fp32.precision() == "fp32 (TF32 matmuls)"
    no_tf32 = Strategy(tiny(), args_for(Plan(parallel="ddp", tf32=False), device="cuda"))
    assert no_tf32.precision() == "fp32"


def test_gpu_ranks_leave_a_flight_recorder_dump_that_the_next_attempt_names(tmp_path, monkeypatch):
    """NCCL's watchdog ends a rank whose collective timed out before any exit note is written;
    the flight recorder's dump is what tells that apart from a SIGKILL. Dumps carry their attempt,
    so an older attempt's cannot make a later SIGKILL look like a timeout."""
    from mingpt_ddp.runtime import flight_recorder as fr

    env = fr.flight_recorder_env(str(tmp_path), attempt=1)  # what attempt 1's ranks dump to
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_FR_BUFFER_SIZE"]) > 0
    later = fr.flight_recorder_env(str(tmp_path), attempt=2)["TORCH_FR_DUMP_TEMP_FILE"]
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", later)  # the attempt that reports
    (tmp_path / "nccl_trace_attempt1_rank_1").write_bytes(b"dump")
    assert fr.silent_rank(1, attempt=1) == (
        f"rank 1: a collective timed out (NCCL watchdog); its last ones: {tmp_path}/"
        "nccl_trace_attempt1_rank_1"
    )
    assert fr.silent_rank(1, attempt=2).startswith("rank 1 died without a word (killed: SIGKILL")
    assert fr.silent_rank(0, attempt=1).startswith("rank 0 died without a word (killed: SIGKILL")


def test_a_users_recorder_settings_win_under_the_older_names_too(tmp_path, monkeypatch):
    """torch reads TORCH_FR_* first, then the older TORCH_NCCL_* names: setting the new name over
    a user's TORCH_NCCL_TRACE_BUFFER_SIZE=0 would turn on a recorder they turned off."""
    from mingpt_ddp.runtime import flight_recorder as fr

    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/mine/trace_")
    fr.use_flight_recorder(str(tmp_path), attempt=0)
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"  # no older name: ours


def test_the_gradient_norm_is_read_on_log_steps_only():
    """Reading a device's gradient norm into a float waits for the device (a host sync): the
    Trainer asks the strategy for it only where it writes a log line (DeepSpeed's strategy turns
    the engine's norm into a float there), never per step."""
    import ast
    import inspect

    import trainer

    tree = ast.parse(inspect.getsource(trainer))
    callers = {
        function.name
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef)
        for node in ast.walk(function)
        if isinstance(node, ast.Attribute) and node.attr == "grad_norm"
    }
    assert callers == {"_log"}


def test_from_object_storage_a_node_downloads_a_folder_snapshot_once_for_all_its_ranks(tmp_path):
    """Where files cannot be read in place (S3), the ranks of a node share one download: the
    first fills the folder, the others reuse it, the last to close removes it."""
    entry, layout = folder_snapshot(tmp_path / "store")
    reader = SnapshotReader(str(tmp_path / "store"), layouts={"test": layout})
    reads = []

    def read(name, expected):  # what an S3 reader does: fetch the bytes, check them
        reads.append(name)
        return reader._read_checked(name, expected)

    ranks = [open_entry(entry, layout, read, "cpu") for _ in range(3)]  # three ranks of a node
    assert len(reads) == len(entry["files"])  # one download, not three
    assert len({r.directory for r in ranks}) == 1
    folder = ranks[0].directory
    assert not os.path.islink(os.path.join(folder, "tag", "shard_0.pt"))  # a real copy
    assert all(torch.equal(r.tensors()["w"], torch.arange(4.0)) for r in ranks)
    for r in ranks[:2]:
        r.close()
    assert os.path.isdir(folder)  # the third rank still reads it
    ranks[2].close()
    assert not os.path.exists(folder)
