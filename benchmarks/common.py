"""What the benchmark scripts share: the repository's path, a free local port, how to start main.py, and
the hardware a result was measured on (stored with it: machines of one kind differ)."""

from __future__ import annotations

import os
import platform
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


def hardware() -> dict:
    """The device this process computes on, in words: the GPU's name, or the CPU's model with the
    instruction sets that decide its speed here (AVX-512, native bf16: AVX-512 BF16 and AMX). Like every
    script here, its caller has put REPO on sys.path."""
    import torch
    from mingpt_ddp.parallel.plan import cpu_flags

    if torch.cuda.is_available():
        return {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__}
    model, flags = platform.processor(), cpu_flags()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    extras = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"device": f"{model} ({', '.join(extras) or 'no AVX-512'})", "cores": cores, "torch": torch.__version__}
