"""Pipeline parallelism (pipeline_config): stages x replicas train what one process trains, a
SIGKILLed pipeline resumes exactly, its snapshots reshard to another cut, and what it cannot run
is refused in one line.

Every run is 8 steps of a 4-block tiny model with a global batch of 8 windows: one process with
batch_size 8, or a pipeline of 2 stages (batch_size 8, 4 microbatches of 2), or 2 stages x 2
replicas (batch_size 4 each, 4 microbatches of 1). The same windows in the same order, so the
losses must agree to float rounding.
"""

import json
import shutil

import pytest
import torch
from conftest import assert_same_run, parallelisms, run_faulty, run_main, tiny_overrides

from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.config.pipeline import PipelineConfig
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.parallel.grid import GridStrategy
from mingpt_ddp.parallel.pipeline import check_schedule
from mingpt_ddp.parallel.plan import Plan, replica
from mingpt_ddp.parallel.stages import block_ranges, cut, placement, stage_ids
from mingpt_ddp.parallel.strategy import StrategyArgs
from mingpt_ddp.runtime.distributed import DistContext

FOUR_BLOCKS = ["gpt_config.n_layer=4"]
STEPS = dict(max_steps=8, log_every=1, eval_every=4, save_every=4)


def pipeline(degree=2, schedule="1f1b", **more) -> list[str]:
    keys = {"degree": degree, "schedule": schedule, "microbatches": 4, **more}
    return [f"pipeline_config.{k}={v}" for k, v in keys.items()]


def ok(result) -> str:
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    return result.stdout


def history(run_dir) -> list[dict]:
    return MetricsLog.read(str(run_dir / "metrics.jsonl"))


@pytest.fixture(scope="module")
def one_process(shakespeare, tmp_path_factory):
    """The reference: one process, batch_size 8, 8 steps; its run directory."""
    run_dir = tmp_path_factory.mktemp("one-process")
    ok(run_main(tiny_overrides(shakespeare, run_dir, batch_size=8, **STEPS) + FOUR_BLOCKS))
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, parallel, schedule",
    [
        # 2 stages with 1F1B, and 4 stages interleaved on 2 ranks: the SIGKILL test below.
        (2, "ddp", "gpipe"),
        (4, "ddp", "gpipe"),  # 2 stages x 2 replicas (GPipe once broke DDP: stages.Stage)
        (4, "fsdp", "1f1b"),
        # zero bubble: 4 stages in a V on 2 ranks (the tied pair on rank 0) x 2 FSDP replicas
        (4, "fsdp", "zbv"),
    ],
)
def test_a_pipeline_trains_what_one_process_trains(
    nproc, parallel, schedule, one_process, shakespeare, tmp_path
):
    batch_size = 8 * 2 // nproc  # per replica: the global batch stays 8
    args = tiny_overrides(
        shakespeare,
        tmp_path,
        batch_size=batch_size,
        parallel=parallel,
        **STEPS,
        trace_samples_path=tmp_path / "trace",
    )
    out = ok(run_main(args + FOUR_BLOCKS + pipeline(schedule=schedule), nproc=nproc))
    stages = 4 if schedule == "zbv" else 2
    assert f"pipeline {stages} stages ({schedule}, 4 microbatches) x {nproc // 2} repl" in out
    assert_same_run(history(one_process), history(tmp_path), 8)
    if schedule == "zbv":  # the V's snapshot (head and embedding on one rank) in one process
        more = dict(STEPS, max_steps=10, batch_size=8)
        out = ok(run_main(tiny_overrides(shakespeare, tmp_path, **more) + FOUR_BLOCKS))
        assert "resume | step 8 |" in out and "done | step 10 |" in out
    # Both stages of a replica read its windows; the replicas read different ones.
    reads = [(tmp_path / "trace" / f"rank{r}.jsonl").read_text() for r in range(nproc)]
    replicas = nproc // 2
    assert reads[0] == reads[replicas] and (replicas == 1 or reads[0] != reads[1])


