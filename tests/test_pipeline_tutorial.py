"""tutorials/pipeline_by_hand.py: a two-stage pipeline by send/recv gives one process's step, its
schedules hold the activations they should, and its bubble lines print the right formula.
Times are printed, never asserted: they depend on the machine and on what else runs on it."""

import re

import pytest
from conftest import REPO, main_command, run

pytestmark = pytest.mark.slow
MS = (1, 2, 4, 8)
P = 2
CHECK = re.compile(
    r"\[rank (\d)\] (GPipe|1F1B) m=(\d+): \|diff\| grads (\S+?)(?:, loss (\S+))?"
    r" \| held at peak: (\d+) of (\d+) microbatches"
)
BUBBLE = re.compile(
    r"m=(\d+): formula \(p-1\)/\(m\+p-1\) = (\d+)/(\d+) = ([\d.]+);"
    r" measured idle: rank 0 ([\d.]+), rank 1 ([\d.]+)\n"
    r"  rank 0 \|([^|\n]*)\|\n  rank 1 \|([^|\n]*)\|\n"
    r"  step ([\d.]+) ms = ([\d.]+) \(m\+p-1\)\(t_F\+t_B\) ([+-][\d.]+) unequal op times"
    r" ([+-][\d.]+) send/recv, Python, OS"
)


@pytest.fixture(scope="module")
def output() -> str:
    script = REPO / "tutorials" / "pipeline_by_hand.py"
    result = run(main_command(P, [], script=script, torchrun=True), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_pipeline_step_is_one_process_step_and_each_schedule_holds_what_it_should(output):
    checks = CHECK.findall(output)
    seen = {(name, int(m), int(rank)) for rank, name, m, *_ in checks}
    assert seen == {(s, m, r) for s in ("GPipe", "1F1B") for m in MS for r in range(P)}
    assert len(checks) == len(seen)
    for rank, name, m, grads, loss, peak, of in checks:
        rank, m, peak = int(rank), int(m), int(peak)
        assert int(of) == m
        assert float(grads) <= 1e-5
        assert (loss != "") == (rank == P - 1)  # the loss lives on the last stage only
        if loss:
            assert float(loss) <= 1e-5
        if name == "GPipe":
            assert peak == m  # every forward before any backward: all m held at once
        else:
            assert peak == min(m, P - rank) <= P  # 1F1B frees one as it starts the next
    assert output.count("all checks passed: True") == P
    # the floor of a hand-off, measured once: (MICRO, H) fp32 is 32 x 768 x 4 bytes = 96 KiB
    assert re.search(r"one hand-off of a \(32, 768\) activation \(96 KiB\).*: [\d.]+ ms", output)


def test_each_schedule_prints_the_bubble_formula_beside_the_measured_idle_share(output):
    gpipe, one_f_one_b = output.split("== GPipe: the bubble", 1)[1].split("== 1F1B: the bubble")
    for section in (gpipe, one_f_one_b):
        found = BUBBLE.findall(section)
        assert [int(f[0]) for f in found] == list(MS)
        for m, num, den, value, idle0, idle1, line0, line1, step, formula, op, rest in found:
            m = int(m)
            assert (int(num), int(den)) == (P - 1, m + P - 1)
            assert float(value) == round((P - 1) / (m + P - 1), 3)
            assert all(0 <= float(idle) < 1 for idle in (idle0, idle1))
            assert len(line0) == len(line1) == 80  # both ranks on one time axis
            assert all("F" in line and "B" in line for line in (line0, line1))
            # the step's length is split into three parts that add up (to the printed 0.1 ms)
            assert abs(float(step) - float(formula) - float(op) - float(rest)) < 0.25
