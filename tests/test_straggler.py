"""The straggler report (mingpt_ddp/runtime/straggler.py): a rank slower than the others is named
in one line with where its time went; even ranks, and small differences, name nobody."""

import re

import pytest
import torch

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.runtime.straggler import straggler_line


def test_the_rank_whose_own_work_exceeds_the_others_is_named_with_where_its_time_went():
    #        (data, forward, step) seconds a step, on ranks 0..3: rank 2 reads slowly
    times = [
        (0.001, 0.004, 0.060),
        (0.002, 0.004, 0.060),
        (0.050, 0.004, 0.061),
        (0.001, 0.005, 0.060),
    ]
    line = straggler_line(times, 1.5, 11, 20)
    assert line.startswith("straggler | rank 2 is 9.0x slower than the others over steps 11-20")
    assert "its step: data 50.0 ms, forward 4.0 ms, the rest 7.0 ms" in line
    assert "the others': data 1.0 ms, forward 4.0 ms, the rest 55.0 ms" in line  # waiting for it
    assert "\n" not in line


@pytest.mark.parametrize(
    "times",
    [
        [(0.001, 0.004, 0.060)] * 4,  # even ranks
        [(0.001, 0.004, 0.060), (0.001, 0.006, 0.060)],  # 1.4x: below the factor
        [(0.0001, 0.0004, 0.060), (0.001, 0.004, 0.060)],  # 10x, but 4.5 ms of a 60 ms step
    ],
)
def test_even_ranks_and_small_differences_name_nobody(times):
    assert straggler_line(times, 1.5, 1, 10) == ""


def test_the_factor_is_above_one_or_off():
    from mingpt_ddp.config.trainer import TrainerConfig

    with pytest.raises(ConfigError, match="straggler_factor must be above 1 .or 0: off., got 0.5"):
        TrainerConfig(straggler_factor=0.5)
    TrainerConfig(straggler_factor=0)


def test_only_training_forwards_are_timed():
    from types import SimpleNamespace

    from mingpt_ddp.runtime.straggler import StepTimes

    model = torch.nn.Linear(4, 4)
    times = StepTimes(1.5, SimpleNamespace(world_size=1, device="cpu"), None, model)
    model(torch.randn(2, 4))
    trained = times.forward_s
    with torch.no_grad():  # evaluation, sampling
        model(torch.randn(2, 4))
    assert trained > 0 and times.forward_s == trained


@pytest.mark.slow
def test_a_rank_slowed_by_the_fault_knob_is_named_within_its_window(shakespeare, tmp_path):
    """2 ranks under torchrun (DDP), rank 1 reading each batch 50 ms late from step 15: the
    report over steps 16-25 names it, the one over 6-15 (before the fault) nobody; steps 1-5 (the
    first window) and 26-30 (fewer than 10 at the end) are not judged."""
    from conftest import run_faulty, tiny_overrides

    args = tiny_overrides(shakespeare, tmp_path, max_steps=30, log_every=5, save_every=100)
    out = run_faulty(args, "slow:1:15")
    named = re.findall(r"straggler \| rank (\d) is ([\d.]+)x slower .* over steps (\d+)-(\d+)", out)
    assert [(rank, first, last) for rank, _, first, last in named] == [("1", "16", "25")], out
    assert float(named[0][1]) > 2
