"""An idle engine step waits for the connector's news, at most its bound, and never misses news."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from kv_common.idle_step import IdleStepWait, idle_step


def test_only_a_step_without_tokens_is_idle():
    assert idle_step(SimpleNamespace(total_num_scheduled_tokens=0))
    assert not idle_step(SimpleNamespace(total_num_scheduled_tokens=3))
    assert not idle_step(object())  # an output we cannot read is never taken for idle


def test_an_idle_step_waits_its_bound_and_a_busy_one_never_waits():
    wait = IdleStepWait(50.0)
    t0 = time.monotonic()
    wait.before_report(idle=False)
    assert time.monotonic() - t0 < 0.02
    t0 = time.monotonic()
    wait.before_report(idle=True)
    assert 0.045 <= time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    IdleStepWait(0.0).before_report(idle=True)  # 0: the wait is off
    assert time.monotonic() - t0 < 0.02


def test_news_ends_the_wait_at_once_and_is_never_slept_through():
    wait = IdleStepWait(MAX := 100.0)
    threading.Timer(0.01, wait.notify).start()
    t0 = time.monotonic()
    wait.before_report(idle=True)
    assert time.monotonic() - t0 < MAX / 1000 * 0.8
    wait.notify()  # news while the last report was being collected: the next step does not wait
    t0 = time.monotonic()
    wait.before_report(idle=True)
    assert time.monotonic() - t0 < 0.02


@pytest.mark.parametrize("bad", [-1.0, 101.0])
def test_the_bound_is_checked(bad):
    with pytest.raises(ValueError, match="idle_step_wait_ms"):
        IdleStepWait(bad)
