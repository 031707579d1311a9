"""FirstContact: one probe per peer at a time, its answer kept once given, every wait bounded."""

from __future__ import annotations

import threading
import time

from kv_mooncake.engine.peer_budgets import FirstContact


class FakeProbe:
    """Stands in for the engine's send_probe (tested on real engines in test_transfer_engine): answers
    ``rc`` once released; counts its calls."""

    def __init__(self, rc: int = 0):
        self.rc = rc
        self.calls = 0
        self.release = threading.Event()

    def __call__(self) -> int:
        self.calls += 1
        self.release.wait(30)
        return self.rc


def test_an_answer_is_asked_once_and_kept():
    contact, probe = FirstContact(), FakeProbe()
    probe.release.set()
    assert contact.answered(probe, time.monotonic() + 5) is None
    probe.rc = -1  # never asked again: Mooncake keeps the peer it opened
    assert contact.answered(probe, time.monotonic() + 5) is None
    assert probe.calls == 1


def test_a_silent_peer_ends_each_wait_at_its_deadline_and_is_probed_once_meanwhile():
    contact, probe = FirstContact(), FakeProbe()
    t0 = time.monotonic()
    why = contact.answered(probe, t0 + 0.2)
    assert why is not None and "deadline" in why
    assert 0.2 <= time.monotonic() - t0 < 1.0
    assert contact.answered(probe, time.monotonic() + 0.1) is not None
    assert probe.calls == 1  # the second reader waited for the probe already out
    probe.release.set()  # the peer answers after all: the next reader reads
    assert contact.answered(probe, time.monotonic() + 5) is None
    assert probe.calls == 1


def test_a_refusing_probe_is_named_and_asked_again_next_time():
    contact, probe = FirstContact(), FakeProbe(rc=-102)
    probe.release.set()
    why = contact.answered(probe, time.monotonic() + 5)
    assert why is not None and "-102" in why
    probe.rc = 0
    assert contact.answered(probe, None) is None  # no deadline: waits for the probe's end
    assert probe.calls == 2


def test_a_probe_that_raises_is_a_failed_answer():
    def broken() -> int:
        raise RuntimeError("engine closed")

    contact = FirstContact()
    why = contact.answered(broken, time.monotonic() + 5)
    assert why is not None and "-1" in why
