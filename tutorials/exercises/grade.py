"""The grader of the build-it-yourself track: runs your exercises on 2 gloo ranks on this machine
and grades each with the project's own checks (docs/build-it-yourself.md walks the track).

    python tutorials/exercises/grade.py ring_allreduce          # one exercise: your file
    python tutorials/exercises/grade.py --all                   # every exercise, in order
    python tutorials/exercises/grade.py --all --solutions       # the reference solutions
    python tutorials/exercises/grade.py --all --planted --out rows.json   # the planted wrong ones

Your code is tutorials/exercises/<name>.py (each starts as a stub that raises
NotImplementedError); hints/<name>.md helps, solutions/<name>.py answers. Per exercise it prints
passed or failed, every check (equal to one process or to torch's own collective, the bytes
sent against the formula, and probes equality cannot see: overlap, microbatches held, state
held) with what it found. It exits 0 only if every graded exercise passed. One launch runs the
whole family, so a wrong exercise that leaves the ranks out of step (one waits in a collective
the other never joins) fails after 30 s, and those after it are not graded.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1])]  # checks, common, the repo

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD = 2
# The track, in the order of the README's path: (name, README section, minutes it takes).
TRACK = [
    ("ring_allreduce", "2. Collectives by hand", 20),
    ("ddp_buckets", "4. One DDP step", 30),
    ("zero1", "5. FSDP, ZeRO and AMP", 20),
    ("fsdp_layer", "5. FSDP, ZeRO and AMP", 30),
    ("one_f_one_b", "9. Pipeline parallelism", 25),
    ("tensor_parallel", "9. Tensor parallelism", 25),
    ("ring_attention", "9. Context parallelism", 40),
]
SOURCES = {"yours": HERE, "solutions": HERE / "solutions", "planted": HERE / "planted"}


def load(name: str, source: str):
    """The module holding an exercise's code, from the learner's folder or another."""
    path = SOURCES[source] / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{source}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grader(name: str):
    import graders
    import graders_model

    return getattr(graders, name, None) or getattr(graders_model, name)


def grade_here(name: str, source: str) -> tuple[list[dict], str]:
    """This rank's checks of one exercise, or why there are none (not written, or it raised)."""
    try:
        return [c.row() for c in grader(name)(load(name, source))], ""
    except NotImplementedError as stub:
        return [], f"not written yet: {stub} (tutorials/exercises/{name}.py; hints/{name}.md)"
    except Exception as error:  # the learner's code: its error in one line, no traceback
        where = f"tutorials/exercises/{name}.py" if source == "yours" else f"{source}/{name}.py"
        return [], f"{where} raised {type(error).__name__}: {str(error).splitlines()[0]}"


def merge(name: str, per_rank: list[tuple[list[dict], str]]) -> dict:
    """One row from every rank's checks: a check holds if it held on every rank; what it found is
    the first failing rank's (else rank 0's)."""
    errors = [(r, why) for r, (_, why) in enumerate(per_rank) if why]
    if errors:  # the same on every rank (a stub): said once; else the first rank's, named
        same = len({why for _, why in errors}) == 1 and len(errors) == len(per_rank)
        message = errors[0][1] if same else f"rank {errors[0][0]}: {errors[0][1]}"
        return {"exercise": name, "passed": False, "checks": [], "message": message}
    checks = []
    for i, check in enumerate(per_rank[0][0]):
        seen = [(r, rows[i]) for r, (rows, _) in enumerate(per_rank)]
        failing = [(r, c) for r, c in seen if not c["passed"]]
        r, shown = failing[0] if failing else seen[0]
        found = f"rank {r}: {shown['found']}" if failing else shown["found"]
        checks.append({"name": check["name"], "passed": not failing, "found": found})
    bad = [c for c in checks if not c["passed"]]
    message = f"{bad[0]['name']}: {bad[0]['found']}" if bad else f"all {len(checks)} checks held"
    return {"exercise": name, "passed": not bad, "checks": checks, "message": message}


def rank_main(rank: int, names: list[str], source: str, port: int, out: str) -> None:
    """One rank: grade each exercise (every rank runs each), rank 0 writes the rows."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=30)  # a rank left waiting fails, not hangs
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timeout)
    rows = []
    for name in names:
        per_rank = [None] * WORLD
        dist.all_gather_object(per_rank, grade_here(name, source))
        rows.append(merge(name, per_rank))
        if any("Timeout" in why or "timed out" in why.lower() for _, why in per_rank):
            left = names[len(rows) :]
            rows += [not_run(n, name) for n in left]
            break
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    from common import finish  # tutorials/common.py: a clean exit of the group

    finish()


def not_run(name: str, culprit: str) -> dict:
    message = f"not graded: {culprit} left the ranks out of step"
    return {"exercise": name, "passed": False, "checks": [], "message": message}


def run(names: list[str], source: str) -> list[dict]:
    """Every named exercise's row, graded in one 2-process gloo group on this machine."""
    from common import free_port

    with tempfile.TemporaryDirectory(prefix="grade-") as folder:
        out = os.path.join(folder, "rows.json")
        args = (names, source, free_port(), out)
        mp.start_processes(rank_main, args, nprocs=WORLD, start_method="spawn")
        return json.loads(Path(out).read_text())


def report(rows: list[dict]) -> None:
    for row in rows:
        print(f"{row['exercise']:<16} {'passed' if row['passed'] else 'FAILED'}: {row['message']}")
        for check in row["checks"]:
            print(f"    {'ok  ' if check['passed'] else 'FAIL'} {check['name']}: {check['found']}")
    passed = sum(row["passed"] for row in rows)
    print(f"\n{passed} of {len(rows)} exercises passed")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("exercise", nargs="*", help=f"one or more of: {', '.join(n for n, *_ in TRACK)}")
    p.add_argument("--all", action="store_true", help="every exercise, in the track's order")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--solutions", action="store_true", help="grade the reference solutions")
    group.add_argument("--planted", action="store_true", help="grade the planted wrong solutions")
    p.add_argument("--out", help="write the rows {exercise, passed, checks, message} here")
    args = p.parse_args()
    known = [n for n, *_ in TRACK]
    names = known if args.all else args.exercise
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        p.error(f"name an exercise ({', '.join(known)}) or --all; got {unknown or 'none'}")
    source = "solutions" if args.solutions else "planted" if args.planted else "yours"
    rows = run(names, source)
    report(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(row["passed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
