"""Ranks started by horovodrun, seen through torchrun's variables.

horovodrun says who a process is in HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK and
HOROVOD_LOCAL_SIZE (horovod/runner/gloo_run.py), not in torchrun's RANK and WORLD_SIZE: read
alone, every process would believe it is rank 0 of 1 and write snapshots. Under horovodrun this
module starts Horovod (hvd.init), has rank 0 pick the address of a torch.distributed rendezvous
and send it to the others with Horovod's own broadcast_object, and writes torchrun's variables, so
that setup_distributed joins a gloo process group as under torchrun. That group carries the
project's control plane (the stop vote, object gathers, log means); parallel=horovod sends the
gradients through Horovod (mingpt_ddp/parallel/horovod.py).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping

from mingpt_ddp.errors import ConfigError

BUILD_SCRIPT = "tools/build_horovod.sh"
NEEDS_HOROVOD = (
    f"parallel=horovod (and horovodrun) need Horovod built for this torch: run {BUILD_SCRIPT}"
)

# torchrun's name: horovodrun's name (and the value when horovodrun leaves it out).
FROM_HOROVOD = {
    "RANK": ("HOROVOD_RANK", None),
    "WORLD_SIZE": ("HOROVOD_SIZE", None),
    "LOCAL_RANK": ("HOROVOD_LOCAL_RANK", "0"),
    "LOCAL_WORLD_SIZE": ("HOROVOD_LOCAL_SIZE", "1"),
}


def horovod_ranks(env: Mapping[str, str]) -> dict[str, str]:
    """torchrun's rank variables, as horovodrun set them in env; {} when horovodrun did not start
    this process, or when torchrun's are set already (they win)."""
    if "WORLD_SIZE" in env or "HOROVOD_RANK" not in env or "HOROVOD_SIZE" not in env:
        return {}
    return {ours: env.get(theirs, default) for ours, (theirs, default) in FROM_HOROVOD.items()}


def started(env: Mapping[str, str] | None = None) -> bool:
    return bool(horovod_ranks(os.environ if env is None else env))


def import_horovod():
    """horovod.torch, or a ConfigError naming the build script."""
    try:
        import horovod.torch as hvd
    except ImportError as e:  # not installed, or built for another torch (undefined symbols)
        raise ConfigError(f"{NEEDS_HOROVOD} ({e})") from None
    return hvd


def adopt() -> None:
    """Under horovodrun: start Horovod and write torchrun's variables (ranks, and MASTER_ADDR /
    MASTER_PORT of a rendezvous rank 0 hosts). Elsewhere nothing."""
    ranks = horovod_ranks(os.environ)
    if not ranks:
        return
    hvd = import_horovod()
    hvd.init()
    # Rank 0 hosts torch's rendezvous store on a port free now, on its host as horovodrun named
    # it (-H), which the other hosts reach (horovodrun reached it); the others learn both from
    # rank 0 through Horovod, the one channel that already connects them.
    mine = (
        (os.environ.get("HOROVOD_HOSTNAME", "localhost"), free_port()) if hvd.rank() == 0 else None
    )
    host, port = hvd.broadcast_object(mine, root_rank=0, name="mingpt_ddp.rendezvous")
    os.environ.update(ranks, MASTER_ADDR=host, MASTER_PORT=str(port))


def shutdown() -> None:
    """Stop Horovod's background thread, if this process started it. At the end of a job every
    rank calls it; a rank that exits without it leaves its peers' threads reading a closed socket
    ("Horovod background loop uncaught exception: Connection closed by peer")."""
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hvd.is_initialized():
        hvd.shutdown()


def free_port() -> int:
    """A TCP port nothing listens on now (rank 0 binds it again at once, for the store)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
