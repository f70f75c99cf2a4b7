"""NCCL's flight recorder: each rank's last collectives in a ring buffer, dumped to a file when a
collective times out; the restart report names a silent rank's dump (fault-tolerance.md)."""

from __future__ import annotations

import os


def trace_prefix(attempt: int) -> str:
    """A dump's file name, less the rank: per attempt, so that an older attempt's dump cannot make
    a SIGKILLed rank of a later one look like a timeout."""
    return f"nccl_trace_attempt{attempt}_rank_"


def flight_recorder_env(trace_dir: str, attempt: int = 0) -> dict[str, str]:
    """NCCL's flight recorder, for GPU jobs: the last collectives of each rank in a ring buffer,
    dumped to trace_dir when a collective times out. On a timeout NCCL's watchdog ends the process
    from a thread of its own (TORCH_NCCL_ASYNC_ERROR_HANDLING, which torchrun sets to 1 for its
    workers: abort the communicators, end the process): no Python except runs, no exit note, so
    the dump is what is left to tell the timeout apart from a SIGKILL (silent_rank looks for it).
    Recent torch records 2000 entries and dumps on a timeout by default; what this adds is the
    dump's place (and those two for older versions). Read a dump with `python -m
    torch.distributed.flight_recorder.fr_trace`."""
    return {
        "TORCH_FR_BUFFER_SIZE": "2000",  # entries; a few hundred bytes each
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": os.path.join(
            os.path.abspath(trace_dir or "."), trace_prefix(attempt)
        ),
    }


# torch reads each new name first, then its older one: a user's older name must keep our default
# from taking precedence over it (TORCH_NCCL_TRACE_BUFFER_SIZE=0 meant: no recorder).
OLDER_NAME = {
    "TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_DUMP_TEMP_FILE": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
}


def use_flight_recorder(trace_dir: str | None, attempt: int = 0) -> None:
    """The recorder's settings into this process's environment, where the user set neither name:
    on GPUs flight_recorder_env's (trace_dir), on CPUs the buffer alone (the stall report counts
    each rank's collectives in it)."""
    wanted = (
        flight_recorder_env(trace_dir)
        if trace_dir is not None
        else {"TORCH_FR_BUFFER_SIZE": "2000"}
    )
    for key, value in wanted.items():
        if key not in os.environ and OLDER_NAME.get(key, key) not in os.environ:
            os.environ[key] = value


def silent_rank(rank: int, attempt: int) -> str:
    """Why a rank of that attempt may have left no exit note: killed outright, or (GPU jobs) ended
    by NCCL's watchdog after a collective timed out, which leaves a flight recorder dump instead
    (in the folder this attempt dumps to; a prefix the user set is used as it is)."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "")
    if os.path.basename(prefix).startswith("nccl_trace_attempt"):  # ours: that attempt's file
        prefix = os.path.join(os.path.dirname(prefix), trace_prefix(attempt))
    trace_file = prefix + str(rank)
    if prefix and os.path.isfile(trace_file):
        return f"rank {rank}: a collective timed out (NCCL watchdog); its last ones: {trace_file}"
    return (
        f"rank {rank} died without a word (killed: SIGKILL, the OOM killer, a lost node; on GPUs "
        "also NCCL's watchdog after a collective timeout, when no flight recorder dump was left)"
    )
