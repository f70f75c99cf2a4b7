"""This host's share of the machine: how many CPU threads a rank computes with, and whether the C
allocator keeps the memory a step frees. Both matter only on CPUs; GPU jobs leave them alone."""

from __future__ import annotations

import ctypes
import os

import torch

from mingpt_ddp.runtime.distributed import DistContext


def set_cpu_threads(ctx: DistContext, requested: int = 0, optimizer_on_cpu: bool = False) -> int:
    """Set how many threads this rank's CPU math (matmuls, elementwise ops) uses; returns it.

    Ranks on one node share its cores. torchrun sets OMP_NUM_THREADS=1 for every
    worker so that, say, 8 ranks x 8 threads do not fight over 8 cores; but on a
    32-core node with 4 ranks that leaves 28 cores idle. 0 means: an equal share of
    the cores this process may run on. On GPU jobs the CPU only feeds the GPU and the
    setting is left alone, unless the optimizer steps on the CPU (optimizer_on_cpu: FSDP
    CPU offload, DeepSpeed's offload_optimizer): then it is that rank's whole update, and
    torchrun's one thread would make it the slowest part of the step.
    """
    # A SLURM task (an sbatch or submitit job) is given SLURM_CPUS_PER_TASK cores even where SLURM
    # does not pin it to them: several one-process jobs on a node would otherwise each start a
    # thread per core, and spinning OpenMP threads that outnumber the cores make steps ~100x slower.
    slurm_cpus = int(os.environ.get("SLURM_CPUS_PER_TASK", "0") or 0)
    computes_on_cpu = ctx.device.type == "cpu" or optimizer_on_cpu
    alone = requested == 0 and ctx.local_world_size == 1 and not slurm_cpus
    if not computes_on_cpu or (alone and ctx.device.type == "cpu"):
        return torch.get_num_threads()  # GPU job, or alone on the node: torch's default is right
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    cores = min(cores, slurm_cpus or cores)
    threads = requested or max(1, cores // ctx.local_world_size)
    torch.set_num_threads(threads)
    return threads


# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_BELOW_BYTES = 32 * 1024 * 1024  # the largest mmap threshold glibc accepts on 64-bit machines


def keep_freed_cpu_memory(device: torch.device, enabled: bool = True) -> str:
    """Let the C allocator keep the memory a step frees, so the next step reuses it; returns what
    was done.

    Every training step allocates and frees the same tensors (activations, gradients, optimizer
    temporaries). glibc's malloc serves large blocks with mmap and gives them back to the OS when
    they are freed, and trims the free tops of its heaps, so the next step's tensors land on fresh
    pages that the kernel must map and zero, one page fault per 4 KiB: about 2,500 faults a step at
    nanoGPT's CPU recipe, compiled: 20.7 -> 17.3 ms a step with this setting (docs/speedrun.md).
    With blocks up to 32 MiB served from the heap and no trimming, the process keeps what it once
    used and reuses it (its peak memory moved by under 3% here). A MALLOC_* variable or another
    allocator (LD_PRELOAD jemalloc/tcmalloc) is the user's choice and is left alone; without glibc
    nothing changes.
    """
    if not enabled or device.type != "cpu":
        # On a GPU the tensors live in PyTorch's caching allocator, which already reuses blocks.
        return ""
    if any(k.startswith("MALLOC_") for k in os.environ) or "malloc" in os.environ.get(
        "LD_PRELOAD", ""
    ):
        return "allocator as set in the environment"
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, KEEP_BELOW_BYTES) and libc.mallopt(
            M_TRIM_THRESHOLD, 2**31 - 1
        )
    except (OSError, AttributeError):  # not glibc: macOS, musl, Windows
        return ""
    return "glibc malloc keeps freed memory" if ok else ""
