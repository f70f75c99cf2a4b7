"""Stop signals: SIGTERM/SIGINT (and submitit's preemption signal) become a request to stop after
the current step, with a snapshot, instead of losing the work since the last save.

SIGTERM is what SLURM, Kubernetes and torchrun send before killing a job. The handler only
records the request; the training loop votes on it after the step (every rank stops together)
and snapshots. Under submitit (Hydra's submitit launcher) its own handler for the preemption
signal requeues the job: it is called once the step is snapshotted, so the requeued job resumes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

# A Ctrl-C within this many seconds of the first is the same request delivered twice (to the whole
# process group, and forwarded by torchrun); a later one, the user insisting, stops at once.
# SIGTERM never insists: SLURM, torchrun and the launcher's death (stop_when_the_launcher_dies)
# can each deliver it, seconds apart, and whoever wants the rank gone at once sends SIGKILL.
DUPLICATE_SIGNAL_WINDOW_S = 1.0


def submitit_preemption() -> tuple[int, Callable] | None:
    """submitit's preemption signal (SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise) and its
    handler, when this process is a submitit job; None otherwise. The handler requeues the job and
    exits; it saves nothing of the job's own, which is why the Trainer snapshots first."""
    if "SUBMITIT_FOLDER" not in os.environ:
        return None
    sig = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
    handler = signal.getsignal(sig) if sig is not None else None
    return (sig, handler) if callable(handler) else None


class StopSignals:
    """While entered, the stop signals set .received instead of killing the process."""

    def __init__(self, give_up_after_s: float):
        self.give_up_after_s = give_up_after_s  # the collective timeout: a stuck rank exits then
        self.received: int | None = None
        self._at = 0.0  # when (time.monotonic) the first came
        self.handover = submitit_preemption()
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        stops = (signal.SIGTERM, signal.SIGINT) + ((self.handover[0],) if self.handover else ())
        self._previous = {sig: signal.signal(sig, self._request_stop) for sig in stops}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def hand_over(self) -> bool:
        """If submitit's preemption signal stopped the run: call its handler (scontrol requeue, then
        exit). Returns False when there is nothing to hand over."""
        if not self.handover or self.received != self.handover[0]:
            return False
        self.handover[1](self.received, None)
        return True

    def _request_stop(self, signum: int, frame) -> None:
        if self.received is not None:
            # One request often arrives more than once: SLURM signals every process of the job
            # step, torchrun forwards the same signal, Ctrl-C reaches the whole process group.
            # Only a second Ctrl-C well after the first means "stop right now".
            late = time.monotonic() - self._at >= DUPLICATE_SIGNAL_WINDOW_S
            if signum != signal.SIGINT or not late:
                return
            signal.signal(signum, signal.SIG_DFL)
            raise KeyboardInterrupt
        self.received, self._at = signum, time.monotonic()
        # The loop will stop at the end of this step. A rank stuck somewhere (a hung
        # filesystem, a deadlock) never gets there: give up after the collective
        # timeout so the launcher can restart the group without waiting longer.
        timer = threading.Timer(self.give_up_after_s, os._exit, args=(128 + signum,))
        timer.daemon = True
        timer.start()


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


def stop_when_the_launcher_dies(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send sig to this rank when the process that started it dies: a torchrun agent
    SIGKILLed (`kill -9`, the OOM killer) would otherwise leave its workers training on as orphans,
    and a rerun would find the path's lease held and the job "done" behind its back. With
    SIGTERM, the ranks stop as on any stop request: the step ends, the vote is taken on the gloo
    group that is already connected, the snapshot is written, they exit. (Nothing may need the
    agent's key-value store then: it died with the agent.) Returns whether it was set (Linux)."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux (macOS has no prctl): nothing to ask for
        return False
    parent = os.getppid()
    if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    # The parent may have died between our start and prctl: then no signal will come. Our parent
    # pid changed (to init or a subreaper) exactly in that case.
    if os.getppid() != parent or parent == 1:
        os.kill(os.getpid(), sig)
    return True
