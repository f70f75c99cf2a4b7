"""The bug zoo (tutorials/bug_zoo.py): every buggy variant is caught by its check, and the
project's code passes the same check.

The exhibits one process can show run here, in process; those that need ranks run in the one
subprocess this file starts, `bug_zoo.py --check --out`, which runs the whole zoo (its 2-rank
gloo group included) and whose report the rank tests read.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "tutorials"))

import bug_zoo  # noqa: E402 - needs tutorials/ on sys.path first
from bugs.base import load_ids  # noqa: E402

LOCAL = [name for name, bug in bug_zoo.BUGS.items() if bug.ranks == 1]
RANKED = [name for name, bug in bug_zoo.BUGS.items() if bug.ranks > 1]


@pytest.fixture(scope="module")
def corpus(shakespeare):
    """The exhibits' ids and vocabulary size, with one thread, as bug_zoo.main runs them (the
    setting restored after this file's tests)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_ids(shakespeare)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", LOCAL)
def test_a_one_process_bug_fails_its_check_where_the_project_passes_it(name, corpus):
    with torch.random.fork_rng(devices=[]):  # the resume exhibits seed the global generator
        row = bug_zoo.BUGS[name].exhibit(*corpus)
    assert row.bug == name
    assert row.caught, f"{name}: the check missed the bug: {row.symptom}"
    assert row.project_passes, f"{name}: the project fails its own check: {row.symptom}"


@pytest.fixture(scope="module")
def zoo(shakespeare, tmp_path_factory):
    """`bug_zoo.py --check --out` on the whole zoo: (its exit code, stdout, report)."""
    out = tmp_path_factory.mktemp("bug-zoo") / "bug_zoo.json"
    script = REPO / "tutorials" / "bug_zoo.py"
    result = subprocess.run(
        [sys.executable, str(script), "--check", "--out", str(out), "--data", str(shakespeare)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.is_file(), result.stderr[-3000:]
    return result.returncode, result.stdout, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", RANKED)
def test_a_two_rank_bug_fails_its_check_where_the_project_passes_it(name, zoo):
    _, _, report = zoo
    (row,) = [row for row in report["rows"] if row["bug"] == name]
    assert row["caught"], f"{name}: the check missed the bug: {row['symptom']}"
    assert row["project_passes"], f"{name}: the project fails its own check: {row['symptom']}"


@pytest.mark.slow
def test_check_writes_every_bug_caught_and_the_project_passing_and_exits_0(zoo):
    code, stdout, report = zoo
    assert [row["bug"] for row in report["rows"]] == list(bug_zoo.BUGS)
    for row in report["rows"]:
        assert {"bug", "symptom", "check", "caught", "project_passes"} <= row.keys()
        assert row["caught"] is True and row["project_passes"] is True, row
    assert code == 0, stdout[-3000:]
    # one line a bug, naming it, its symptom and its check
    lines = [line for line in stdout.splitlines() if line.split(" ", 1)[0] in bug_zoo.BUGS]
    assert len(lines) == len(bug_zoo.BUGS) and all("| check: " in line for line in lines)


def defined_names() -> set[str]:
    """Every function and class the project defines, also as module.name (trainer.step), and
    every method as Class.method."""
    names = set()
    for path in [
        REPO / "trainer.py",
        REPO / "char_dataset.py",
        *(REPO / "mingpt_ddp").rglob("*.py"),
    ]:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names |= {node.name, f"{path.stem}.{node.name}"}
            if isinstance(node, ast.ClassDef):
                names |= {
                    f"{node.name}.{item.name}"
                    for item in node.body
                    if isinstance(item, ast.FunctionDef)
                }
    return names


def test_every_bug_names_the_project_code_that_avoids_it():
    named = {s for bug in bug_zoo.BUGS.values() for s in bug.avoided_by.split(", ")}
    assert named <= defined_names(), named - defined_names()
