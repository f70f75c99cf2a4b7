"""The hang lab: distributed jobs that hang or desync on purpose (CPU, gloo), and for each the tool
that names the rank or the collective at fault.

    python tutorials/hang_lab.py                  # every hang, one line each (30-75 s)
    python tutorials/hang_lab.py --hang stopped   # one, with what the tool printed

Each hang is a real 2-rank torchrun job of this file (--worker NAME). The collective timeout is 8 s
rather than torch's 30 minutes, and the lab ends each job itself as soon as the tool has named
the cause. What you would see without the tool is in each hang's `seen`:

  skip        rank 1 skips an all_reduce      TORCH_DISTRIBUTED_DEBUG=DETAIL: each collective's
  shape       ranks all_reduce other shapes   fingerprint (op, shapes, dtypes) is compared across
  order       two collectives, swapped        the ranks first: an error naming both, at once
  raise       rank 1 raises                   torchrun's failure summary names the rank
  slow        rank 1 stuck before its step    every local rank's stack in one report
                                              (python -m mingpt_ddp.runtime.stacks, py-spy)
  stopped     rank 1 SIGSTOPped               the stall report (mingpt_ddp/runtime/stall.py)
  rendezvous  a node that never comes         the rendezvous's own state, read from its store
"""

from __future__ import annotations

import argparse
import base64
import datetime
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# By its package name: benchmarks/ (on sys.path in the tests) holds a `common` module too.
from tutorials.common import free_port  # noqa: E402

TIMEOUT_S = 8  # every collective's: a hang the tools miss still ends
PY_SPY_EXTRA = "debug"  # pyproject.toml's optional dependency that brings py-spy


@dataclass(frozen=True)
class Hang:
    seen: str  # what the job shows without the tool
    tool: str
    finding: str  # a regex: what the tool prints when it names the cause
    env: dict = field(default_factory=dict)


DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
HANGS = {
    "skip": Hang(
        "rank 0 waits in all_reduce until the timeout; rank 1's barrier pairs with nothing",
        "TORCH_DISTRIBUTED_DEBUG=DETAIL",
        r"Rank 0 is running collective: .*?OpType=ALLREDUCE.*?but Rank 1 is running collective: "
        r"CollectiveFingerPrint\(SequenceNumber=\d+,? ?OpType=\w+",
        DETAIL,
    ),
    "shape": Hang(
        "gloo fails or hangs inside the all_reduce, naming no rank",
        "TORCH_DISTRIBUTED_DEBUG=DETAIL",
        r"Rank 0 is running collective: .*?TensorShape=\[4\].*?but Rank 1 is running .*?"
        r"TensorShape=\[8\]",
        DETAIL,
    ),
    "order": Hang(
        "each rank waits in a different collective until the timeout",
        "TORCH_DISTRIBUTED_DEBUG=DETAIL",
        r"Rank 0 is running collective: .*?OpType=ALLREDUCE.*?but Rank 1 is running .*?"
        r"OpType=BROADCAST",
        DETAIL,
    ),
    "raise": Hang(
        "rank 0 would wait in all_reduce for a rank that is gone",
        "torchrun's failure summary",
        r"rank\s*: 1 \(local_rank: 1\)",
    ),
    "slow": Hang(
        "both ranks quiet; rank 0 waits in all_reduce",
        "python -m mingpt_ddp.runtime.stacks",
        r"== rank 1 [^\n]*\n(?:[^=][^\n]*\n)*?[^\n]*read_a_stuck_batch \(hang_lab.py:\d+\)",
    ),
    "stopped": Hang(
        "both ranks quiet; rank 0 waits in all_reduce until the timeout",
        "the stall report",
        r"stall \| no step for .* \| rank 1 silent for \d+ s: stopped or frozen",
    ),
    "rendezvous": Hang(
        "torchrun prints nothing until join_timeout (600 s by default), then an empty "
        "RendezvousTimeoutError",
        "the rendezvous state in its store",
        r"rendezvous lab: 1 of 2 nodes joined \(.*?\), waiting",
    ),
}


# ---------------------------------------------------------------- the workers (under torchrun)
def read_a_stuck_batch() -> None:
    time.sleep(3600)  # a filesystem that never answers, a deadlock in a data loader thread


