"""Stop signals, in process: which repeats are the same request and which one means "now"."""

import signal

import pytest

from mingpt_ddp.runtime import signals


class NoTimer:
    """Stands in for the give-up timer (which would end the test process)."""

    daemon = True

    def __init__(self, *args, **kwargs):
        pass

    def start(self):
        pass


@pytest.fixture
def stops(monkeypatch):
    """A StopSignals whose clock the test sets, without its give-up timer or a handler change."""
    clock = {"now": 100.0}
    monkeypatch.setattr(signals.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(signals.threading, "Timer", NoTimer)
    monkeypatch.setattr(signals.signal, "signal", lambda *a: None)
    s = signals.StopSignals(give_up_after_s=600)
    s.clock = clock
    return s


def test_repeated_sigterms_are_one_request_however_far_apart(stops):
    # SLURM, torchrun and a dead launcher's parent-death signal each deliver one, seconds apart:
    # the rank must still finish its step and its snapshot.
    stops._request_stop(signal.SIGTERM, None)
    for later in (0.2, 5.0, 40.0):
        stops.clock["now"] = 100.0 + later
        stops._request_stop(signal.SIGTERM, None)
    assert stops.received == signal.SIGTERM


def test_a_second_ctrl_c_stops_at_once_only_when_it_comes_late(stops):
    stops._request_stop(signal.SIGINT, None)
    stops.clock["now"] = 100.3  # the same Ctrl-C reaching the process again
    stops._request_stop(signal.SIGINT, None)
    stops.clock["now"] = 102.0  # the user insisting
    with pytest.raises(KeyboardInterrupt):
        stops._request_stop(signal.SIGINT, None)
