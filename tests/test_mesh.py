"""One grid of ranks (mesh_config): the degrees and their old keys, the grid's coordinates, and one
snapshot format that any layout resumes from any other."""

import json

import pytest
from conftest import run_main, tiny_overrides

from mingpt_ddp.config.mesh import MeshConfig, data_degrees, model_degrees
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.parallel.mesh import ParallelDims


def test_the_old_degree_keys_are_aliases_and_a_conflict_names_both():
    assert model_degrees(MeshConfig(), {"tp": 2}) == {"tp": 2, "cp": 1, "pp": 1}
    assert model_degrees(MeshConfig(pp=2), {"pp": 2}) == {"tp": 1, "cp": 1, "pp": 2}
    with pytest.raises(ConfigError, match="mesh_config.tp=2 and tensor_config.degree=4"):
        model_degrees(MeshConfig(tp=2), {"tp": 4})


def test_the_data_parallel_degrees_take_the_rest_by_the_parallel_mode():
    assert data_degrees(MeshConfig(), 4, "ddp") == (4, 1)  # replicas
    assert data_degrees(MeshConfig(), 4, "fsdp") == (1, 4)  # shards
    assert data_degrees(MeshConfig(dp_replicate=2), 4, "fsdp") == (2, 2)  # HSDP
    with pytest.raises(ConfigError, match="dp_shard=2 shards parameters with FSDP2"):
        data_degrees(MeshConfig(dp_shard=2), 4, "ddp")
    with pytest.raises(ConfigError, match="must equal the 4 data-parallel ranks"):
        data_degrees(MeshConfig(dp_replicate=3), 4, "fsdp")


def test_the_grid_puts_tp_innermost_and_pp_outermost():
    dims = ParallelDims.of(16, {"tp": 2, "cp": 2, "pp": 2}, MeshConfig(), "ddp")
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == (2, 2, 1, 2, 2)
    assert [dims.coordinates(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert [dims.coordinates(r)["cp"] for r in range(4)] == [0, 0, 1, 1]
    assert [dims.coordinates(r)["dp"] for r in (0, 4, 8, 12)] == [0, 1, 0, 1]
    assert [dims.coordinates(r)["pp"] for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    with pytest.raises(ConfigError, match="mesh_config.tp=2 x mesh_config.pp=2 = 4 ranks"):
        ParallelDims.of(6, {"tp": 2, "cp": 1, "pp": 2}, MeshConfig(), "ddp")


def losses(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["train_loss"] for r in map(json.loads, lines) if "train_loss" in r]


@pytest.mark.slow
def test_a_run_handed_from_a_pipeline_to_tensor_parallel_to_one_process(shakespeare, tmp_path):
    """2 pipeline stages (to step 2), then 2-way tensor parallelism (to 4), then one process (to
    6), each resuming the last one's snapshot with the same global batch (4 windows): the same
    losses as one process throughout."""
    settings = dict(save_every=2, eval_every=100, log_every=1)
    legs = [
        (2, ["mesh_config.pp=2", "pipeline_config.microbatches=2"], 2, "pipeline 2 stages"),
        (2, ["mesh_config.tp=2"], 4, "tensor parallel 2 x 1 replica"),
        (0, [], 6, "| ddp |"),
    ]
    for nproc, layout, steps, words in legs:
        args = tiny_overrides(shakespeare, tmp_path / "handed", max_steps=steps, **settings)
        result = run_main(args + layout, nproc=nproc)
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        assert words in result.stdout
        assert steps == 2 or f"resume | step {steps - 2} |" in result.stdout
    straight = tiny_overrides(shakespeare, tmp_path / "straight", max_steps=6, **settings)
    assert run_main(straight).returncode == 0
    handed, alone = losses(tmp_path / "handed"), losses(tmp_path / "straight")
    assert len(handed) == len(alone) == 6
    assert max(abs(a - b) for a, b in zip(handed, alone)) <= 1e-4, (handed, alone)
