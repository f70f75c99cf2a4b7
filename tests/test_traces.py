"""trainer_config.profile_steps: every rank of a DDP job writes a Chrome trace of the traced
steps, and in it DDP's overlap is seen, not assumed: a gloo all-reduce of a gradient bucket runs
while autograd still computes the gradients of earlier layers."""

import gzip
import json

import pytest
from conftest import run_main, tiny_overrides

from benchmarks.common import TINY_MODEL

pytestmark = pytest.mark.slow


def spans(path, keep) -> list[tuple[float, float, str]]:
    events = json.load(gzip.open(path))["traceEvents"]
    return [
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("ph") == "X" and keep(e["name"])
    ]


def test_a_ddp_trace_shows_an_all_reduce_overlapping_backward_on_every_rank(shakespeare, tmp_path):
    # The default model (gpt-micro): its gradients fill DDP's first 1 MB bucket and another.
    tiny = {f"{k}={v}" for k, v in TINY_MODEL.items() if k.startswith("gpt_config")}
    args = [a for a in tiny_overrides(shakespeare, tmp_path, max_steps=5) if a not in tiny]
    result = run_main(args + ["trainer_config.profile_steps=2"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"trace | 2 steps | every rank's in {tmp_path / 'traces'}" in result.stdout
    for rank in range(2):
        path = tmp_path / "traces" / f"rank{rank}.json.gz"
        reduces = spans(path, lambda n: n == "gloo:all_reduce")
        backward = spans(path, lambda n: n.startswith("autograd::engine::evaluate_function: "))
        assert len(reduces) >= 4, reduces  # 2 steps x at least 2 buckets
        # an autograd op that starts after an all-reduce began and before it ended: compute
        # and communication at once (a Backward op of a layer nearer the input)
        overlapping = [
            name for start, end, _ in reduces for b0, _, name in backward if start <= b0 < end
        ]
        assert any("Backward" in name for name in overlapping), (rank, reduces[:4])
