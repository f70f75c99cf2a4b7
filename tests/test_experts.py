"""Mixture of experts (gpt_config.n_experts) and expert parallelism (mesh_config.ep): the block
trains in one process, its balance loss reaches the router as if added to the loss, ties and
capacities behave as documented, bad settings are refused in one line; every expert-parallel
layout trains what one process trains and sends the bytes its routing predicts
(benchmarks/parallelisms.py); a SIGKILLed ep2 job resumes exactly, and its snapshot resumes in
one process.

The runs through main.py are 8 steps of the tiny model (2 blocks, width 32) with 4 experts, top 2:
one process on a global batch of 8 windows, or 2 ranks of 4 windows each (ep2 over 2 replicas).
"""

import re
import shutil

import pytest
import torch
from conftest import (
    REPO,
    assert_same_run,
    main_command,
    parallelisms,
    run,
    run_faulty,
    run_main,
    tiny_overrides,
)

from mingpt_ddp.config.mesh import MeshConfig
from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.moe import MoE
from mingpt_ddp.parallel.expert import check_ep, load_words
from mingpt_ddp.parallel.mesh import ParallelDims
from mingpt_ddp.parallel.plan import Plan
from mingpt_ddp.parallel.registry import build_strategy
from mingpt_ddp.parallel.strategy import StrategyArgs
from mingpt_ddp.runtime.distributed import DistContext
from model import GPT, GPTConfig

EXPERTS = ["gpt_config.n_experts=4", "gpt_config.bias_update_rate=0.001"]
STEPS = dict(max_steps=8, log_every=1, eval_every=4, save_every=4, sample_chars=24)


def tiny(**moe) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=16, **moe))


def test_the_moe_block_trains_in_one_process_and_counts_its_tokens():
    model = tiny(n_experts=4, top_k=2, bias_update_rate=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 65, (8, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(30):
        _, loss = model(x, x)
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
        moe = model.blocks[0].mlp
        assert moe.routed.sum() == 8 * 16 * 2  # every token, twice (top 2): dropless
        moe.rebalance(moe.routed)
    assert losses[-1] < losses[0] - 1.0, losses  # it learns to copy its input
    assert moe.expert_bias.abs().sum() > 0  # the loss-free balance moved the biases
    # the same active weights per token as the dense MLP: hidden 4C / top_k each
    assert moe.w1.shape == (4, 32, 64) and tiny().flops_per_token() > model.flops_per_token() - 1e3


def test_the_balance_loss_reaches_the_router_as_if_added_to_the_loss():
    x = torch.randint(0, 65, (4, 16), generator=torch.Generator().manual_seed(2))
    a = tiny(n_experts=4, top_k=2, aux_loss_coef=0.5)
    a(x, x)[1].backward()  # the balance loss through moe.AuxGradient
    b, found = tiny(n_experts=4, top_k=2, aux_loss_coef=0.5), []
    for block in b.blocks:
        block.mlp.aux_scale = 0.0  # its own path off; the loss added by hand instead
        block.mlp.aux_loss = lambda *args, f=block.mlp.aux_loss: found.append(f(*args)) or found[-1]
    (b(x, x)[1] + sum(found)).backward()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert a.blocks[0].mlp.router.weight.grad.abs().sum() > 0


def test_a_pipeline_s_shape_inference_routes_no_token():
    moe = tiny(n_experts=4).blocks[0].mlp
    moe.routing = False  # as stages.Stage sets it around its first-step inference
    y = moe(torch.empty(2, 16, 32))  # uninitialised memory, as the inference's input
    assert moe.routed.sum() == 0 and y.shape == (2, 16, 32)
    moe.routing = True
    moe(torch.randn(2, 16, 32))
    assert moe.routed.sum() == 2 * 16 * 2


def test_ties_go_to_the_lower_expert_and_a_capacity_drops_the_rest():
    moe = MoE(GPTConfig(n_layer=1, n_embd=8, n_experts=4, top_k=1, capacity_factor=1.0), torch.relu)
    weights, chosen = moe.choose(torch.full((3, 4), 0.25))
    assert chosen.flatten().tolist() == [0, 0, 0]  # every expert tied: the first
    with torch.no_grad():
        moe.router.weight.zero_()  # every token ties: all go to expert 0, capacity 1 x 8 / 4 = 2
    y = moe(torch.randn(1, 8, 8))
    assert moe.routed.tolist() == [2.0, 0.0, 0.0, 0.0]
    assert (y[0, 2:] == 0).all() and (y[0, :2] != 0).any()  # the first 2 kept, the rest dropped


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(n_experts=4, top_k=5), "top_k=5 must be between 1 and gpt_config.n_experts=4"),
        (dict(n_experts=1), "n_experts must be 0 .* or 2 or more"),
        (dict(n_experts=4, router="relu"), "router must be softmax or sigmoid"),
    ],
)
def test_settings_that_cannot_route_are_refused_naming_the_key(bad, message):
    with pytest.raises(ConfigError, match=message):
        GPTConfig(**bad)


