"""The planner (python -m mingpt_ddp.planner): its shapes are model.py's, its search answers in
the documented schema, bad degrees, schedules and expert flags are refused in one line, a
pipeline's peak is a moment of its schedule (test_planner_check.py holds the whole against real
runs)."""

import json
import sys

import pytest
import torch
from conftest import run_python

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.planner.shapes import Layout, Model
from mingpt_ddp.planner.traffic import per_dimension
from model import GPT, GPTConfig


@pytest.mark.parametrize("name,experts", [("gpt2", 0), ("gpt2-xl", 0), ("7b", 0), ("gpt2", 8)])
def test_the_planners_parameter_count_is_the_models(name, experts):
    shape = Model.named(name, n_experts=experts)
    config = GPTConfig(
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        n_embd=shape.n_embd,
        vocab_size=shape.vocab,
        block_size=shape.block,
        n_experts=experts,
    )
    with torch.device("meta"):  # shapes only: no memory for 6.65B parameters
        built = GPT(config)
    assert shape.params() == sum(p.numel() for p in built.parameters())
    # the FLOPs count the parameters a token meets: top_k of the experts
    attention = 12 * shape.n_layer * shape.block * shape.n_embd
    assert shape.flops_per_token() - attention == 6 * built.active_params()  # wpe: no matmul


def test_an_unknown_size_is_refused_naming_the_sizes():
    with pytest.raises(ConfigError, match="--model gpt5: pick one of .*gpt2-xl.*7b"):
        Model.named("gpt5")


def test_a_named_machine_sets_the_numbers_and_each_flag_overrides_its_own():
    from mingpt_ddp.planner.__main__ import machine_of, options

    a100 = machine_of(options().parse_args(["--machine", "a100", "--gpu-memory", "40"]))
    assert (a100.memory_gib, a100.peak_tflops, a100.network_gbs) == (40.0, 312.0, 25.0)
    h100 = machine_of(options().parse_args([]))
    assert (h100.memory_gib, h100.peak_tflops, h100.nvlink_gbs) == (80.0, 989.0, 450.0)


def test_bytes_follow_the_grid_each_dimension_on_its_own():
    model = Model(4, 2, 32, vocab=65, block=32)
    alone = per_dimension(model, Layout(batch=16, dtype="fp32"))
    assert sum(alone.values()) == 0  # one rank sends nothing
    tp = per_dimension(model, Layout(tp=2, batch=16, dtype="fp32"))
    tp_dp = per_dimension(model, Layout(tp=2, dp_shard=2, batch=8, dtype="fp32"))
    assert tp_dp["tp"] == tp["tp"] / 2  # half the windows through the same blocks
    assert tp_dp["dp"] > 0 == tp["dp"]


def test_expert_parallelism_sends_an_even_spread_of_rows_and_its_experts_leave_ddp():
    model = Model(4, 2, 32, vocab=65, block=32, n_experts=4)
    one, two = (per_dimension(model, Layout(2, ep=e, batch=8, dtype="fp32")) for e in (1, 2))
    assert one["ep"] == 0 < one["routing"]  # without ep: no rows sent, the counts still summed
    rows = 8 * 32 * 2 * 32 * 4 / 2  # tokens x top_k rows of C fp32, half of them to the other
    assert two["ep"] == 4 * 4 * rows  # 4 blocks: dispatch + combine, forward + backward
    experts = 4 * 2 * 4 * 32 * 64 * 4  # 4 blocks' two (E, C, H) matrices: DDP's no more
    assert one["dp"] - two["dp"] == experts
    ac = per_dimension(model, Layout(2, ep=2, batch=8, dtype="fp32", ac="full"))
    assert ac["ep"] == 4 * 6 * rows  # a recomputed forward exchanges again


def test_expert_flags_that_cannot_run_are_refused_in_one_line():
    from mingpt_ddp.planner.__main__ import check_experts

    dense = Model(4, 2, 32)
    with pytest.raises(ConfigError, match="--ep 2 shares out experts and the model has none"):
        check_experts(dense, Layout(dp_shard=2, ep=2))
    with pytest.raises(ConfigError, match=r"--ep 4 must divide .* \(2\) and --experts \(8\)"):
        check_experts(Model(4, 2, 32, n_experts=8), Layout(dp_shard=2, ep=4))


