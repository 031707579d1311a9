"""Whether a peer's TransferEngine answers, asked before the first read to it, within the reader's deadline.

Mooncake opens a peer's segment inside the first read's submit: a handshake with the peer whose
answer it awaits for a fixed 60 s (its transfer timeouts do not bound it), holding the engine-wide
lock that every submit takes. A peer that froze after it answered our side channel (a stopped
process, a descheduled VM) therefore held the pull past its deadline, and every read to any peer
behind it (seen in CI: pulls failed after 60 s and 121 s against a 45 s deadline). The engine's own
probe (``send_probe``: the same handshake listener, no lock, the GIL released) runs on a thread of
its own instead, and the reader waits for it only until its deadline: a frozen peer fails the read
with nothing submitted. One probe per peer at a time. Once it answered, the peer is not probed again:
Mooncake keeps the opened peer for the engine's life (its asynchronous reads never open it again),
so a later stall is a read's, bounded by the transfer timeouts; probing again after a failed read
would only hold reads back behind a probe still stuck on a link that came back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

Probe = Callable[[], int]  # the engine's probe of one peer: 0 when it answered


class FirstContact:
    """One peer's answer to the probe: asked until it answered once, then kept."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._answered = False
        self._probing = False
        self._last_rc = 0  # of the last probe that ended without an answer

    def answered(self, probe: Probe, give_up: float | None) -> str | None:
        """None once the peer answered (now or before); otherwise why not: its probe failed, or
        ``give_up`` (time.monotonic; None: wait for the probe's end) passed first. The engine call
        comes with each ask and is never kept: kept, the engine holding this would be a cycle."""
        if self._answered:  # every read asks: no lock once answered (a stale False only waits below)
            return None
        with self._cond:
            if self._answered:
                return None
            if not self._probing:
                self._probing = True
                threading.Thread(target=self._run, args=(probe,), name="kv-mooncake-probe", daemon=True).start()
            while self._probing:
                left = None if give_up is None else give_up - time.monotonic()
                if left is not None and left <= 0:
                    return "its TransferEngine did not answer before the read's deadline (frozen or overloaded?)"
                self._cond.wait(left)
            if self._answered:
                return None
            return f"its TransferEngine did not answer a probe (code {self._last_rc})"

    def _run(self, probe: Probe) -> None:
        rc = -1
        try:
            rc = int(probe())
        except Exception:  # noqa: BLE001 - e.g. the engine closed meanwhile: no answer, never a dead thread
            rc = -1
        finally:
            with self._cond:
                self._probing = False
                self._answered = rc == 0
                self._last_rc = rc
                self._cond.notify_all()
