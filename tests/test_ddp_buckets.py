"""tutorials/ddp_buckets.py under torchrun: DDP's buckets and their all-reduce order, checked from
what its communication hook recorded (the JSON it writes) and from the sentences it prints."""

import json
import re
from collections import Counter

import pytest
from conftest import REPO, main_command
from conftest import run as run_command

pytestmark = pytest.mark.slow
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    """The tutorial at its default cap (0.25 MiB against DDP's default)."""
    return run_tutorial(tmp_path_factory.mktemp("buckets") / "buckets.json")


def run_tutorial(record, *flags) -> tuple[str, dict, str]:
    """One run of the tutorial on 2 ranks (about 10 s): its stdout, the buckets rank 0 recorded,
    and its stderr."""
    script = REPO / "tutorials" / "ddp_buckets.py"
    result = run_command(main_command(2, [*flags, str(record)], script=script), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, json.loads(record.read_text()), result.stderr


@pytest.fixture(scope="module")
def sizes():
    """Gradient bytes per parameter of the project's default GPT, in model.parameters() order,
    built here."""
    from model import GPT, GPTConfig

    gpt = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=65, block_size=64))
    assert "lm_head.weight" in dict(
        gpt.named_parameters(remove_duplicate=False)
    )  # tied to wte.weight
    return {n: p.numel() * p.element_size() for n, p in gpt.named_parameters() if p.requires_grad}


def calls(record, run, iteration):
    return record["runs"][run][iteration - 1]["calls"]


def names(bucket_calls):
    return [n for c in bucket_calls for n in c["names"]]


def test_first_bucket_at_the_default_cap_holds_the_last_parameters_and_closes_at_1_mib(
    tutorial, sizes
):
    _, record, _ = tutorial
    params = list(sizes)
    assert record["params"] == params
    (only,) = calls(
        record, "default", 1
    )  # before the rebuild: one bucket, in model.parameters() order
    assert only["names"] == params and only["bytes"] == sum(sizes.values())
    first = calls(record, "default", 2)[0]  # after the rebuild
    assert first["index"] == 0
    assert set(first["names"]) == set(params[-len(first["names"]) :]) and len(first["names"]) < len(
        params
    )
    assert first["bytes"] == sum(sizes[n] for n in first["names"])
    # Not "at most 1 MiB": the bucket closes at the parameter that takes it to the cap, and keeps
    # it.
    assert first["bytes"] - sizes[first["names"][-1]] < MiB <= first["bytes"]


def test_a_smaller_cap_makes_more_buckets_and_each_closes_at_its_cap(tutorial, sizes):
    out, record, _ = tutorial
    default, small = calls(record, "default", 2), calls(record, "cap", 2)
    assert len(small) > len(default) == 2
    for c in small[:-1]:
        assert c["bytes"] - sizes[c["names"][-1]] < MiB // 4 <= c["bytes"]
    assert len(calls(record, "cap", 1)) == 1  # the cap only matters once DDP rebuilds
    assert len(calls(record, "25", 2)) == 1  # 25 passed explicitly: no 1 MiB first bucket
    assert f"{len(default)} buckets at the default cap, {len(small)} at bucket_cap_mb=0.25" in out


def test_the_cap_compared_is_the_flags_and_every_line_names_it(tutorial, sizes, tmp_path):
    """--bucket-cap-mb changes the cap without editing the file, and what is printed is the cap
    used (it used to be a constant in two runs and three strings)."""
    out, record, _ = run_tutorial(tmp_path / "buckets.json", "--bucket-cap-mb", "0.5")
    assert record["bucket_cap_mb"] == 0.5 == tutorial[1]["bucket_cap_mb"] * 2
    half = calls(record, "cap", 2)
    for c in half[:-1]:
        assert c["bytes"] - sizes[c["names"][-1]] < MiB // 2 <= c["bytes"]
    assert len(calls(record, "default", 2)) < len(half) < len(calls(tutorial[1], "cap", 2))
    assert f"2 buckets at the default cap, {len(half)} at bucket_cap_mb=0.5" in out
    assert "== bucket_cap_mb=0.5, iteration 2" in out and "At bucket_cap_mb=0.5: " in out
    assert "embeddings last, find_unused_parameters=True, bucket_cap_mb=0.5" in out
    assert "0.25" not in out[out.index("\n== ") :]