def test_a_schedules_bubble_is_its_textbook_one_or_its_tables():
    from mingpt_ddp.planner.schedule import bubble

    one = Layout(pp=4, microbatches=8, schedule="1f1b")
    assert bubble(one) == 3 / 11  # (p - 1) / (m + p - 1)
    looped = Layout(pp=2, microbatches=4, schedule="interleaved1f1b", stages_per_rank=2)
    assert bubble(looped) == pytest.approx(1 / 9)  # from the table: (p - 1) / (v m + p - 1)
    assert bubble(Layout(pp=2, microbatches=4, schedule="zbv")) < bubble(looped)


def test_pipeline_flags_the_project_cannot_run_are_refused_in_one_line():
    from mingpt_ddp.planner.__main__ import chosen, options

    def refusal(*flags):
        with pytest.raises(ConfigError) as e:
            chosen(options().parse_args(["--gpus", "8", *flags]), 8)
        return str(e.value)

    assert "raise --microbatches to 4" in refusal("--pp", "4", "--microbatches", "2")
    ddp = refusal("--pp", "2", "--schedule", "zbv", "--parallel", "ddp")
    assert ddp.startswith("--schedule zbv splits backward past DDP's") and "--parallel fsdp" in ddp


def test_a_pipeline_ranks_peak_is_a_moment_of_its_schedule():
    from mingpt_ddp.planner.schedule import StageCost, actions, walk

    # torch's own tables for rank 0: GPipe runs every forward first, 1F1B interleaves
    gpipe, one = (Layout(pp=2, microbatches=4, schedule=s) for s in ("gpipe", "1f1b"))
    assert [k for k, _ in actions(gpipe)] == list("FFFFBBBB")
    assert [k for k, _ in actions(one)] == list("FFBFBFBB")
    zbv = actions(Layout(pp=2, microbatches=4, schedule="zbv"))
    assert {s for _, s in zbv} == {0, 3} and ("I", 3) in zbv and ("W", 0) in zbv  # a V
    # 10 bytes held per microbatch, 1 kept after its backward, gradients of 100 made by the
    # first backward (not whole during it), 5 passing at each backward
    cost = {0: StageCost(held=10, kept=1, pending=0, grads=100, first=True)}
    peak = dict(temporaries=5, gradients=100)
    assert walk(actions(gpipe), cost, 5) == dict(activations=31, **peak)  # 4 in flight - 1
    assert walk(actions(one), cost, 5) == dict(activations=22, **peak)  # 2 in flight + kept
    # a split backward: the input half keeps its pending bytes until the weight half
    split = {0: StageCost(10, 0, 7, 0), 1: StageCost(10, 0, 7, 0)}
    steps = [("F", 0), ("F", 1), ("I", 1), ("F", 0), ("W", 1)]
    assert walk(steps, split, 0) == dict(activations=37, temporaries=0, gradients=0)


@pytest.mark.slow
def test_a_search_of_8_gpus_answers_every_layout_best_first(tmp_path):
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "mingpt_ddp.planner", "--model", "gpt2", "--gpus", "8"]
    cmd += ["--gpu-memory", "80", "--search", "--out", out]
    result = run_python(cmd, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plan | gpt2: 124.4M parameters" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) > 20 and all(
        {"degrees", "fits", "sent_bytes_per_step"} <= set(r) for r in rows
    )
    assert all(r["peak_bytes_per_rank"] > 0 and r["degrees"]["tp"] >= 1 for r in rows)
    # traced: every layout one process runs (8 FSDP shards, 8 DDP replicas), the best 3 at most
    assert [r["memory_from"] for r in rows].count("traced") == 2
    # pipelines on 1F1B, interleaved 1F1B and zero bubble's V (never over DDP's replicas)
    names = [r["layout"] for r in rows]
    assert {"dp4 fsdp x pp2 1f1b m=4", "dp4 fsdp x pp2 zbv m=4"} <= set(names)
    assert "dp4 fsdp x pp2 interleaved1f1b m=4 v=2" in names
    assert not [n for n in names if "ddp" in n and "zbv" in n]
    order = [(not r["fits"], r["step_time_s"]) for r in rows]
    assert order == sorted(order)
    traced = next(r for r in rows if r["memory_from"] == "traced")
    assert traced["memory_by_category"]["optimizer"] > 0  # AdamW's state, made in step 1


@pytest.mark.slow
def test_degrees_that_do_not_divide_the_gpus_are_refused_in_one_line():
    cmd = [sys.executable, "-m", "mingpt_ddp.planner", "--gpus", "8", "--tp", "3"]
    result = run_python(cmd, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: the degrees multiply to 3, which does not divide --gpus 8"
    )
