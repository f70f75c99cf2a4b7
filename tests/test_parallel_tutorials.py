"""tutorials/tensor_parallel_by_hand.py and tutorials/ring_attention_by_hand.py at 2 ranks: every
split layer, MLP and attention matches one process, the byte lines are their formulas, and the
balanced ring gives each rank the same share of the causal score matrix. The numbers the
tutorials print are parsed and checked here, not only their verdicts."""

import re

import pytest
from conftest import REPO, main_command, run

pytestmark = pytest.mark.slow
N = 2
TOLERANCE = 1e-5
B, T, C, HIDDEN = 2, 16, 32, 128  # tensor_parallel_by_hand.py's sizes
RING_B, RING_T, RING_C = 2, 32, 16  # ring_attention_by_hand.py's sizes
CHECK = re.compile(r"\[rank (\d)\] ([^\n]+?): max \|diff\| ([^\n]+) -> (\w+)")
PAIR = re.compile(r"(\w+) (\d\.\de[+-]\d+)")


def torchrun(script: str) -> str:
    command = main_command(N, [], script=REPO / "tutorials" / script, torchrun=True)
    result = run(command, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.count("all checks passed: True") == N
    return result.stdout


@pytest.fixture(scope="module")
def tp_output() -> str:
    return torchrun("tensor_parallel_by_hand.py")


@pytest.fixture(scope="module")
def ring_output() -> str:
    return torchrun("ring_attention_by_hand.py")


def test_each_split_layer_mlp_and_attention_matches_one_process(tp_output):
    expected = {
        f"column-parallel Linear({C}, {HIDDEN})": ["output", "weight", "bias", "input"],
        f"row-parallel Linear({HIDDEN}, {C})": ["output", "weight", "bias", "input"],
        "tensor-parallel MLP": ["output", "w1", "b1", "w2", "b2", "input"],
        "sequence-parallel MLP": ["output", "w1", "b1", "w2", "b2", "input"],
        "head-parallel attention": ["heads", "output"],
    }
    seen = set()
    for rank, name, pairs, verdict in CHECK.findall(tp_output):
        if name.startswith("head-parallel attention"):  # each rank names its own heads
            assert name.endswith(f"heads {2 * int(rank)}-{2 * int(rank) + 1}"), name
            name = "head-parallel attention"
        diffs = PAIR.findall(pairs)
        assert [k for k, _ in diffs] == expected[name], (name, pairs)
        assert all(float(d) <= TOLERANCE for _, d in diffs), (rank, name, pairs)
        assert verdict == "pass"
        seen.add((name, int(rank)))
    assert seen == {(name, r) for name in expected for r in range(N)}


def test_without_fs_all_reduce_the_input_gradient_is_only_a_partial_sum(tp_output):
    offs = re.findall(r"without f's all-reduce backward, input grad off by (\S+):", tp_output)
    assert len(offs) == N and all(float(off) > 1e-2 for off in offs)


def test_sequence_parallelism_sends_what_tensor_parallelism_does_and_holds_1_over_n(tp_output):
    size = B * T * C * 4  # S: the MLP's (B, T, C) output in fp32
    shard = size // N
    assert f"S = B x T x C x 4 = {size} bytes" in tp_output
    tp = re.search(r"\nTP: all_reduce 2\(N-1\)/N x (\d+) = (\d+); total (\d+) bytes\n", tp_output)
    all_reduce = 2 * (N - 1) * size // N
    assert tp and [int(g) for g in tp.groups()] == [size, all_reduce, all_reduce]
    sp = re.search(
        r"\nSP: all_gather \(N-1\) x (\d+) = (\d+); reduce_scatter \(N-1\)/N x (\d+) = (\d+);"
        r" total (\d+) bytes\n",
        tp_output,
    )
    assert sp and [int(g) for g in sp.groups()] == [
        shard,
        (N - 1) * shard,
        size,
        (N - 1) * size // N,
        all_reduce,  # the same bytes as TP's one all-reduce
    ]
    held = re.findall(r"holds between layers: input and output \(([\d, ]+)\) = (\d+)", tp_output)
    assert (
        held
        == [(f"{B}, {T}, {C}", str(B * T * C))] * N
        + [(f"{B}, {T // N}, {C}", str(B * T * C // N))] * N
    )
    assert (
        f"SP sends the same bytes as TP: True; holds {B * T * C // N} of TP's {B * T * C} floats"
        " between layers (1/N): True" in tp_output
    )


def test_a_plain_row_split_of_qkv_gives_no_rank_a_whole_head_and_a_head_split_does(tp_output):
    for line in (
        "[rank 0] a plain split of the rows: rows 0-47: q heads 0-3, k heads 0-1"
        " | can compute: none",
        "[rank 1] a plain split of the rows: rows 48-95: k heads 2-3, v heads 0-3"
        " | can compute: none",
        "[rank 0] its heads' q, k, v rows:   rows 0-15, 32-47, 64-79:"
        " q heads 0-1, k heads 0-1, v heads 0-1 | can compute: heads 0-1",
        "[rank 1] its heads' q, k, v rows:   rows 16-31, 48-63, 80-95:"
        " q heads 2-3, k heads 2-3, v heads 2-3 | can compute: heads 2-3",
    ):
        assert line in tp_output


def positions(rank: int, balanced: bool) -> list[int]:
    """The tokens rank holds, computed apart from the tutorial: chunk r of N, or chunks r and
    2N-1-r of 2N."""
    if not balanced:
        size = RING_T // N
        return list(range(rank * size, (rank + 1) * size))
    size = RING_T // (2 * N)
    late = 2 * N - 1 - rank
    return list(range(rank * size, (rank + 1) * size)) + list(range(late * size, (late + 1) * size))


def scores_per_step(rank: int, balanced: bool) -> list[int]:
    """Causal (query, key) pairs at each step: step s holds the keys of rank (rank - s) mod N."""
    queries = positions(rank, balanced)
    return [
        sum(k <= q for q in queries for k in positions((rank - step) % N, balanced))
        for step in range(N)
    ]


def test_ring_attention_matches_full_causal_attention_with_the_expected_shares(ring_output):
    line = re.compile(
        r"\[rank (\d)\] (contiguous|balanced)\s+tokens ([\d, -]+): max \|diff\| (\S+) -> (\w+)"
        r" \| scores per step \[([\d, ]+)\] = (\d+) of (\d+), share ([\d.]+)"
    )
    found = line.findall(ring_output)
    assert {(int(f[0]), f[1]) for f in found} == {
        (r, layout) for r in range(N) for layout in ("contiguous", "balanced")
    }
    assert len(found) == 2 * N
    total = RING_T * (RING_T + 1) // 2
    for rank, layout, tokens, diff, verdict, steps, done, of, share in found:
        rank, balanced = int(rank), layout == "balanced"
        assert float(diff) <= TOLERANCE and verdict == "pass"
        held = positions(rank, balanced)
        assert tokens.startswith(f"{held[0]}-") and tokens.endswith(f"-{held[-1]}")
        expected = scores_per_step(rank, balanced)
        assert [int(s) for s in steps.split(", ")] == expected
        assert int(done) == sum(expected) and int(of) == total
        assert float(share) == round(sum(expected) / total, 3)
        if balanced:  # the point of the balancing: an equal share, and equal work at each step
            assert float(share) == round(1 / N, 3)
            assert expected == scores_per_step(0, True)
    # the unbalanced last rank does 0.742 of the work at N = 2; each step waits for it
    paces = re.findall(r"each step waits for its busiest rank: .*, ([\d.]+) x an even", ring_output)
    assert paces == ["1.48", "1.00"]


def test_each_rank_sends_k_and_v_n_minus_1_times(ring_output):
    formula = (N - 1) * 2 * (RING_B * RING_T // N * RING_C * 4)
    sent = re.findall(r"\[rank \d\] sent (\d+) bytes; .* = (\d+)\n", ring_output)
    assert sent == [(str(formula), str(formula))] * N