def test_all_reduces_go_out_in_bucket_index_order_and_a_full_bucket_waits_for_a_lower_one(tutorial):
    out, record, _ = tutorial
    for run in record["runs"].values():
        for step in run:
            assert [c["index"] for c in step["calls"]] == list(range(len(step["calls"])))
            assert [c["sent"] for c in step["calls"]] == sorted(c["sent"] for c in step["calls"])
    rebuilt = calls(record, "cap", 2)  # buckets in ready order: each goes out once it is full
    assert all(c["sent"] == c["full"] for c in rebuilt)
    late = calls(record, "embeddings_last", 1)  # bucket 0 holds gradients that are ready last
    assert late[0]["full"] == late[0]["sent"] == len(record["params"])
    assert sum(c["full"] < c["sent"] for c in late[1:]) == len(late) - 1
    assert "Hooks ran in bucket-index order in every run: True." in out


def test_every_parameter_is_in_exactly_one_bucket_and_the_tied_weight_once(tutorial, sizes):
    _, record, _ = tutorial
    for run in record["runs"].values():
        for step in run:
            counts = Counter(names(step["calls"]))
            assert set(counts) == set(sizes) and set(counts.values()) == {1}
            assert sum(c["bytes"] for c in step["calls"]) == sum(sizes.values())
            assert "lm_head.weight" not in counts


def test_rebuild_uses_the_ready_order_and_find_unused_keeps_the_reversed_construction_order(
    tutorial, sizes
):
    _, record, _ = tutorial
    first_ready = record["runs"]["default"][0]["ready"]
    assert names(calls(record, "default", 2)) == first_ready != list(sizes)
    construction = calls(record, "find_unused", 1)
    assert names(construction[::-1]) == list(sizes) and len(construction) == 2
    assert (
        construction[-1]["bytes"] - sizes[construction[-1]["names"][-1]]
        < MiB
        <= construction[-1]["bytes"]
    )
    assert calls(record, "find_unused", 2) == construction  # never rebuilt


def test_conclusions_are_printed_once_as_sentences(tutorial):
    out, _, _ = tutorial
    assert out.count("== bucket_cap_mb=None (the default), iteration 2") == 1  # rank 0 prints
    conclusions = out[out.index("parameter tensors") :]
    assert "False" not in conclusions
    assert (
        "Iteration 1 (default arguments): 1 bucket(s); model.parameters() order: True; "
        "sent after 52/52" in out
    )
    assert re.search(
        r"Bucket 0 holds the last 16 parameters of model.parameters\(\): True; 1056768 bytes", out
    )
    assert "cut into buckets in reverse order: True; never rebuilt: True" in out
    assert re.search(
        r"At the default cap: 2 buckets, 1 sent while backward was still running, with 32%", out
    )


def test_a_legend_explains_every_column_and_every_notice_on_stderr_before_the_first_table(
    tutorial,
):
    out, _, err = tutorial
    legend = out[: out.index("\n== ")]
    for column in (
        "call",
        "bucket",
        "KiB",
        "params",
        "full at k/N",
        "sent at k/N",
        "first .. last",
    ):
        assert re.search(rf"^  {re.escape(column)} {{2,}}\w", legend, re.M), column
    assert legend.startswith("On stderr, above") and "first .. last" in out[len(legend) :]
    # stderr holds DDP's C++ warning, once per rank (though two runs meet its condition), and
    # torchrun's OMP_NUM_THREADS notice when the variable is unset; nothing else. The legend
    # names both.
    unused = "find_unused_parameters=True was specified in DDP constructor, but did not find any"
    warned = re.findall(
        rf"^\[rank(\d)\]:\[W.*reducer\.cpp.*Warning: (.{{{len(unused)}}})", err, re.M
    )
    assert sorted(warned) == [("0", unused), ("1", unused)]
    # torchrun's notice: a block of lines, prefixed by its logger's "W... run.py:NNN] " on a
    # terminal, bare when stderr is a pipe as here
    notice = re.compile(
        r"^(W.*torch/distributed/run\.py:\d+\] ?)?(\**|Setting OMP_NUM_THREADS .*)$"
    )
    others = [line for line in err.splitlines() if not notice.match(line.strip())]
    assert [line for line in others if "reducer.cpp" not in line] == []
    assert unused[:60] in " ".join(legend.split()) and "Setting OMP_NUM_THREADS" in legend
