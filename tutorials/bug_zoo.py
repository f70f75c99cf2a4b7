"""The bug zoo: famous bugs of distributed training, each one reproduced as a small deviation of
this project's own training step, with the symptom a user would see, the check that catches it,
and the code in the project that avoids it.

    python tutorials/bug_zoo.py                              # every bug, explained
    python tutorials/bug_zoo.py --bug no_sync_around_backward
    python tutorials/bug_zoo.py --check --out bug_zoo.json   # one line a bug; exit 0 if all hold

Each bug was reported in some project's issue tracker (docs/tutorials.md, section 9, links the
threads: nanoGPT, pytorch/examples, torchtitan, pytorch, Lightning, Accelerate, apex). Each exhibit
runs the buggy variant and the project's code side by side and applies one check to both: the
check must catch the bug and pass the project. The exhibits that need ranks run in a 2-process
gloo group this script starts itself (torch.multiprocessing, as tutorials/spawn_launch.py does);
the rest run in this process. The buggy variants live here, never in the Trainer: they are
copies of the project's pieces with one line changed (tutorials/bugs/), a buggy copy of
trainer.micro_steps run by trainer.step in the real one's place.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.multiprocessing as mp
from bugs import local, ranks, resume  # the exhibits, in tutorials/bugs/
from bugs.base import Row, find_corpus, load_ids

WORLD = 2


@dataclass(frozen=True)
class Bug:
    exhibit: Callable[[torch.Tensor, int], Row | None]  # (ids, vocab) -> its row (rank 0's)
    ranks: int  # processes it needs
    what: str  # the bug, in one line
    buggy: str  # the line that is wrong
    right: str  # the project's line
    avoided_by: str  # where that line is: the project's functions, comma-separated


BUGS = {
    "grad_accum_not_divided": Bug(
        ranks.grad_accum_not_divided,
        WORLD,
        "gradient accumulation: each micro-step's loss backpropagated whole",
        "s.scaler.scale(micro_loss).backward()",
        "s.scaler.scale(micro_loss / n).backward()",
        "trainer.micro_steps, trainer.step",
    ),
    "no_sync_around_backward": Bug(
        ranks.no_sync_backward,
        WORLD,
        "DDP's no_sync around the backward only, the forward left outside",
        "_, loss = model(x, y); with model.no_sync(): loss.backward()",
        "with s.gradient_sync(micro == n - 1): _, micro_loss = s.train_model(x, y)",
        "trainer.micro_steps, GridStrategy.gradient_sync",
    ),
    "logged_loss_rank0_only": Bug(
        ranks.logged_loss_rank0,
        WORLD,
        "the logged training loss is rank 0's own, not the mean over the ranks",
        "if rank == 0: print(loss.item())",
        "loss_sum, count = control.sum(self.totals.clone()).tolist()",
        "LogWindow.mean_loss",
    ),
    "per_rank_random_split": Bug(
        local.per_rank_random_split,
        1,
        "each rank splits train/validation with random_split and a seed of its own",
        "random_split(windows, [0.9, 0.1], generator=Generator().manual_seed(rank))",
        "n_train = split_point(n, cfg.train_split)",
        "split_point, CharDataset",
    ),
    "save_on_local_rank0": Bug(
        ranks.save_on_local_rank0,
        WORLD,
        "snapshots saved where LOCAL_RANK == 0: once per node, all to one path",
        "if local_rank == 0: torch.save(state, path)",
        "if not self.is_main: return  # only global rank 0 writes",
        "DistContext.is_main, Snapshots._write",
    ),
    "missing_map_location": Bug(
        local.missing_map_location,
        1,
        "torch.load of a GPU job's snapshot without map_location",
        "torch.load(path)",
        "torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)",
        "Snapshots.resume, load_bytes",
    ),
    "resume_without_scaler_state": Bug(
        resume.resume_without_scaler,
        1,
        "the checkpoint leaves out GradScaler's state (fp16's loss scale)",
        "torch.save({'model': ..., 'optimizer': ...}, path)",
        '"scaler": self.scaler.state_dict(),',
        "GridStrategy.snapshot_meta, GridStrategy.load_snapshot_meta",
    ),
    "resume_without_rng_state": Bug(
        resume.resume_without_rng,
        1,
        "the checkpoint leaves out the random number generators' state (dropout)",
        "torch.save({'model': ..., 'optimizer': ...}, path)",
        '"rng": self.control.gather({"cpu": torch.get_rng_state(), "cuda": cuda}),',
        "TrainState.state_dict, TrainState.load_state_dict",
    ),
    "resume_without_lr_schedule": Bug(
        resume.resume_without_lr_schedule,
        1,
        "the checkpoint leaves out the LR scheduler's state (the schedule restarts)",
        "scheduler = LambdaLR(optimizer, schedule)  # its state_dict() never saved",
        "set_learning_rates(s.optimizers, self.optim_cfg, self.state.step, ...)",
        "set_learning_rates, Trainer.train_step",
    ),
    "missing_set_epoch": Bug(
        local.missing_set_epoch,
        1,
        "DistributedSampler.set_epoch never called",
        "for epoch in range(epochs): for batch in loader: ...  # no sampler.set_epoch(epoch)",
        "FeistelPermutation(self.num_windows, self.seed, epoch)",
        "DataCursor.permutation, FeistelPermutation",
    ),
}


def rank_main(rank: int, names: list[str], corpus: str, port: int, out: str) -> None:
    """One rank of the 2-process group (mp.spawn passes rank): run the named exhibits, rank 0
    writes their rows to out."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)  # as main() does (see there)
    from common import finish, init  # tutorials/common.py: gloo, and a clean exit

    init()
    ids, vocab = load_ids(corpus)
    rows = [BUGS[name].exhibit(ids, vocab) for name in names]  # collectives: every rank runs each
    if rank == 0:
        with open(out, "w") as f:
            json.dump([asdict(row) for row in rows], f)
    finish()


