"""The tutorials run under torchrun on CPU and teach what they claim."""

import ast
import re
import subprocess
import sys

import pytest
from conftest import REPO, main_command, run

pytestmark = pytest.mark.slow
TUTORIALS = REPO / "tutorials"


def torchrun(script: str, nproc: int) -> str:
    result = run(main_command(nproc, [], script=TUTORIALS / script, torchrun=True), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_collectives_show_every_rank_before_and_after():
    out = torchrun("collectives.py", 4)
    # point to point, then one to all / all to one, then all to all: the order a learner reads
    order = [
        "######## 1. point to point",
        "== send / recv",
        "######## 2. one to all",
        "== broadcast",
        "== scatter",
        "== reduce (SUM, dst=0)",
        "== gather (dst=0)",
        "######## 3. all to all",
        "== all_reduce",
        "== all_gather",
        "== reduce_scatter",
        "== all_to_all",
        "== barrier",
    ]
    assert [out.index(h) for h in order] == sorted(out.index(h) for h in order)
    assert out.count("   in training: ") == 10  # every collective says where training uses it
    assert "[rank 3] before [30.0, 31.0] -> after [0.0, 1.0]" in out  # broadcast from rank 0
    # scatter: rank r receives row r of rank 0's 4 x 2 table; the others held nothing before
    assert (
        "[rank 0] before [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]] -> after [0.0, 1.0]"
        in out
    )
    assert "[rank 2] before nothing -> after [4.0, 5.0]" in out
    # reduce: only dst holds the sum (0+1+2+3, 1+1+1+1); gloo left partial sums elsewhere
    assert "[rank 0] before [0.0, 1.0] -> after [6.0, 4.0]   (the sum)" in out
    assert out.count("(scratch, not the result)") == 3
    # gather: dst holds every rank's [r, 10 r] in rank order, the others nothing
    assert (
        "[rank 0] contributed [0.0, 0.0] -> "
        "holds [[0.0, 0.0], [1.0, 10.0], [2.0, 20.0], [3.0, 30.0]]" in out
    )
    assert "[rank 3] contributed [3.0, 30.0] -> holds nothing" in out
    assert out.count("-> after [6.0, 4.0]   (sum of ranks") == 4  # all_reduce: on every rank
    # slice 2 is the sum over ranks r of (2 + 100 r) = 4 * 2 + 100 * (0 + 1 + 2 + 3)
    assert "[rank 2] contributed [200.0, 201.0, 202.0, 203.0] -> keeps slice 2: [608.0]" in out
    # all_to_all: rank i sends 10 i + j to rank j, so rank j receives [j, 10 + j, 20 + j, 30 + j]
    assert (
        "[rank 1] sent [10.0, 11.0, 12.0, 13.0] -> received [1.0, 11.0, 21.0, 31.0] "
        "(all_to_all_single agrees: True)" in out
    )
    assert out.count("(all_to_all_single agrees: True)") == 4


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_ring_all_reduce_matches_dist_all_reduce_and_the_byte_formula(nproc):
    out = torchrun("ring_allreduce.py", nproc)
    assert len(re.findall(r"torch.int64 +matches dist.all_reduce: exactly", out)) == nproc
    assert (
        len(re.findall(r"torch.float32 +matches dist.all_reduce: within float tolerance", out))
        == nproc
    )
    for sent, formula in re.findall(r"sent (\d+) bytes, 2\(N-1\)/N x size = (\d+)", out):
        assert (
            abs(int(sent) - int(formula)) <= 8 * nproc
        )  # unequal chunks: off by at most a few elements


@pytest.mark.parametrize("nproc", [2, 4])
def test_parameter_server_sends_more_through_rank_0_than_the_ring(nproc):
    out = torchrun("parameter_server.py", nproc)
    line = r"\[rank {}\] {} +sent +([\d.]+) MiB +received +([\d.]+) MiB"
    star0 = [float(v) for v in re.search(line.format(0, "parameter server"), out).groups()]
    star1 = [float(v) for v in re.search(line.format(1, "parameter server"), out).groups()]
    ring0 = [float(v) for v in re.search(line.format(0, "ring"), out).groups()]
    assert star0 == pytest.approx([4 * (nproc - 1)] * 2, rel=0.01)  # rank 0: (N-1) x 4 MiB each way
    assert star1 == pytest.approx([4, 4], rel=0.01)  # everyone else: one tensor each way
    assert ring0 == pytest.approx(
        [4 * 2 * (nproc - 1) / nproc] * 2, rel=0.01
    )  # 2(N-1)/N x 4 MiB each way


def per_rank(out: str, what: str) -> list[tuple[str, str]]:
    """(rank, the rest) of each `[rank r] step 1 <what>...` line, in the order printed."""
    return re.findall(rf"^\[rank (\d)\] step 1 {re.escape(what)}(.*)$", out, re.M)


def test_single_process_and_ddp_versions_learn_the_same_line_and_ranks_show_what_they_hold():
    single = subprocess.run(
        [sys.executable, str(TUTORIALS / "single_to_ddp.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert single.returncode == 0, single.stderr
    ddp = torchrun("single_to_ddp.py", 2)
    fit = re.compile(r"y = ([\d.-]+) x \+ ([\d.-]+)")
    (w1, b1), (w2, b2) = fit.search(single.stdout).groups(), fit.search(ddp).groups()
    assert abs(float(w1) - 3) < 0.05 and abs(float(b1) - 1) < 0.05
    assert abs(float(w2) - 3) < 0.05 and abs(float(b2) - 1) < 0.05
    # one process: all 32 samples of the global batch
    ((_, alone),) = per_rank(single.stdout, "trained on samples ")
    assert len(ast.literal_eval(alone)) == 32
    # two ranks, each line once and in rank order: disjoint halves of the global batch...
    samples = per_rank(ddp, "trained on samples ")
    assert [r for r, _ in samples] == ["0", "1"]
    halves = [set(ast.literal_eval(s)) for _, s in samples]
    assert [len(h) for h in halves] == [16, 16] and not halves[0] & halves[1]
    losses = [float(v) for _, v in per_rank(ddp, "local loss ")]
    assert len(losses) == 2 and losses[0] != losses[1]  # ...so different local losses...
    # ...but the same gradient after backward (DDP averaged it) and the same weights after step
    for what in ("gradient after backward: ", "after opt.step(): "):
        lines = per_rank(ddp, what)
        assert [r for r, _ in lines] == ["0", "1"] and lines[0][1] == lines[1][1], what
    fits = re.findall(r"^\[rank (\d)\] world size 2: (y = .*)$", ddp, re.M)
    assert [r for r, _ in fits] == ["0", "1"] and fits[0][1] == fits[1][1]


def test_spawn_launch_trains_main_py_without_torchrun_and_fails_loudly_on_a_bad_key(
    shakespeare, tmp_path
):
    script = str(TUTORIALS / "spawn_launch.py")
    args = [
        f"data_config.path={shakespeare}",
        "trainer_config.max_steps=10",
        "trainer_config.eval_every=10",
        f"trainer_config.run_dir={tmp_path}",
        "trainer_config.sample_chars=0",
        "gpt_config.n_layer=1",
        "gpt_config.n_embd=32",
        "gpt_config.n_head=2",
    ]
    result = subprocess.run(
        [sys.executable, script, "--nproc", "2", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "job | world size 2 | backend gloo" in result.stdout and "done | step 10" in result.stdout
    )
    bad = subprocess.run(
        [sys.executable, script, "--nproc", "2", "trainer_config.max_step=3"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert bad.returncode == 1 and bad.stderr.strip() == (
        "error: Could not override 'trainer_config.max_step'. "
        "(Key 'max_step' not in 'TrainerConfig')"
    )
