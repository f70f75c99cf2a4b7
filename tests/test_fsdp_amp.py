"""FSDP2 sharding and mixed precision, chosen in the YAML; sharded snapshots that reshard on
resume."""

import json
import os
import sys

import pytest
import torch
from conftest import REPO, kill_tree, run, run_main, start_main, tiny_overrides

from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.snapshots.store import MANIFEST, SnapshotStore

FSDP = "trainer_config.parallel=fsdp"


def losses(run_dir):
    return MetricsLog.read(str(run_dir / "metrics.jsonl"))


def ok(result):
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    return result.stdout


@pytest.mark.slow
def test_fsdp_without_a_process_group_is_a_config_error(shakespeare, tmp_path):
    result = run_main(tiny_overrides(shakespeare, tmp_path) + [FSDP])
    assert result.returncode == 1 and "parallel=fsdp needs a process group" in result.stderr


@pytest.mark.slow
def test_an_unknown_parallel_mode_is_a_config_error(shakespeare, tmp_path):
    result = run_main(tiny_overrides(shakespeare, tmp_path) + ["trainer_config.parallel=megatron"])
    assert result.returncode == 1 and (
        "parallel must be ddp, fsdp, deepspeed, horovod or none" in result.stderr
    )


@pytest.mark.slow
def test_fsdp_and_ddp_give_the_same_losses_and_gradient_norms_for_30_steps(
    ddp_reference, shakespeare, tmp_path
):
    straight, settings, extra = (
        ddp_reference  # DDP, 2 ranks, with dropout: the same random draws in both
    )
    ok(run_main(tiny_overrides(shakespeare, tmp_path, **settings) + extra + [FSDP], nproc=2))
    ddp, fsdp = losses(straight.run_dir), losses(tmp_path)
    assert len(ddp) == len(fsdp) == 30
    for a, b in zip(ddp, fsdp):
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-4, (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-3 * max(1.0, a["grad_norm"]), (a, b)


@pytest.mark.slow
def test_fsdp_snapshots_reshard_4_2_1_load_into_one_process_and_back_and_consolidate(
    shakespeare, tmp_path
):
    """One job resumed again and again, 10 steps each time: FSDP shards from 4 ranks resume at 2,
    then at 1 (sample.py reads them); a plain process resumes from the shards and saves one file,
    which FSDP at 2 ranks loads again; the result consolidates to one file."""

    def leg(max_steps, *extra, nproc):
        return ok(
            run_main(
                tiny_overrides(
                    shakespeare, tmp_path, max_steps=max_steps, save_every=10, log_every=1
                )
                + list(extra),
                nproc=nproc,
            )
        )

    assert "in 6 files (sharded)" in leg(10, FSDP, nproc=4)  # 4 shards + DCP metadata + meta.pt
    out = leg(20, FSDP, nproc=2)
    assert (
        "resume | step 10 | epoch 0 | 160 samples into the epoch | saved at world size 4, now 2"
        in out
    )
    assert "saved at world size 2, now 1" in leg(30, FSDP, nproc=1)
    sample = run(
        [
            sys.executable,
            REPO / "sample.py",
            "--snapshot",
            tmp_path / "snapshots",
            "--prompt",
            "KING",
            "--chars",
            "20",
        ],
        timeout=60,
    )
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("KING") and "step 30 snapshot" in sample.stderr
    out = leg(40, nproc=0)  # one process (DDP's one-file format), from the shards
    assert "resume | step 30" in out
    out = leg(50, FSDP, nproc=2)  # and FSDP from that one file
    assert "resume | step 40" in out and "(sharded)" in out
    records = losses(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 51))
    assert sum(r["train_loss"] for r in records[-5:]) < sum(
        r["train_loss"] for r in records[:5]
    )  # still learning
    single = tmp_path / "consolidated.pt"
    conv = run(
        [
            sys.executable,
            "-m",
            "mingpt_ddp.snapshots",
            "consolidate",
            tmp_path / "snapshots",
            single,
        ],
        timeout=60,
    )
    assert conv.returncode == 0, conv.stderr
    state = torch.load(single, weights_only=True)
    assert state["step"] == 50 and state["model"]["wte.weight"].shape == (65, 32)
    assert set(state["optimizer"]["state"]) >= {"wte.weight", "blocks.0.attn.qkv.weight"}


@pytest.mark.slow
@pytest.mark.parametrize("parallel, nproc", [("ddp", 0), ("fsdp", 2)])
def test_bf16_mixed_precision_trains_and_the_loss_falls(parallel, nproc, shakespeare, tmp_path):
    args = tiny_overrides(shakespeare, tmp_path, max_steps=60, log_every=10, eval_every=60) + [
        "trainer_config.use_amp=true",
        "trainer_config.amp_dtype=bf16",
        f"trainer_config.parallel={parallel}",
        "optimizer_config.learning_rate=3e-3",
        "optimizer_config.warmup_steps=5",
    ]
    ok(run_main(args, nproc=nproc))
    records = losses(tmp_path)
    assert records[-1]["train_loss"] < records[0]["train_loss"] - 0.5
    assert records[-1]["val_loss"] < 3.5


FP16 = ["trainer_config.use_amp=true", "trainer_config.amp_dtype=fp16"]


