"""trainer_config.profile_steps: every rank of a DDP job writes a Chrome trace of the traced
steps, and in it DDP's overlap is seen, not assumed: a gloo all-reduce of a gradient bucket runs
while autograd still computes the gradients of earlier layers; benchmarks/timeline.py draws the
traces as text, a row per rank."""

import gzip
import json
import re
import sys

import pytest
from conftest import REPO, run_main, run_python, tiny_overrides

from benchmarks.common import TINY_MODEL

pytestmark = pytest.mark.slow


def spans(path, keep) -> list[tuple[float, float, str]]:
    events = json.load(gzip.open(path))["traceEvents"]
    return [
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("ph") == "X" and keep(e["name"])
    ]


def test_a_ddp_trace_shows_all_reduces_issued_in_backward_and_overlapping_it(shakespeare, tmp_path):
    # The default model (gpt-micro): its gradients fill DDP's first 1 MB bucket and another.
    tiny = {f"{k}={v}" for k, v in TINY_MODEL.items() if k.startswith("gpt_config")}
    args = tiny_overrides(shakespeare, tmp_path, max_steps=6, save_every=4)  # a save traced
    args = [a for a in args if a not in tiny]
    result = run_main(args + ["trainer_config.profile_steps=3"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"trace | 3 steps | every rank's in {tmp_path / 'traces'}" in result.stdout
    seen = []  # per rank: a Backward op computing while an all-reduce is in flight
    for rank in range(2):
        path = tmp_path / "traces" / f"rank{rank}.json.gz"
        reduces = spans(path, lambda n: n == "gloo:all_reduce")  # on gloo's own thread
        issued = spans(path, lambda n: n == "c10d::allreduce_")  # by DDP's hook, in backward
        backward = spans(path, lambda n: "Backward" in n and n.startswith("autograd::engine"))
        assert len(reduces) >= 2 * 3, reduces  # 3 steps x at least 2 buckets
        # DDP issues a bucket's all-reduce while backward still runs: in every traced step a
        # Backward op of that step ends after one, on every rank, however busy the machine.
        for s0, s1, _ in spans(path, lambda n: n.startswith("ProfilerStep#")):
            ends = [b1 for b0, b1, _ in backward if s0 <= b0 < s1]
            assert any(s0 <= a < max(ends) for a, _, _ in issued), (rank, s0)
        # In flight from its issue to the end of gloo's work on it (gloo's thread may wait for a
        # core): a Backward op of a layer nearer the input that starts then overlaps it.
        flights = [(a, min(e for _, e, _ in reduces if e >= a)) for a, _, _ in issued]
        seen.append(any(a < b0 < z for a, z in flights for b0, _, _ in backward))
    assert any(seen), seen  # (on a loaded machine a rank's may finish first; not both, 3 steps)

    # The project's own regions (trainer.step's, the snapshot's), named in every rank's trace.
    for rank in range(2):
        names = {n for _, _, n in spans(tmp_path / "traces" / f"rank{rank}.json.gz", str)}
        own = {"micro-step 0", "forward", "backward", "gradient sync", "optimizer step"}
        assert own | {"snapshot"} <= names, sorted(own - names)

    # The same traces as a text timeline (benchmarks/timeline.py): a row per rank on one clock,
    # compute on each, the all-reduces drawn.
    timeline = REPO / "benchmarks" / "timeline.py"
    out = run_python([sys.executable, timeline, tmp_path / "traces", "--text-width", "80"]).stdout
    rows = re.findall(r"^rank (\d) \|([#=X.]{80})\|$", out, flags=re.M)
    assert [rank for rank, _ in rows] == ["0", "1"], out
    assert all("#" in marks for _, marks in rows), out  # compute on every rank
    assert any(set(marks) & {"=", "X"} for _, marks in rows), out  # communication drawn


def test_the_gallery_draws_a_layout_by_its_command_and_every_picture_is_on_its_page(tmp_path):
    # The cheapest picture (a 2-stage 1F1B pipeline, a few seconds) made by the gallery's command.
    gallery = REPO / "benchmarks" / "gallery.py"
    out = run_python([sys.executable, gallery, "--out", tmp_path, "--only", "1f1b"]).stdout
    assert (tmp_path / "1f1b.png").stat().st_size > 10_000, out
    drawn = (tmp_path / "1f1b.txt").read_text()
    rows = re.findall(r"^rank (\d) \|([#=X.FBIW]+)\|$", drawn, flags=re.M)
    assert [rank for rank, _ in rows] == ["0", "1"], drawn
    assert all({"F", "B"} <= set(marks) for _, marks in rows), drawn  # each stage's actions
    first = [marks.index("F") for _, marks in rows]
    assert first[0] < first[1], drawn  # stage 1 starts once stage 0 has sent it a microbatch
    report = json.loads((tmp_path / "gallery.json").read_text())
    command = report["layouts"]["1f1b"]["command"]
    assert "pipeline_config.schedule=1f1b" in command and "profile_steps=1" in command
    # The committed gallery: every layout's picture exists and its page (both languages) shows it.
    shown = json.loads((REPO / "docs" / "images" / "gallery" / "gallery.json").read_text())
    for page in (REPO / "docs" / "gallery.md", REPO / "docs" / "zh-CN" / "gallery.md"):
        text = page.read_text()
        for name in shown["layouts"]:
            assert (REPO / "docs" / "images" / "gallery" / f"{name}.png").is_file()
            assert f"images/gallery/{name}.png)" in text, (page, name)
