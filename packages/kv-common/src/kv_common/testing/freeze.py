"""Freeze a process for stall tests: SIGSTOP, then wait until every thread really is stopped.

``kill(SIGSTOP)`` returns before the group stop has reached every thread: each stops when it next
runs (measured up to 0.1 s later with 4 of 9 threads still running when kill() returned, longer on
a loaded machine). Meanwhile a 'frozen' peer's I/O threads still serve requests, and a test of a
stall sees none (a read from a frozen TransferEngine peer finished in 0.026 s).
"""

from __future__ import annotations

import os
import signal
import time


def thread_states(pid: int) -> list[str]:
    """The state letter of each thread of ``pid`` (``/proc/<pid>/task/*/stat``; Linux only)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that just ended
            continue
    return states


def wait_until_stopped(pid: int, timeout_s: float = 30.0) -> None:
    give_up = time.monotonic() + timeout_s
    while True:
        states = thread_states(pid)
        if states and all(st in "tT" for st in states):
            return
        if time.monotonic() >= give_up:
            raise TimeoutError(f"process {pid} not stopped within {timeout_s}s: thread states {states}")
        time.sleep(0.001)


def freeze(pid: int, timeout_s: float = 30.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped (SIGCONT resumes it)."""
    os.kill(pid, signal.SIGSTOP)
    wait_until_stopped(pid, timeout_s)
