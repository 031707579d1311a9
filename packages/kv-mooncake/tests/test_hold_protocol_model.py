"""A model of the hold protocol (issue 13 §2): the prefill's real handler and tracker, driven by
Hypothesis with a fake clock, against decode readers whose messages the network drops, duplicates,
reorders and delays, readers that die, holds that expire.

Invariants:
* a request's blocks are freed exactly once (and every hold is freed in the end);
* a reader never reads blocks after they were freed while it believes its lease is current (it
  believes a lease from the moment it SENT the PullStarted / LeaseRenew that was acked, which is never
  later than when the prefill granted it);
* no hold outlives both its deadline (hold time, or keep-alive extensions up to their cap) and
  every lease the prefill granted.
"""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402
from kv_mooncake.config import MooncakeConfig  # noqa: E402
from kv_mooncake.hold.ledger import HoldLedger
from kv_mooncake.step import HoldRequest, MooncakeStep
from kv_mooncake.wire import messages as P
from kv_mooncake.worker import MooncakeWorker, RankContext

REQUESTS = ("r0", "r1", "r2")
EXPECTED = {"r0": 1, "r1": 2, "r2": 2}  # decode ranks that read each request from this prefill rank
READERS = ("a", "b")
HOLD_S, LEASE_S, KEEPALIVE_MAX_S = 20.0, 3.0, 10.0
BLOCKS = [0, 1]


class HoldProtocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        cfg = MooncakeConfig(hold_timeout_s=HOLD_S, lease_s=LEASE_S, keepalive_max_s=KEEPALIVE_MAX_S)
        self.done_readers: dict[str, set[str]] = {}  # distinct DONEs the prefill received
        self.w = MooncakeWorker(cfg, RankContext(engine_id="P", is_producer=True, is_consumer=False,
                                                 side_channel_port=1))
        self.w.holder.ledger = HoldLedger(self.w.holder._on_free, clock=lambda: self.now)
        self.network: list[tuple] = []  # (kind, request, reader, sent_at): in flight, any order
        self.freed: dict[str, int] = {}
        self.held: set[str] = set()  # held by the prefill (model view)
        self.start: dict[str, float] = {}
        self.deadline: dict[str, float] = {}
        self.granted: dict[tuple[str, str], float] = {}  # (request, reader) -> lease end the prefill granted
        self.believed: dict[tuple[str, str], float] = {}  # (request, reader) -> lease end the reader assumes
        self.dead: set[str] = set()

    # ---- prefill -------------------------------------------------------------------------------
    @rule(request=st.sampled_from(REQUESTS), ttl=st.sampled_from([0.5, 5.0, None]))
    def hold(self, request, ttl):
        if request in self.freed:
            return  # vLLM never reuses a request id
        self.w.start_step(MooncakeStep(holds=[HoldRequest(request_id=request, num_blocks=2, block_ids=BLOCKS,
                                                          ttl_s=ttl)]))
        ttl_s = ttl or HOLD_S
        if request in self.held:  # a retried finish: widened, never shortened
            self.deadline[request] = max(self.deadline[request], self.now + ttl_s)
        else:
            self.held.add(request)
            self.start[request] = self.now
            self.deadline[request] = self.now + ttl_s
        self._collect()

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 2.0, 4.0, 15.0]))
    def advance(self, dt):
        self.now += dt
        self._collect()

    # ---- decode readers: what they send ----------------------------------------------------------
    @rule(reader=st.sampled_from(READERS), request=st.sampled_from(REQUESTS),
          kind=st.sampled_from(["started", "renew", "done", "free", "keepalive"]))
    def send(self, reader, request, kind):
        if reader in self.dead:
            return
        if kind == "done":
            self.believed.pop((request, reader), None)  # a reader stops reading before its DONE
        self.network.append((kind, request, reader, self.now))

    @rule(reader=st.sampled_from(READERS))
    def kill(self, reader):
        self.dead.add(reader)
        for key in [k for k in self.believed if k[1] == reader]:
            del self.believed[key]

    # ---- the network -----------------------------------------------------------------------------
    @precondition(lambda self: self.network)
    @rule(data=st.data())
    def deliver(self, data):
        i = data.draw(st.integers(0, len(self.network) - 1))
        kind, request, reader, sent_at = self.network.pop(i)
        self._deliver(kind, request, reader, sent_at)

    @precondition(lambda self: self.network)
    @rule(data=st.data(), drop=st.booleans())
    def duplicate_or_drop(self, data, drop):
        i = data.draw(st.integers(0, len(self.network) - 1))
        if drop:
            self.network.pop(i)
        else:
            self.network.append(self.network[i])

    def _deliver(self, kind, request, reader, sent_at):
        if kind == "started":
            reply = self.w.handle(P.PullStarted(request_id=request, reader_id=reader,
                                                expected_readers=EXPECTED[request], block_ids=BLOCKS))
        elif kind == "renew":
            reply = self.w.handle(P.LeaseRenew(request_id=request, reader_id=reader))
        elif kind == "done":
            reply = self.w.handle(P.PullDone(request_id=request, reader_id=reader, ok=True,
                                             expected_readers=EXPECTED[request]))
            self.done_readers.setdefault(request, set()).add(reader)
            self.granted.pop((request, reader), None)
        elif kind == "free":
            reply = self.w.handle(P.FreeNow(request_id=request, reader_id=reader))
        else:
            reply = self.w.handle(P.HoldKeepAlive(request_id=request, reader_id=reader))
            if isinstance(reply, P.Ack):
                limit = self.start[request] + self.deadline_ttl(request) + KEEPALIVE_MAX_S
                self.deadline[request] = max(self.deadline[request], min(self.now + LEASE_S, limit))
        if kind in ("started", "renew") and isinstance(reply, P.Ack):
            self.granted[(request, reader)] = self.now + LEASE_S
            if reader not in self.dead and (kind == "started" or (request, reader) in self.believed):
                # The reader only knows when it sent: never later than the grant.
                self.believed[(request, reader)] = max(self.believed.get((request, reader), 0.0), sent_at + LEASE_S)
        self._collect()

    def deadline_ttl(self, request: str) -> float:
        return self.w.holder.ledger._holds[request].ttl_s if request in self.w.holder.ledger._holds else HOLD_S

    # ---- reads and invariants --------------------------------------------------------------------
    @rule(reader=st.sampled_from(READERS), request=st.sampled_from(REQUESTS))
    def read(self, reader, request):
        lease = self.believed.get((request, reader))
        if lease is not None and self.now < lease:
            assert request not in self.freed, f"{reader} reads {request} after its blocks were freed"

    def _collect(self):
        sending, _ = self.w.get_finished()
        for request in sending or ():
            self.freed[request] = self.freed.get(request, 0) + 1
            self.held.discard(request)
            for key in [k for k in self.granted if k[0] == request]:
                del self.granted[key]

    @invariant()
    def freed_at_most_once(self):
        assert all(n == 1 for n in self.freed.values()), self.freed

    @invariant()
    def freed_as_done_only_after_every_reader(self):
        for request in self.freed:
            if self.w.holder.ledger.freed_reason(request) == "done":
                assert len(self.done_readers.get(request, ())) >= EXPECTED[request], (
                    f"{request} freed as done after {sorted(self.done_readers.get(request, ()))} of "
                    f"{EXPECTED[request]} readers")

    @invariant()
    def never_held_past_hold_and_lease(self):
        self._collect()
        for request in self.held:
            leases = [end for (r, _), end in self.granted.items() if r == request]
            assert self.now < self.deadline[request] or any(end > self.now for end in leases), (
                f"{request} still held at {self.now}: deadline {self.deadline[request]}, leases {leases}")

    def teardown(self):
        self.now += 10 * (HOLD_S + KEEPALIVE_MAX_S + LEASE_S)
        self._collect()
        assert self.held == set() and all(n == 1 for n in self.freed.values()), (self.held, self.freed)
        self.w.close()


HoldProtocol.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_hold_protocol_model = HoldProtocol.TestCase
