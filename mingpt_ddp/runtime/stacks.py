"""Every local rank's Python stack in one report, for a job that hangs:

    python -m mingpt_ddp.runtime.stacks            # every torchrun job of this machine
    python -m mingpt_ddp.runtime.stacks PID        # the job whose torchrun has this process id

A hung job prints nothing, and each rank is a separate process: this finds torchrun's workers
(the processes under it whose environment holds RANK) and reads each one's stacks with py-spy
(`pip install -e ".[debug]"`), which attaches through ptrace for a moment and leaves the process
running. ptrace needs root, or kernel.yama.ptrace_scope 0 (in a container: CAP_SYS_PTRACE). The
report has one section a rank, in rank order: the frame each thread is in is where it waits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def parents() -> dict[int, list[int]]:
    """Every process's children, from /proc (each process's parent, in its stat)."""
    found: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        parent = stat(int(entry))[1:2]
        if parent:
            found.setdefault(int(parent[0]), []).append(int(entry))
    return found


def children(pid: int) -> list[int]:
    """Every process under pid."""
    tree, found, todo = parents(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, parent, ...; [] once it is gone."""
    return read(f"/proc/{pid}/stat").decode(errors="replace").rpartition(")")[2].split()


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by its parent, counts as gone)."""
    return stat(pid)[:1] not in ([], ["Z"])


def read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def workers(agent: int) -> list[tuple[int, int]]:
    """(rank, pid) of a torchrun agent's workers, in rank order: its direct children with RANK in
    their environment (their own children, data loaders or compile workers, inherit it too)."""
    found = []
    for pid in parents().get(agent, []):
        env = dict(
            item.split(b"=", 1)
            for item in read(f"/proc/{pid}/environ").split(b"\0")
            if b"=" in item
        )
        if b"RANK" in env:
            found.append((int(env[b"RANK"]), pid))
    return sorted(found)


def agents() -> list[int]:
    """The torchrun agents of this machine (`torchrun` or `python -m torch.distributed.run`)."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        cmd = read(f"/proc/{entry}/cmdline").split(b"\0")
        if b"torch.distributed.run" in cmd or any(c.endswith(b"torchrun") for c in cmd[:2]):
            out.append(int(entry))
    return out


def report(agent: int) -> str:
    """One section a rank: `== rank R (pid P) ==`, then py-spy's dump of its threads."""
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        sys.exit('error: py-spy is not installed: pip install -e ".[debug]"')
    sections = []
    for rank, pid in workers(agent):
        dump = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True)
        sections.append(f"== rank {rank} (pid {pid}) ==\n{dump.stdout}{dump.stderr}")
    return "\n".join(sections) or f"torchrun {agent}: no workers under it"


def main(argv: list[str]) -> int:
    found = [int(argv[0])] if argv else agents()
    if not found:
        sys.exit("error: no torchrun job on this machine; pass torchrun's process id")
    for agent in found:
        print(f"# torchrun {agent}\n{report(agent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