def test_expert_degrees_that_do_not_fit_are_refused_naming_the_key():
    dims = ParallelDims.of(4, {"tp": 1, "cp": 1, "pp": 1}, MeshConfig(ep=4), "ddp")
    with pytest.raises(ConfigError, match="mesh_config.ep=4 must divide gpt_config.n_experts=6"):
        check_ep(GPTConfig(n_experts=6), dims)
    with pytest.raises(ConfigError, match="model has none: set gpt_config.n_experts"):
        check_ep(GPTConfig(), dims)
    with pytest.raises(ConfigError, match="mesh_config.ep=4 must divide mesh_config.dp_replica"):
        ParallelDims.of(4, {"tp": 2, "cp": 1, "pp": 1}, MeshConfig(ep=4), "ddp")
    # under HSDP the expert groups stay inside a shard group, never across replica groups
    hsdp = MeshConfig(ep=4, dp_replicate=2)
    with pytest.raises(ConfigError, match="mesh_config.ep=4 must divide mesh_config.dp_shard=2"):
        ParallelDims.of(4, {"tp": 1, "cp": 1, "pp": 1}, hsdp, "fsdp")


def test_what_the_grid_cannot_run_with_experts_is_refused_naming_the_fix():
    dims = ParallelDims.of(4, {"tp": 2, "cp": 1, "pp": 1}, MeshConfig(), "ddp")
    with pytest.raises(ConfigError, match="sequence_parallel=true is not built with gpt_config"):
        check_ep(GPTConfig(n_experts=4), dims, sequence_parallel=True)
    dims = ParallelDims.of(4, {"tp": 1, "cp": 2, "pp": 1}, MeshConfig(ep=2), "ddp")
    with pytest.raises(ConfigError, match="set aux_loss_coef=0 and balance with gpt_config.bias"):
        check_ep(GPTConfig(n_experts=4), dims)
    check_ep(GPTConfig(n_experts=4, aux_loss_coef=0.0, bias_update_rate=1e-3), dims)  # runs


@pytest.mark.parametrize("parallel", ["deepspeed", "horovod"])
def test_the_engines_of_their_own_refuse_experts_in_one_line(parallel):
    ctx = DistContext(0, 0, 1, torch.device("cpu"))
    args = StrategyArgs(Plan(parallel), ctx, OptimizerConfig(), 4, 1, None, None)
    with pytest.raises(ConfigError, match=f"trains on the grid's layouts .* not {parallel}"):
        build_strategy(parallel, tiny(n_experts=4), args)


def test_the_load_is_reported_as_max_over_mean():
    fields, words = load_words(torch.tensor([[30.0, 10.0], [20.0, 20.0]]), [60, 20])
    assert fields["expert_load"] == 1.25 and fields["rank_load"] == 1.5  # (1.5 + 1) / 2; 60 / 40
    assert words == " | experts max/mean 1.25, ranks 1.50"


def test_a_bad_setting_stops_main_in_one_line(shakespeare, tmp_path):
    args = tiny_overrides(shakespeare, tmp_path, max_steps=1) + ["gpt_config.n_experts=4"]
    result = run_main(args + ["gpt_config.top_k=5"])
    assert result.returncode != 0
    assert "gpt_config.top_k=5 must be between 1 and gpt_config.n_experts=4" in result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------- through torchrun
