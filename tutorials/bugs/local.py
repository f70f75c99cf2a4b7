"""The bug zoo's exhibits that one process can show: what a rank computes alone (its data split,
its sampler's order) is computed here for each rank in turn, with the rank passed explicitly,
exactly as each rank would compute it; and a snapshot loaded without map_location.
"""

from __future__ import annotations

import io

import torch
from torch.utils.data import DistributedSampler, random_split

from bugs.base import BLOCK, Row, tiny_gpt
from char_dataset import split_point
from mingpt_ddp.corpus.order import DataCursor
from mingpt_ddp.snapshots.files import load_bytes, serialize

WORLD = 2
TRAIN_SPLIT = 0.9  # data_config.train_split's default


def split_by_rank(num_windows: int, rank: int) -> tuple[set, set]:
    """The bug: each rank splits the windows with torch.utils.data.random_split and a generator
    of its own (seeded by its rank; an unseeded one differs by process just the same)."""
    train, val = random_split(
        range(num_windows),
        [TRAIN_SPLIT, 1 - TRAIN_SPLIT],
        generator=torch.Generator().manual_seed(rank),
    )
    return set(train), set(val)


def split_by_region(num_tokens: int) -> tuple[set, set]:
    """The project (CharDataset): the first split_point ids are the training region, the rest the
    validation region, on every rank; window starts as token positions, none crossing over."""
    n_train = split_point(num_tokens, TRAIN_SPLIT)
    return set(range(n_train - BLOCK)), set(range(n_train, num_tokens - BLOCK))


def leaked(splits: list[tuple[set, set]]) -> tuple[int, int]:
    """How many of rank 0's validation windows some other rank trains on, and rank 0's count."""
    trained_elsewhere = set().union(*(train for train, _ in splits[1:]))
    return len(splits[0][1] & trained_elsewhere), len(splits[0][1])


def per_rank_random_split(ids: torch.Tensor, vocab: int) -> Row:
    num_tokens = len(ids)
    bug = leaked([split_by_rank(num_tokens - BLOCK, r) for r in range(WORLD)])
    project = leaked([split_by_region(num_tokens) for _ in range(WORLD)])
    return Row(
        "per_rank_random_split",
        f"{bug[0]} of rank 0's {bug[1]} validation windows are trained on by rank 1 "
        f"({bug[0] / bug[1]:.0%}): the validation loss falls with the training loss, "
        f"measuring memory; the project: {project[0]} of {project[1]}",
        "a leak count: rank 0's validation windows found in another rank's training set",
        bug[0] > 0,
        project[0] == 0,
        [
            "A split is only a split if every rank makes the same one: seeded alike, or, as",
            "here, by position in the text (no window crosses the boundary either).",
        ],
    )


def sampler_epochs(rank: int, num_windows: int) -> list[list[int]]:
    """The bug: a DistributedSampler whose set_epoch is never called, for epochs 0 and 1."""
    sampler = DistributedSampler(range(num_windows), num_replicas=WORLD, rank=rank, seed=0)
    return [list(sampler) for _epoch in range(2)]  # the loop counts epochs; the sampler is not told


def cursor_epochs(rank: int, num_windows: int, batch: int) -> list[list[int]]:
    """The project: DataCursor's windows for this rank over two epochs (the epoch is part of its
    position, so nothing has to tell it)."""
    cursor, epochs = DataCursor(num_windows, WORLD, rank, seed=0), [[], []]
    while cursor.epoch < 2:
        starts = cursor.next_starts(batch)  # (B,)
        if cursor.epoch < 2:
            epochs[cursor.epoch] += starts.tolist()
    return epochs


def repeated(traces: list[list[list[int]]]) -> tuple[int, int]:
    """Positions at which epoch 1 gives a rank the window epoch 0 gave it, over all ranks."""
    same = sum(a == b for epochs in traces for a, b in zip(*epochs))
    return same, sum(len(epochs[0]) for epochs in traces)


def missing_set_epoch(ids: torch.Tensor, vocab: int) -> Row:
    n = 64  # windows: a data-order trace a reader can print whole
    traces = {
        "sampler": [sampler_epochs(r, n) for r in range(WORLD)],
        "DataCursor": [cursor_epochs(r, n, batch=4) for r in range(WORLD)],
    }
    bug, project = repeated(traces["sampler"]), repeated(traces["DataCursor"])
    shown = [
        f"{name:>10}, rank 0, epoch {epoch}: {trace[0][epoch][:8]} ..."
        for name, trace in traces.items()
        for epoch in (0, 1)
    ]
    return Row(
        "missing_set_epoch",
        f"epoch 1 repeats epoch 0: {bug[0]} of {bug[1]} (rank, position) pairs read the same "
        f"window (the project: {project[0]} of {project[1]}, chance agreement)",
        "a data-order trace: each rank's windows of epoch 1 against epoch 0; the same sequence "
        "is caught",
        bug[0] == bug[1],
        project[0] < project[1],
        [
            "DistributedSampler shuffles with seed + epoch; the epoch is whatever set_epoch",
            "last said, 0 if never called. The trace's first windows:",
            *shown,
        ],
    )


def cuda_snapshot(state: dict) -> bytes:
    """state saved as a GPU job saves it: each storage tagged 'cuda:0' (torch.save records the
    tag serialization.location_tag returns; here it returns the one a GPU tensor gets)."""
    tag = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: "cuda:0"
    try:
        return bytes(serialize(state))
    finally:
        torch.serialization.location_tag = tag


def loads_to_cpu(load) -> tuple[bool, str]:
    """Whether load() gives every tensor on the CPU, and what it gave (or the error)."""
    try:
        state = load()
    except RuntimeError as error:
        return False, f"RuntimeError: {str(error).split('. ')[0]}"
    devices = sorted({str(t.device) for t in state.values()})
    return devices == ["cpu"], f"tensors on {', '.join(devices)}"


def missing_map_location(ids: torch.Tensor, vocab: int) -> Row:
    data = cuda_snapshot(tiny_gpt(vocab).state_dict())
    bug = loads_to_cpu(lambda: torch.load(io.BytesIO(data), weights_only=True))
    project = loads_to_cpu(lambda: load_bytes(data, map_location="cpu"))
    return Row(
        "missing_map_location",
        f"a snapshot saved on cuda:0, loaded without map_location: {bug[1]} (on a GPU machine "
        f"every rank's copy lands on cuda:0); the project's load: {project[1]}",
        "a load test: a snapshot tagged cuda:0 must load with every tensor on the CPU",
        not bug[0],
        project[0],
        [
            "torch.load restores each storage to the device it was saved from unless told",
            "otherwise; the project reads to the CPU first, then copies onto each rank's device.",
        ],
    )
