"""An engine step that schedules nothing waits for the connector's news instead of spinning.

vLLM keeps stepping its engine while a connector has work in flight: a prefill holding finished
requests' blocks for their readers, a decode whose requests wait for their KV
(``WAITING_FOR_REMOTE_KVS``), a store saving or loading asynchronously. With nothing to compute
each step is empty and the engine loop and its workers spin through them back to back: measured
here, a prefill holding two requests used 1.3 cores doing nothing, took the CPU its own pulls and
the instances sharing its cores needed, and left a colocated prefill stalled for two minutes.

So in a step the scheduler marks idle (no token scheduled), the worker's ``get_finished`` waits
until the connector has something to report (a pull landed, blocks were freed, a save or load
ended: ``notify``), at most ``max_s``. A step with tokens never waits. What it costs: a request
that arrives while an instance has only transfers in flight starts up to ``max_s`` later; what the
connector reports is never delayed (``notify`` ends the wait at once).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

DEFAULT_IDLE_STEP_WAIT_MS = 5.0
MAX_IDLE_STEP_WAIT_MS = 100.0


def check_idle_step_wait_ms(max_ms: float) -> None:
    """The setting's bounds (a connector config checks it when parsed, the wait when built)."""
    if not 0.0 <= max_ms <= MAX_IDLE_STEP_WAIT_MS:
        raise ValueError(f"idle_step_wait_ms must be from 0 to {MAX_IDLE_STEP_WAIT_MS:g} (got {max_ms!r})")


def idle_step(scheduler_output: object) -> bool:
    """Whether vLLM's step scheduled no token (its model runner then only runs the connector)."""
    tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    return isinstance(tokens, int) and tokens == 0


class IdleStepWait:
    """The worker's wait in idle steps, ended early by ``notify`` (thread-safe). One per connector:
    ``begin_step`` when the step's metadata arrives, ``before_report`` in ``get_finished``."""

    def __init__(self, max_ms: float = DEFAULT_IDLE_STEP_WAIT_MS) -> None:
        check_idle_step_wait_ms(max_ms)
        self.max_s = max_ms / 1000.0
        self._news = threading.Event()
        self._idle_step = False  # kept to the report: vLLM may clear the metadata before it

    def begin_step(self, idle: bool) -> None:
        """This step's metadata arrived: whether vLLM scheduled no token in it (``idle_step``)."""
        self._idle_step = idle

    def notify(self) -> None:
        """The connector has something to report (from any thread)."""
        self._news.set()

    def before_report(self, busy: Callable[[], bool] | None = None) -> None:
        """Call before collecting what to report. In an idle step with work in flight (``busy()``,
        asked only in idle steps; None: assume so), wait for news (at most ``max_s``). The news is
        consumed here, before the collection: news that comes during the collection ends the next
        wait at once, so none is slept through."""
        idle, self._idle_step = self._idle_step, False  # a step whose metadata never came is not idle
        if idle and self.max_s > 0 and (busy is None or busy()):
            self._news.wait(self.max_s)
        self._news.clear()
