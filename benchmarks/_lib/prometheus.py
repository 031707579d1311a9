"""What the serving benchmarks read from a vLLM server's (or the proxy's) ``/metrics`` text."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def metric(text: str, name: str, labels: str = "") -> float:
    """The sum of one Prometheus series over its label sets (those containing ``labels``)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        if labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def settled(read: Callable[[], T], timeout_s: float = 15.0) -> T:
    """``read()`` once two reads 0.5 s apart agree, or the last read at ``timeout_s`` (vLLM's
    counters lag its answers a little)."""
    last, deadline = read(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = read()
        if now == last:
            return now
        last = now
    return last