@pytest.mark.slow
def test_fp16_with_its_grad_scaler_resumes_exactly_on_cpu(shakespeare, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    ok(
        run_main(
            tiny_overrides(shakespeare, straight, max_steps=20, save_every=10, log_every=1) + FP16
        )
    )
    out = ok(
        run_main(
            tiny_overrides(shakespeare, resumed, max_steps=10, save_every=10, log_every=1) + FP16
        )
    )
    assert "fp16 autocast + GradScaler" in out
    scaler = SnapshotStore(str(resumed / "snapshots")).load_latest()["scaler"]
    assert scaler["scale"] > 0 and "_growth_tracker" in scaler
    assert "resume | step 10" in ok(
        run_main(
            tiny_overrides(shakespeare, resumed, max_steps=20, save_every=10, log_every=1) + FP16
        )
    )
    assert [r["train_loss"] for r in losses(straight)] == [r["train_loss"] for r in losses(resumed)]
    a, b = (SnapshotStore(str(d / "snapshots")).load_latest() for d in (straight, resumed))
    assert a["scaler"] == b["scaler"] and all(
        torch.equal(a["model"][k], b["model"][k]) for k in a["model"]
    )


@pytest.mark.slow
def test_fsdp_with_fp16_parameters_and_a_grad_scaler_trains_and_resumes(shakespeare, tmp_path):
    args = (
        tiny_overrides(shakespeare, tmp_path, max_steps=30, save_every=15, log_every=5)
        + [FSDP, *FP16]
        + ["optimizer_config.learning_rate=3e-3", "optimizer_config.warmup_steps=5"]
    )
    out = ok(
        run_main(
            args[: -len(args) + args.index(FSDP)]
            + ["trainer_config.max_steps=15"]
            + args[args.index(FSDP) :],
            nproc=2,
        )
    )
    assert "fp16 parameters (FSDP mixed precision) + GradScaler" in out
    out = ok(run_main(args, nproc=2))
    assert "resume | step 15" in out
    records = losses(tmp_path)
    assert records[-1]["train_loss"] < records[0]["train_loss"] - 0.3
    assert SnapshotStore(str(tmp_path / "snapshots")).load_latest()["scaler"]["scale"] > 0


def test_the_loss_is_computed_in_fp32_under_fsdp_bf16_parameters(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from model import GPT, GPTConfig

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=65, block_size=16))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        values = []
        for seed in range(8):
            g = torch.Generator().manual_seed(seed)
            x, y = (
                torch.randint(0, 65, (4, 16), generator=g),
                torch.randint(0, 65, (4, 16), generator=g),
            )
            logits, loss = model(x, y)
            assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
            values.append(loss.item())
        # A bf16 loss near ln(65) = 4.17 can only take values 2^-6 apart; these are fp32 values.
        assert sum(v != float(torch.tensor(v).bfloat16()) for v in values) >= 6
    finally:
        dist.destroy_process_group()


COMPILE_SETTINGS = dict(max_steps=6, log_every=1, save_every=6)


@pytest.fixture(scope="module")
def eager_ddp(shakespeare, tmp_path_factory):
    """6 eager DDP steps at 2 ranks: what compiled DDP and compiled FSDP must match (eager FSDP
    matches eager DDP to 1e-4, test_fsdp_and_ddp_give_the_same_losses...)."""
    run_dir = tmp_path_factory.mktemp("eager")
    ok(run_main(tiny_overrides(shakespeare, run_dir, **COMPILE_SETTINGS), nproc=2))
    return run_dir


# Compiled under FSDP (block by block) here; the whole-model compile that DDP and one process
# use trains like eager in tests/test_activation_checkpointing.py, in process (a compiled 2-rank
# DDP job costs about a minute of CPU on 2 cores).
@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp"])
def test_compile_under_ddp_and_fsdp_trains_like_eager(parallel, eager_ddp, shakespeare, tmp_path):
    out = ok(
        run_main(
            tiny_overrides(shakespeare, tmp_path, **COMPILE_SETTINGS)
            + [f"trainer_config.parallel={parallel}", "trainer_config.compile=true"],
            nproc=2,
        )
    )
    assert "+ compile" in out
    for a, b in zip(losses(eager_ddp), losses(tmp_path), strict=True):
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-3, (a, b)


@pytest.mark.slow
def test_sigkill_during_a_sharded_save_leaves_the_previous_snapshot_usable(shakespeare, tmp_path):
    args = tiny_overrides(shakespeare, tmp_path, max_steps=60, save_every=5) + [FSDP]
    snap_dir = tmp_path / "snapshots"
    # Rank 1 stops half-way through writing its shard of the step-10 snapshot, and the job is killed
    # there.
    job = start_main(
        args, nproc=2, script=REPO / "tests" / "faulty_main.py", env={"FAULT": "block_write:1:10"}
    )
    for line in job.stdout:
        if "fault | rank 1 | blocked half-way through writing snapshot_00000010.g1.dcp/" in line:
            break
    kill_tree(job)
    assert any(
        n.endswith(".tmp") for n in os.listdir(snap_dir / "snapshot_00000010.g1.dcp")
    )  # really mid-write
    assert [e["step"] for e in json.loads((snap_dir / MANIFEST).read_text())["snapshots"]] == [5]
    out = ok(run_main(args, nproc=2))
    assert "resume | step 5 |" in out and "done | step 60" in out