@pytest.mark.slow
def test_expert_parallel_layouts_match_one_process_and_send_what_their_routing_says(tmp_path):
    ep = "(4 experts)"
    rows, _ = parallelisms(
        tmp_path,
        f"dp2 ddp x ep2 {ep},dp2 fsdp x tp2 x ep2 {ep},dp2 ddp x pp2 1f1b m=4 x ep2 {ep},"
        f"dp2 ddp x ep1 {ep}",
    )
    # ep1: the experts whole on each rank, averaged by DDP with the rest (once a KeyError)
    plain = rows.pop(f"dp2 ddp x ep1 {ep}")
    assert plain["sent_bytes_per_step"] == plain["sent_bytes_formula"] > 0, plain
    assert plain["routing_flips"] == [] and plain["degrees"]["ep"] == 1
    for r in rows.values():  # parallelisms(): within 1e-4 of one process
        assert r["sent_bytes_per_step"] == r["sent_bytes_formula"] > 0, r  # counted = predicted
        assert r["degrees"]["ep"] == 2 and r["load_imbalance"] >= 1.0
        assert r["routing_flips"] == [], r  # every step chose as one process did
        assert any("all_to_all" in op for op in r["sent_bytes_by_op"][0])


def history(run_dir) -> list[dict]:
    return MetricsLog.read(str(run_dir / "metrics.jsonl"))


def ok(result) -> str:
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    return result.stdout


@pytest.mark.slow
def test_a_sigkilled_ep2_job_resumes_exactly_and_its_snapshot_resumes_in_one_process(
    shakespeare, tmp_path
):
    one = tmp_path / "one"  # one process, the same 8 windows a step
    ok(run_main(tiny_overrides(shakespeare, one, **STEPS, batch_size=8) + EXPERTS))
    ep2 = tmp_path / "ep2"
    args = tiny_overrides(shakespeare, ep2, **STEPS) + EXPERTS + ["mesh_config.ep=2"]
    out = run_faulty(args, "kill:1:6")
    assert "expert parallel 2 (2 of 4 experts each)" in out and "resume | step 4 |" in out, out
    assert "experts max/mean" in out and ", ranks " in out
    assert_same_run(history(one), history(ep2), 8)
    assert history(ep2)[-1]["tokens_per_expert"] == history(one)[-1]["tokens_per_expert"]

    # The ep2 snapshot (DCP shards, experts cut by expert) read by one process: 4 more steps
    # equal one process resumed from its own step-8 snapshot.
    more = dict(STEPS, max_steps=12, batch_size=8)
    again = tmp_path / "one-again"
    shutil.copytree(one, again)
    ok(run_main(tiny_overrides(shakespeare, again, **more) + EXPERTS))
    out = ok(run_main(tiny_overrides(shakespeare, ep2, **more) + EXPERTS))
    assert "resume | step 8 |" in out
    assert_same_run(history(again), history(ep2), 12)


@pytest.mark.slow
def test_the_tutorial_s_expert_parallel_layer_equals_one_process_on_2_ranks():
    tutorial = REPO / "tutorials" / "expert_parallel_by_hand.py"
    command = main_command(2, [], script=tutorial, torchrun=True)
    result = run(command, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    checks = re.findall(
        r"\[rank (\d)\] expert-parallel MoE layer: max \|diff\| (.+) -> (\w+)", result.stdout
    )
    assert [(rank, verdict) for rank, _, verdict in checks] == [("0", "pass"), ("1", "pass")]
    for _, pairs, _ in checks:
        diffs = dict(re.findall(r"(\w+) (\S+)", pairs))
        assert list(diffs) == ["output", "router", "w1", "w2"]
        assert all(float(d) <= 1e-5 for d in diffs.values()), pairs
    # 12 tokens a rank, top 2: 24 rows each; some go to the other rank, the rest stay
    sent = re.findall(r"rows sent to other ranks: (\d+) of (\d+)", result.stdout)
    assert len(sent) == 2 and all(0 < int(away) < int(total) == 24 for away, total in sent)
    assert result.stdout.count("all checks passed: True") == 2