def run_ranks(names: list[str], corpus: str) -> dict[str, Row]:
    """The exhibits that need ranks, in a 2-process gloo group on this machine."""
    from common import free_port  # tutorials/common.py (the script's folder: this process)

    port = free_port()  # for the rendezvous
    with tempfile.TemporaryDirectory(prefix="bug-zoo-") as folder:
        out = os.path.join(folder, "rows.json")
        args = (names, corpus, port, out)
        mp.start_processes(rank_main, args, nprocs=WORLD, start_method="spawn")
        with open(out) as f:
            return {row["bug"]: Row(**row) for row in json.load(f)}


def run(names: list[str], corpus: str) -> list[Row]:
    """Every named exhibit's row, in the order named."""
    multi = [name for name in names if BUGS[name].ranks > 1]
    rows = run_ranks(multi, corpus) if multi else {}
    ids, vocab = load_ids(corpus)
    for name in names:
        if name not in rows:
            rows[name] = BUGS[name].exhibit(ids, vocab)
        rows[name].avoided_by = BUGS[name].avoided_by
    return [rows[name] for name in names]


def holds(row: Row) -> bool:
    return row.caught and row.project_passes


def one_line(row: Row) -> str:
    verdict = "caught" if row.caught else "MISSED"
    project = "project passes" if row.project_passes else "PROJECT FAILS"
    return f"{row.bug:<28} {verdict}, {project} | {row.symptom} | check: {row.check}"


def wrap(label: str, text: str) -> str:
    return textwrap.fill(text, 100, initial_indent=label, subsequent_indent=" " * len(label))


def explain(number: int, row: Row) -> str:
    """The teaching output of one bug."""
    bug = BUGS[row.bug]
    verdict = (
        f"{'yes' if row.caught else 'NO'}: the buggy variant "
        f"{'fails' if row.caught else 'passes'} the check; the project's code "
        f"{'passes' if row.project_passes else 'FAILS'} it"
    )
    return "\n".join(
        [
            f"\n== {number}. {row.bug}: {bug.what}",
            f"the bug:    {bug.buggy}",
            f"project:    {bug.right}",
            f"            (in {row.avoided_by})",
            wrap("symptom:    ", row.symptom),
            wrap("check:      ", row.check),
            f"caught:     {verdict}",
            *(f"            {line}" for line in row.lines),
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bug", action="append", choices=list(BUGS), help="only this bug")
    parser.add_argument("--check", action="store_true", help="one line a bug, exit 1 if any fail")
    parser.add_argument("--out", help="write the rows as JSON to this file")
    parser.add_argument("--data", help="the corpus (default: tiny Shakespeare, as the tests find)")
    args = parser.parse_args()
    # The tiny model's ops are too small to split between threads: extra threads only wait for
    # each other (on a busy 2-core machine, 13 s for the one-process exhibits instead of 5).
    torch.set_num_threads(1)
    names = [name for name in BUGS if name in (args.bug or BUGS)]  # in the zoo's order
    corpus, t0 = str(find_corpus(args.data)), time.perf_counter()
    rows = run(names, corpus)
    for row in rows:
        print(one_line(row) if args.check else explain(list(BUGS).index(row.bug) + 1, row))
    wall = time.perf_counter() - t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"rows": [row.report() for row in rows], "wall_s": round(wall, 1)}, f, indent=1
            )
    good = sum(holds(row) for row in rows)
    print(f"\n{good} of {len(rows)} bugs caught by their checks, the project passing: {wall:.1f} s")
    return 0 if good == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
