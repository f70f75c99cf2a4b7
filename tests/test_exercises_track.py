"""The build-it-yourself track (tutorials/exercises/, docs/build-it-yourself.md), graded as a
learner would grade it, one launch per family: the reference solutions pass every check, the
stubs fail with a message that says what to write (no traceback), and each planted wrong
solution fails, named by the check that was built to catch it."""

import json
import sys

import pytest
from conftest import REPO, run_python

pytestmark = pytest.mark.slow
GRADE = REPO / "tutorials" / "exercises" / "grade.py"
EXERCISES = [
    "ring_allreduce",
    "ddp_buckets",
    "zero1",
    "fsdp_layer",
    "one_f_one_b",
    "tensor_parallel",
    "ring_attention",
]
# The check each planted wrong solution must fail first (tutorials/exercises/planted/).
CAUGHT_BY = {
    "ring_allreduce": "equal to torch's dist.all_reduce",  # a chunk index off by one
    "ddp_buckets": "overlap",  # buckets reduced after backward: right numbers, no overlap
    "zero1": "state split",  # every rank keeps the whole AdamW state: right numbers
    "fsdp_layer": "bytes",  # an all-reduce in place of the reduce-scatter: right numbers
    "one_f_one_b": "holds at most 2 microbatches",  # GPipe's order: right gradients
    "tensor_parallel": "input gradient",  # no f: each rank keeps its share of x.grad
    "ring_attention": "equal to full causal attention",  # blocks' softmaxes averaged
}


def grade(tmp_path, *flags) -> tuple[int, str, list[dict]]:
    out = tmp_path / "rows.json"
    result = run_python([sys.executable, GRADE, "--all", *flags, "--out", out], timeout=240)
    rows = json.loads(out.read_text())
    assert [row["exercise"] for row in rows] == EXERCISES, result.stdout
    return result.returncode, result.stdout + result.stderr, rows


def test_the_reference_solutions_pass_every_check(tmp_path):
    code, output, rows = grade(tmp_path, "--solutions")
    assert code == 0, output[-3000:]
    for row in rows:
        assert row["passed"] and row["checks"], row
        assert all(check["passed"] for check in row["checks"]), row
        assert row["message"] == f"all {len(row['checks'])} checks held"
    assert "7 of 7 exercises passed" in output


def test_the_stubs_fail_saying_what_to_write_without_a_traceback(tmp_path):
    code, output, rows = grade(tmp_path)
    assert code != 0
    for row in rows:
        assert not row["passed"], row
        assert row["message"].startswith("not written yet: write "), row
        assert f"tutorials/exercises/{row['exercise']}.py" in row["message"]
    assert "Traceback" not in output


def test_each_planted_wrong_solution_is_caught_by_its_own_check(tmp_path):
    code, output, rows = grade(tmp_path, "--planted")
    assert code != 0
    for row in rows:
        assert not row["passed"], row
        first = next(check for check in row["checks"] if not check["passed"])
        assert first["name"].startswith(CAUGHT_BY[row["exercise"]]), row
        assert row["message"].startswith(first["name"]), row
    assert "Traceback" not in output
