"""The data order: a seeded permutation of every window per epoch, and a cursor that resumes at any
world size."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO

from mingpt_ddp.corpus.order import DataCursor, FeistelPermutation


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 97, 1009, 64, 1024, 65536, 2**16 + 1, 1_000_003])
def test_the_permutation_takes_every_index_exactly_once(n):
    order = FeistelPermutation(n, seed=1337, epoch=0)(torch.arange(n))
    assert torch.equal(torch.bincount(order, minlength=n), torch.ones(n, dtype=torch.int64))


def test_the_permutation_is_a_bijection_above_2_to_the_24():
    n = 2**24 + 3  # where float32 index arithmetic breaks
    order = FeistelPermutation(n, seed=7, epoch=2)(torch.arange(n))
    assert torch.equal(torch.bincount(order, minlength=n), torch.ones(n, dtype=torch.int64))


def test_seeds_and_epochs_give_different_orders_and_the_same_seed_the_same_order():
    n, positions = 10_000, torch.arange(10_000)
    base = FeistelPermutation(n, seed=1, epoch=0)(positions)
    assert torch.equal(base, FeistelPermutation(n, seed=1, epoch=0)(positions))
    assert (base != FeistelPermutation(n, seed=2, epoch=0)(positions)).float().mean() > 0.99
    assert (base != FeistelPermutation(n, seed=1, epoch=1)(positions)).float().mean() > 0.99


def test_the_order_is_well_shuffled():
    n = 100_000
    order = FeistelPermutation(n, seed=3)(torch.arange(n)).double()
    correlation = torch.corrcoef(torch.stack([torch.arange(n).double(), order]))[0, 1]
    assert abs(correlation) < 0.02
    steps = (order[1:] - order[:-1]).abs()
    assert (steps == 1).sum() < 10  # neighbours do not stay neighbours
    first_tenth = order[: n // 10]  # an early slice of the epoch covers the whole corpus
    assert torch.histc(first_tenth, bins=10, min=0, max=n).min() > 0.08 * n / 10


def test_the_scalar_and_vectorised_paths_agree():
    for n in (2, 1000, 2**33 + 5):
        order = FeistelPermutation(n, seed=11, epoch=4)
        positions = torch.randint(0, n, (300,), generator=torch.Generator().manual_seed(0))
        assert order(positions).tolist() == [order.at(p) for p in positions.tolist()]


@pytest.mark.slow
def test_the_order_is_the_same_in_another_process():
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); "
        "from mingpt_ddp.corpus.order import FeistelPermutation; "
        "torch.set_num_threads(1); "
        "print(FeistelPermutation(12345, 99, 5)(torch.arange(0, 12345, 97)).tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(REPO)], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == str(FeistelPermutation(12345, 99, 5)(torch.arange(0, 12345, 97)).tolist())


def consume(n, world, batch, steps, state=None):
    """What `steps` global batches hand out, rank by rank, and the cursor state after them."""
    cursors = [DataCursor(n, world, rank, seed=5) for rank in range(world)]
    for c in cursors:
        if state:
            c.load_state_dict(state)
    seen = [[] for _ in range(world)]
    for _ in range(steps):
        for rank, c in enumerate(cursors):
            seen[rank] += c.next_starts(batch).tolist()
    states = [c.state_dict() for c in cursors]
    assert all(s == states[0] for s in states)  # every rank agrees on the position
    return seen, states[0]


def test_ranks_take_disjoint_shares_that_cover_the_epoch():
    seen, state = consume(n=120, world=4, batch=3, steps=10)
    assert all(len(s) == 30 for s in seen)
    assert sorted(sum(seen, [])) == list(range(120))
    assert state == {"epoch": 0, "samples_consumed": 120, "order": DataCursor.ORDER}


def test_rank_r_takes_every_wth_position_of_the_global_order():
    seen, _ = consume(n=50, world=2, batch=5, steps=5)
    order = FeistelPermutation(50, seed=5, epoch=0)(torch.arange(50)).tolist()
    assert seen[0] == order[0::2] and seen[1] == order[1::2]


@pytest.mark.parametrize("before, after", [(2, 1), (4, 2), (1, 3)])
def test_resuming_at_another_world_size_sees_every_remaining_window_once(before, after):
    n, batch = 240, 3
    first, state = consume(n, before, batch, steps=7)
    remaining_steps = (n - state["samples_consumed"]) // (after * batch)
    second, end = consume(n, after, batch, steps=remaining_steps, state=state)
    windows = sum(first, []) + sum(second, [])
    assert len(windows) == len(set(windows))  # nothing twice
    assert len(windows) == n - (n - state["samples_consumed"]) % (
        after * batch
    )  # nothing skipped but a partial batch
    assert end["epoch"] == 0


def test_an_exhausted_epoch_rolls_over_and_drops_the_partial_global_batch():
    seen, state = consume(n=10, world=2, batch=2, steps=3)  # 4 + 4, then only 2 left: a new epoch
    assert state == {"epoch": 1, "samples_consumed": 4, "order": DataCursor.ORDER}
    epoch0 = seen[0][:4] + seen[1][:4]
    assert len(set(epoch0)) == 8


def test_a_cursor_over_a_trillion_windows_materialises_nothing():
    cursor = DataCursor(10**12, world_size=8, rank=3, seed=0)  # randperm(10**12) would need 8 TB
    starts = cursor.next_starts(64)
    assert starts.shape == (64,) and int(starts.max()) < 10**12 and len(set(starts.tolist())) == 64


def test_a_global_batch_larger_than_the_epoch_is_refused():
    with pytest.raises(
        ValueError, match=r"one global batch \(2 ranks x 3\) is more than the 5 windows"
    ):
        DataCursor(5, world_size=2, rank=0, seed=0).next_starts(3)


@pytest.mark.slow
def test_the_sampler_tutorial_shows_set_epoch_and_the_per_rank_seed_bug():
    # tutorials/sampler_order.py teaches what DataCursor replaces: the lines it prints must show
    # a new order per epoch with set_epoch, the same order without, and gaps with a seed per rank.
    from conftest import main_command, run

    command = main_command(2, [], script=REPO / "tutorials" / "sampler_order.py", torchrun=True)
    result = run(command, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    told, untold, per_rank = result.stdout.split("\n== ")[1:]
    epochs = [line.split(": ", 1)[1] for line in told.splitlines() if "] epoch" in line]
    assert len(epochs) == 4 and epochs[0] != epochs[2], told  # rank 0: epochs 0 and 1 differ
    assert "trained twice none, never none" in told
    repeats = [line.split(": ", 1)[1] for line in untold.splitlines() if "] epoch" in line]
    assert repeats[0] == repeats[2] and repeats[1] == repeats[3], untold
    summary = next(line for line in per_rank.splitlines() if line.startswith("all ranks"))
    twice, never = summary.split(", never")
    assert "none" not in twice and "none" not in never, per_rank
