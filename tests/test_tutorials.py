"""The tutorials run under torchrun on CPU and teach what they claim."""

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
    for name in (
        "send / recv",
        "broadcast",
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "barrier",
    ):
        assert f"== {name}" in out
    assert "[rank 3] before [30.0, 31.0] -> after [0.0, 1.0]" in out  # broadcast from rank 0
    assert out.count("-> after [6.0, 4.0]") == 4  # all_reduce: 0+1+2+3 and 1+1+1+1 on every rank
    # slice 2 is the sum over ranks r of (2 + 100 r) = 4 * 2 + 100 * (0 + 1 + 2 + 3)
    assert "[rank 2] contributed [200.0, 201.0, 202.0, 203.0] -> keeps slice 2: [608.0]" in out


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


def test_single_process_and_ddp_versions_learn_the_same_line():
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
