"""Snapshots written by older code still resume: one of each layout (a single file, FSDP's DCP
shards, DeepSpeed ZeRO-2's files, a 2-stage pipeline's, a 2-way tensor-parallel job's), made by
tests/fixtures/make_old_snapshots.py at the commit its README row names, is resumed by today's code
and trains on. Each resumes in another layout than the one that wrote it (ELSEWHERE: one format
for every layout, any layout resumes any other), DeepSpeed's with DeepSpeed (its engine's files
are partitioned per rank)."""

import shutil

import pytest
from conftest import REPO, run_main, tiny_overrides
from fixtures.make_old_snapshots import LAYOUTS  # each layout's overrides, as written

pytestmark = pytest.mark.slow
FIXTURES = REPO / "tests" / "fixtures" / "old_snapshots"


# The layout each resumes in: another one than wrote it (the same for DeepSpeed).
ELSEWHERE = {
    "single": ["mesh_config.tp=2"],
    # FSDP's DCP shards name the tied matrix once (the embedding); the pipeline's last stage
    # holds it as the head and reads it under the embedding's name.
    "fsdp": ["mesh_config.pp=2", "pipeline_config.microbatches=2"],
    "deepspeed": LAYOUTS["deepspeed"],
    "pipeline": ["parallel=fsdp"],
    "tensor": ["mesh_config.cp=2"],
}


@pytest.mark.parametrize("layout, overrides", ELSEWHERE.items(), ids=list(ELSEWHERE))
def test_an_old_snapshot_resumes_and_trains_on(layout, overrides, shakespeare, tmp_path):
    if layout == "deepspeed":
        pytest.importorskip("deepspeed", reason='pip install -e ".[deepspeed]"')
    shutil.copytree(FIXTURES / layout, tmp_path / "snapshots")
    result = run_main(
        [
            *overrides,
            *tiny_overrides(shakespeare, tmp_path, max_steps=6, save_every=2, eval_every=6),
        ],
        nproc=2,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resume | step 4 |" in result.stdout
    assert "done | step 6 |" in result.stdout
