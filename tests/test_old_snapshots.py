"""Snapshots written by older code still resume: one of each layout (a single file, FSDP's DCP
shards, DeepSpeed ZeRO-2's files), made by tests/fixtures/make_old_snapshots.py at the commit its
README names, is resumed by today's code and trains on."""

import shutil

import pytest
from conftest import REPO, run_main, tiny_overrides

pytestmark = pytest.mark.slow
FIXTURES = REPO / "tests" / "fixtures" / "old_snapshots"


@pytest.mark.parametrize(
    "layout, group",
    [("single", "parallel=ddp"), ("fsdp", "parallel=fsdp"), ("deepspeed", "parallel=zero2")],
)
def test_an_old_snapshot_resumes_and_trains_on(layout, group, shakespeare, tmp_path):
    if layout == "deepspeed":
        pytest.importorskip("deepspeed", reason='pip install -e ".[deepspeed]"')
    shutil.copytree(FIXTURES / layout, tmp_path / "snapshots")
    result = run_main(
        [group, *tiny_overrides(shakespeare, tmp_path, max_steps=6, save_every=2, eval_every=6)],
        nproc=2,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resume | step 4 |" in result.stdout
    assert "done | step 6 |" in result.stdout