@pytest.mark.slow
def test_a_sigkilled_stage_restarts_and_the_pipeline_resumes_exactly_then_reshards(
    one_process, shakespeare, tmp_path
):
    args = tiny_overrides(shakespeare, tmp_path, batch_size=8, **STEPS) + FOUR_BLOCKS
    out = run_faulty(args + pipeline(), "kill:1:6")
    assert "fault | rank 1 | kill before step 7" in out and "resume | step 4 |" in out, out
    assert_same_run(history(one_process), history(tmp_path), 8)  # steps 5-6 redone alike

    # Resharded: the 2-stage snapshot read by 4 stages of 1 block (interleaved), 4 more steps;
    # one process resumed from its own step-8 snapshot takes the same 4 steps.
    more = dict(STEPS, max_steps=12)
    one = tmp_path.parent / f"{tmp_path.name}-one"
    shutil.copytree(one_process, one)
    ok(run_main(tiny_overrides(shakespeare, one, batch_size=8, **more) + FOUR_BLOCKS))
    args = tiny_overrides(shakespeare, tmp_path, batch_size=8, **more) + FOUR_BLOCKS
    out = ok(run_main(args + pipeline(schedule="interleaved1f1b"), nproc=2))
    assert "resume | step 8 |" in out and "pipeline 4 stages (interleaved1f1b" in out
    assert_same_run(history(one), history(tmp_path), 12)

    # One format for every layout: one process resumes the pipeline's snapshot and trains on.
    args = tiny_overrides(shakespeare, tmp_path, batch_size=8, **dict(STEPS, max_steps=14))
    out = ok(run_main(args + FOUR_BLOCKS))
    assert "resume | step 12 |" in out and "done | step 14 |" in out


# ------------------------------------------------------------- in process


@pytest.mark.parametrize(
    "plan, world, refused",
    [
        (dict(parallel="ddp"), 4, "splits backward past DDP's gradient reduction"),
        (dict(parallel="ddp"), 8, "set trainer_config.parallel=fsdp"),
        (dict(parallel="ddp", compile=True), 2, "set trainer_config.compile=false"),
    ],
)
def test_zero_bubble_schedules_refuse_ddp_replicas_and_compile_naming_the_fix(plan, world, refused):
    pipeline = PipelineConfig(degree=2, schedule="zbv")
    made = Plan(pipeline=pipeline, **plan)
    with pytest.raises(ConfigError, match=refused):
        check_schedule(made, made.dims(world))
    check_schedule(Plan(pipeline=pipeline), Plan(pipeline=pipeline).dims(2))  # one pipeline: runs
    fsdp = Plan(pipeline=pipeline, parallel="fsdp")
    check_schedule(fsdp, fsdp.dims(4))  # FSDP replicas run (Pipeline keeps their blocks gathered)


def test_the_settings_a_pipeline_cannot_run_are_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="at least as many microbatches as stages"):
        PipelineConfig(degree=4, schedule="1f1b", microbatches=2)
    PipelineConfig(degree=4, schedule="gpipe", microbatches=2)  # GPipe runs any count
    with pytest.raises(ConfigError, match="in 2 equal rounds .* a multiple of 2, or below 4"):
        PipelineConfig(degree=2, schedule="interleaved1f1b", microbatches=5)
    PipelineConfig(degree=2, schedule="interleaved1f1b", microbatches=3)  # one round (torch's rule)
    PipelineConfig(degree=4, schedule="interleaved1f1b", microbatches=10)  # 2 rounds of 5
    with pytest.raises(ConfigError, match="schedule must be gpipe, 1f1b, interleaved1f1b, inter"):
        PipelineConfig(schedule="zb")
    with pytest.raises(ConfigError, match="dualpipev needs at least 2 x degree = 4 microbatches"):
        PipelineConfig(degree=2, schedule="dualpipev", microbatches=3)
    assert PipelineConfig(degree=2, schedule="zbv").stages == 4  # a V: 2 stages a rank
    with pytest.raises(ConfigError, match="must divide the world size 3"):
        Plan(pipeline=PipelineConfig(degree=2)).dims(3)
    with pytest.raises(ConfigError, match="needs at least 5 blocks, the model has 4"):
        block_ranges(4, 5)


TWO_STAGES = PipelineConfig(degree=2)


def stage_args(optimizer="adamw", batch_size=4, **plan):
    """A rank of 2 stages x 2 replicas (world 4), as GridStrategy.check sees it."""
    ctx = DistContext(0, 0, 4, torch.device("cpu"))
    plan = Plan(pipeline=TWO_STAGES, **plan)
    return StrategyArgs(plan, ctx, OptimizerConfig(optimizer=optimizer), batch_size, 1, None, None)


@pytest.mark.parametrize(
    "plan, optimizer, refused",
    [
        (dict(use_amp=True, amp_dtype="fp16"), "adamw", "use trainer_config.amp_dtype=bf16"),
        (dict(parallel="fsdp"), "muon", "optimizer=muon needs each weight matrix whole"),
        (dict(grad_reduce="via_rank0"), "adamw", "grad_reduce=via_rank0 is a DDP"),
    ],
)
def test_a_pipeline_refuses_modes_it_would_run_wrongly(plan, optimizer, refused):
    with pytest.raises(ConfigError, match=refused):
        GridStrategy.check(stage_args(optimizer, **plan))
    odd = stage_args(batch_size=6)  # 6 windows, 4 pieces
    with pytest.raises(ConfigError, match="do not cut into pipeline_config.microbatches=4 equal"):
        GridStrategy.check(odd)
    GridStrategy.check(stage_args("muon"))  # Muon over DDP replicas: whole matrices


