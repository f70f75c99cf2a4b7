"""What the benchmark scripts share: the repository's path, a free local port, and how to start main.py."""

from __future__ import annotations

import os
import socket
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main_command(nproc: int, overrides: list[str], torchrun_flags: tuple[str, ...] = ()) -> list[str]:
    """`python main.py OVERRIDES` for one process, `torchrun --standalone --nproc_per_node=N ... main.py
    OVERRIDES` for several (torchrun as `python -m torch.distributed.run`, the same program)."""
    main_py = os.path.join(REPO, "main.py")
    if nproc == 1 and not torchrun_flags:
        return [sys.executable, main_py, *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            *torchrun_flags, main_py, *overrides]
