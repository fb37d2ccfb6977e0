"""The stop request itself: the first signal asks for a stop, a duplicate delivery is ignored, a later
second signal exits at once with the shell's code."""

from __future__ import annotations

import signal

import pytest

from cosmos3_batch.parallel import stop as stop_module
from cosmos3_batch.parallel.stop import StopRequest


class Exited(Exception):
    pass


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(stop_module.time, "monotonic", lambda: now[0])

    def exit_(code):
        raise Exited(code)

    monkeypatch.setattr(stop_module.os, "_exit", exit_)
    return now


def test_first_signal_requests_a_stop_and_names_it(clock, capfd):
    stop = StopRequest(quiet=False)
    assert not stop.requested and stop.exit_code == 0
    stop.request(signal.SIGTERM)
    assert stop.requested and stop.name == "SIGTERM" and stop.exit_code == 143
    assert "SIGTERM: stopping after this pass" in capfd.readouterr().err


def test_duplicate_delivery_is_one_stop_and_a_later_signal_exits_at_once(clock):
    stop = StopRequest(quiet=True)
    stop.request(signal.SIGINT)
    clock[0] += stop_module.DUPLICATE_WINDOW_S / 2  # torchrun forwarding what Slurm already sent
    stop.request(signal.SIGINT)
    assert stop.exit_code == 130
    clock[0] += stop_module.DUPLICATE_WINDOW_S
    with pytest.raises(Exited) as exited:
        stop.request(signal.SIGINT)
    assert exited.value.args == (130,)


def test_install_routes_signals_and_restore_puts_the_old_handlers_back():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stop = StopRequest(quiet=True)
    restore = stop.install()
    try:
        signal.raise_signal(signal.SIGTERM)
        assert stop.name == "SIGTERM"
    finally:
        restore()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