def test_deepspeed_refuses_a_pipeline_naming_the_key():
    pytest.importorskip("deepspeed", reason='pip install -e ".[deepspeed]"')
    from mingpt_ddp.parallel.deepspeed import DeepSpeedStrategy

    with pytest.raises(ConfigError, match="set mesh_config.tp, cp and pp to 1"):
        DeepSpeedStrategy.check(stage_args(parallel="deepspeed"))


def test_stages_hold_the_whole_models_parameters_under_its_names():
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=5, n_head=2, n_embd=16, vocab_size=11, block_size=8))
    ranges = block_ranges(5, 3)
    assert [list(r) for r in ranges] == [[0, 1], [2, 3], [4]]
    stages = [cut(model, r, i == 0, i == 2) for i, r in enumerate(ranges)]
    whole = model.state_dict()
    pieces = {k: v for s in stages for k, v in s.state_dict().items()}
    assert (
        pieces.keys() == whole.keys()
    )  # lm_head.weight (tied) on the last stage, wte on the first
    assert all(torch.equal(pieces[k], whole[k]) for k in whole)
    h = x = torch.randint(0, 11, (2, 8))
    for stage in stages:
        h = stage(h)
    assert torch.allclose(h, model(x)[0])  # the stages in a row compute the whole model
    assert stage_ids(1, placement(2, 4, False)) == [1, 3]
    assert stage_ids(0, placement(2, 2, False)) == [0]
    assert stage_ids(0, placement(2, 4, True)) == [0, 3]  # a V: the first and the last stage
    assert stage_ids(1, placement(2, 4, True)) == [1, 2]


def test_the_replica_not_the_rank_decides_the_data_share():
    plan = Plan(pipeline=PipelineConfig(degree=2))
    dims = plan.dims(4)
    assert dims.shape() == {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1}
    assert [(dims.coordinates(r)["pp"], *replica(r, 4, plan)) for r in range(4)] == [
        (0, 0, 2),
        (0, 1, 2),
        (1, 0, 2),
        (1, 1, 2),
    ]
    assert json.dumps(replica(3, 4, Plan())) == "[3, 4]"  # no pipeline: every rank a replica


@pytest.mark.slow
def test_parallelisms_counts_the_bytes_the_formulas_predict_and_matches_one_process(tmp_path):
    rows, out = parallelisms(
        tmp_path,
        "pp2 gpipe m=4,pp2 1f1b m=4,pp2 1f1b m=4 x cp2,pp2 gpipe m=1,"
        "pp2 zbv m=4,pp2 dualpipev m=4,pp2 interleavedzb m=4 v=2,dp2 fsdp x pp2 zbv m=4",
    )
    for r in rows.values():
        assert r["sent_bytes_per_step"] == r["sent_bytes_formula"] > 0, r  # counted = predicted
    # On a common clock one chain of work (m = 1) leaves each rank idle while the other works:
    # the two idle shares sum to at least 1 (timed per rank, they once summed to 0.83).
    assert sum(rows["pp2 gpipe m=1"]["bubble_per_rank"]) >= 1
    # zero bubble: no textbook formula; the schedule's own action table at unit cost gives one
    for name, formula in (("zbv", 0.04), ("dualpipev", 1 / 13), ("interleavedzb", 0.04)):
        row = next(r for label, r in rows.items() if f" {name} " in label)
        assert row["bubble_formula"] == pytest.approx(formula) == row["bubble_from_table"]
        assert 0 < row["bubble_measured"] < 1
    gpipe, one_f_one_b = rows["pp2 gpipe m=4"], rows["pp2 1f1b m=4"]
    assert gpipe["bubble_formula"] == one_f_one_b["bubble_formula"] == 1 / 5
    assert 0 < gpipe["bubble_measured"] < 1 and len(gpipe["bubble_per_rank"]) == 2
    # GPipe holds all 4 microbatches' activations at its peak, 1F1B at most 2 (p) on stage 0.
    assert gpipe["activation_bytes_per_rank"] > 1.5 * one_f_one_b["activation_bytes_per_rank"]
    assert "| pp2 1f1b m=4 | 8 |" in out.with_suffix(".md").read_text()