def worker(name: str) -> None:
    import torch
    import torch.distributed as dist

    from mingpt_ddp.runtime.distributed import DistContext
    from mingpt_ddp.runtime.stall import StallWatch

    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "200")  # the stall report counts collectives
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank, x = dist.get_rank(), torch.ones(4)
    ctx = DistContext(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"))
    store = dist.PrefixStore("lab_stall", dist.distributed_c10d._get_default_store())
    # Reports after 5 s without a step; a rank whose heartbeat stopped for 3 s is "silent".
    with StallWatch(5.0, ctx, os.environ["LAB_DIR"], store) as watch:
        dist.all_reduce(x)  # a healthy step first: every rank has heartbeated
        watch.beat(1)
        if rank == 1 and name == "raise":
            raise RuntimeError("rank 1 failed reading its batch")
        if rank == 1 and name == "stopped":
            os.kill(os.getpid(), signal.SIGSTOP)  # a debugger, a frozen VM, a Ctrl-Z
        if rank == 1 and name == "slow":
            read_a_stuck_batch()
        if name == "skip":
            dist.all_reduce(x) if rank == 0 else None
            dist.barrier()
        elif name == "shape":
            dist.all_reduce(torch.ones(4 if rank == 0 else 8))
        elif name == "order":
            ops = [lambda: dist.all_reduce(x), lambda: dist.broadcast(x, 0)]
            for op in ops if rank == 0 else ops[::-1]:
                op()
        else:
            dist.all_reduce(x)
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ the runner
def launch(name: str, lab_dir: str) -> subprocess.Popen:
    port = free_port()
    if name == "rendezvous":  # 2 nodes wanted, 1 started: the other never comes
        where = ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
        where += ["--rdzv-id=lab", "--rdzv-conf=join_timeout=60"]
    else:
        where = ["--standalone"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, "--nproc_per_node=2"]
    cmd += [os.path.abspath(__file__), "--worker", name]
    env = {**os.environ, **HANGS[name].env, "LAB_DIR": lab_dir, "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )  # fmt: skip
    job.port = port
    return job


def rendezvous_state(port: int, run_id: str = "lab") -> str:
    """Who has joined a c10d rendezvous: its state, as torchrun's agents keep it in the store
    at the endpoint (a pickled _RendezvousState, base64)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2))
    state = pickle.loads(base64.b64decode(store.get(f"torch.rendezvous.{run_id}")))
    nodes = sorted(str(node) for node in state.participants)
    return f"rendezvous {run_id}: {len(nodes)} of 2 nodes joined ({', '.join(nodes)}), waiting"


def py_spy() -> str | None:
    """py-spy beside this interpreter (its venv's bin/, whether or not that is on PATH), else on
    PATH; None when neither has it."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def missing_tool(name: str) -> str | None:
    """What to install, in one line, when the hang's tool cannot run here."""
    if name == "slow" and py_spy() is None:
        return f'py-spy is not installed: pip install -e ".[{PY_SPY_EXTRA}]"'
    return None


def run(name: str, lab_dir: str, budget_s: float = 60.0) -> dict:
    """Start the hang; apply its tool when the job shows it is stuck; end the job. A hang whose
    tool is not installed is not started: its row says what to install."""
    hang, t0, lines = HANGS[name], time.monotonic(), []
    if missing := missing_tool(name):
        return {"hang": name, "seen": hang.seen, "tool": hang.tool, "named": False,
                "finding": "", "error": f"not run: {missing}", "seconds": 0.0}  # fmt: skip
    job = launch(name, lab_dir)
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
    reader.start()
    found, cache = None, {}
    while found is None and time.monotonic() - t0 < budget_s:
        time.sleep(0.5)  # polling the job's output and the tools, not waiting in their place
        text = "".join(lines) + tool_output(name, job, time.monotonic() - t0, cache)
        found = re.search(hang.finding, text, re.S)
        if job.poll() is not None and found is None and not lines_pending(reader):
            break
    end(job)
    seconds = round(time.monotonic() - t0, 1)
    said = " ".join(found.group(0).split()) if found else ""  # one line, however it matched
    said = said if len(said) < 150 else f"{said[:70]} ... {said[-70:]}"
    return {"hang": name, "seen": hang.seen, "tool": hang.tool, "named": bool(found),
            "finding": said, "error": tool_error(cache), "seconds": seconds}  # fmt: skip


def tool_error(cache: dict) -> str:
    """The first error line the tool printed (py-spy that may not attach: ptrace), or ''."""
    errors = re.findall(r"^(?:error|Error)\b.*$", cache.get("stacks", ""), re.M)
    return errors[0].strip() if errors else ""


def end(job: subprocess.Popen) -> None:
    """SIGKILL torchrun and every worker under it (torchrun starts each worker in a session of its
    own, so its process group misses them; SIGKILL also ends a stopped rank)."""
    from mingpt_ddp.runtime.stacks import alive, children

    pids = [job.pid, *children(job.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it ended by itself
    job.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in pids[1:]):
        time.sleep(0.05)  # until the kernel has taken every worker away


def lines_pending(reader: threading.Thread) -> bool:
    reader.join(timeout=2)
    return reader.is_alive()


def tool_output(name: str, job: subprocess.Popen, waited: float, cache: dict) -> str:
    """The tools run from outside the job, once it has been quiet for 3 s."""
    if waited < 3:
        return ""
    if name == "slow" and time.monotonic() - cache.get("at", 0) > 2:  # a new dump every 2 s
        cmd = [sys.executable, "-m", "mingpt_ddp.runtime.stacks", str(job.pid)]
        path = [os.path.dirname(py_spy() or ""), os.environ.get("PATH", "")]
        env = {**os.environ, "PATH": os.pathsep.join(filter(None, path))}  # stacks: py-spy on PATH
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=60, env=env)
        cache["stacks"], cache["at"] = out.stdout + out.stderr, time.monotonic()
    if name == "rendezvous":
        try:
            return rendezvous_state(job.port)
        except Exception as e:  # noqa: BLE001 - the store may not be up yet: try again
            return f"rendezvous state not readable yet: {e}"
    return cache.get("stacks", "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hang", choices=sorted(HANGS), help="one hang (default: every one)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    import tempfile

    ok = True
    for name in [args.hang] if args.hang else list(HANGS):
        with tempfile.TemporaryDirectory(prefix="hang-lab-") as lab_dir:
            row = run(name, lab_dir)
        ok = ok and row["named"]
        said = row["finding"] or row["error"] or "NOT FOUND"
        print(f"hang | {name} | seen: {row['seen']} | {row['tool']}: {said} | "
              f"{row['seconds']} s", flush=True)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
