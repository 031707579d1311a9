"""When a reply reached this host (wire.connection): the kernel's stamp, bounded by when its request
went out and when a thread saw it, and not used once the wall clock moved."""

from __future__ import annotations

import sys
import time

import msgspec
import pytest
from kv_mooncake.wire import connection
from kv_mooncake.wire.client import SideChannelClient
from kv_mooncake.wire.connection import MARGIN_S, MAX_OFFSET_DRIFT_NS, SO_TIMESTAMPNS, arrival, wall_offset_ns
from kv_mooncake.wire.server import SideChannelServer

SECOND_NS = 1_000_000_000
OFFSET = 1_700_000_000 * SECOND_NS  # wall clock minus monotonic clock


def test_a_stamp_dates_the_reply_within_its_request_and_its_reading():
    sent, noticed = 10.0, 10.050
    stamp = OFFSET + int(10.002 * SECOND_NS)  # it came 2 ms after the request
    assert arrival(stamp, OFFSET, OFFSET, sent, noticed) == pytest.approx(10.002 + MARGIN_S)
    # Never before the request went out, never after a thread saw it.
    assert arrival(OFFSET + int(9.0 * SECOND_NS), OFFSET, OFFSET, sent, noticed) == sent
    assert arrival(OFFSET + int(11.0 * SECOND_NS), OFFSET, OFFSET, sent, noticed) == noticed


def test_no_stamp_or_a_stepped_wall_clock_dates_the_reply_when_it_was_read():
    sent, noticed = 10.0, 10.050
    stamp = OFFSET + int(10.002 * SECOND_NS)
    assert arrival(0, OFFSET, OFFSET, sent, noticed) == noticed
    # The wall clock stepped forward 1 s between the request and the reading: its stamp would put
    # the reply a second early.
    assert arrival(stamp, OFFSET, OFFSET + SECOND_NS, sent, noticed) == noticed
    assert arrival(stamp, OFFSET, OFFSET + MAX_OFFSET_DRIFT_NS + 1, sent, noticed) == noticed
    assert arrival(stamp, OFFSET, OFFSET + MAX_OFFSET_DRIFT_NS, sent, noticed) < noticed


class PausingClocks:
    """The two clocks of a host where this thread is preempted once, for ``pause_ns``, just before
    its ``pause_at``-th clock read (a loaded machine); each read otherwise takes 100 ns."""

    def __init__(self, pause_at: int, pause_ns: int) -> None:
        self.now_ns, self.reads, self.pause_at, self.pause_ns = 5 * SECOND_NS, 0, pause_at, pause_ns

    def _read(self) -> int:
        self.reads += 1
        self.now_ns += 100 + (self.pause_ns if self.reads == self.pause_at else 0)
        return self.now_ns

    def monotonic_ns(self) -> int:
        return self._read()

    def time_ns(self) -> int:
        return OFFSET + self._read()


@pytest.mark.parametrize("pause_at", [1, 2, 3])
def test_a_pause_between_the_clock_reads_does_not_move_the_offset(monkeypatch, pause_at):
    # Preempted between its two reads, a thread once measured an offset off by the pause: the
    # request's and the reply's offsets then differed by more than MAX_OFFSET_DRIFT_NS, and every
    # stamp on a loaded machine was thrown away (seen with three test sessions on two cores).
    clocks = PausingClocks(pause_at, pause_ns=2_000_000)
    monkeypatch.setattr(connection, "time", clocks)
    offset = wall_offset_ns()
    assert OFFSET - MAX_OFFSET_DRIFT_NS // 4 <= offset <= OFFSET  # never above: stamps land later, not earlier


class Ping(msgspec.Struct, tag=True):
    pass


class Pong(msgspec.Struct, tag=True):
    pass


@pytest.mark.skipif(sys.platform != "linux", reason="receive stamps: Linux only (elsewhere: read time)")
def test_a_reply_read_late_is_dated_when_it_arrived():
    """A pull thread gets to its lease's Ack late under load (a status call, the GIL): the reply is
    dated by the kernel's receive stamp, not by the reading.

    A reply may come without a stamp (the kernel turns stamping on for the first stamped socket
    from a work queue, late on a loaded machine) or with the clocks' offset moved: then it is dated
    when it was read, the fail-closed fallback. CI once saw one such reply among three (three test
    sessions on two cores), so each kind of connection gets a few tries: every stamped one must be
    dated by its stamp, every other one when it was read, and most must be stamped."""
    dated_by_stamp = 0
    tries = 0
    with SideChannelServer("127.0.0.1", 0, lambda _m: Pong(), (Ping,)) as server:
        for _ in range(2):  # a new connection each time, then kept ones
            client = SideChannelClient((Pong,))
            try:
                for _ in range(3):
                    pending = client.start(server.address, Ping())
                    link = pending.link
                    time.sleep(0.2)  # the reply comes in well under a millisecond, and waits
                    assert pending.wait(5.0) == Pong()
                    read_at = time.monotonic()
                    drift = abs(wall_offset_ns() - pending.offset_at_send_ns)
                    stamped = link is not None and link.received_ns != 0 and drift <= MAX_OFFSET_DRIFT_NS
                    tries += 1
                    if stamped:
                        dated_by_stamp += 1
                        assert pending.sent_at <= pending.arrived_at < pending.sent_at + 0.1, \
                            (pending.arrived_at - pending.sent_at, read_at - pending.sent_at)
                    else:
                        assert pending.arrived_at >= pending.sent_at + 0.2, "no stamp: dated when read"
            finally:
                client.close()
    assert dated_by_stamp > tries // 2, f"{dated_by_stamp} of {tries} replies had a usable stamp"
    assert SO_TIMESTAMPNS is not None
