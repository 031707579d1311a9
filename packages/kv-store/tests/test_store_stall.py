"""A slow or hung backend never stalls the engine (issue 15 §1).

``BlockingBackend`` is a real ``EmbeddedBackend`` whose operations can be made to hang until the
test lets them go (no hardware is faked: it is the embedded store with a gate in front). Every test
bounds the time the engine-side call takes and checks that no late result of the hung call leaks
into the KV cache, the failure ledger or the store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgspec
import pytest

torch = pytest.importorskip("torch")

from kv_common.backend import BackendCapabilities, scatter_into_parts
from kv_common.embedded_backend import EmbeddedBackend
from kv_store.config import StoreConnectorConfig
from kv_store.embedded import EmbeddedStoreBackend
from kv_store.metadata import BlockTransfer, StorePlan
from kv_store.scheduler import StoreScheduler
from kv_store.worker import StoreWorker
from test_store_scheduler_worker import BS, FakeBlocks, FakeRequest, new_req_output

HANG_S = 30.0  # a hung call waits at most this long for the test to let it go


class BlockingBackend(EmbeddedBackend):
    """The embedded store; ``hold(op)`` makes every later call of ``op`` ("exists", "put", "get")
    hang until ``release(op)``."""

    # Its calls wait on a gate, as a remote store's do: called on an I/O thread, as Mooncake is.
    calls_release_gil = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._gates: dict[str, threading.Event] = {}
        self.entered: dict[str, int] = {"exists": 0, "put": 0, "get": 0}

    def hold(self, op: str) -> None:
        self._gates[op] = threading.Event()

    def release(self, op: str) -> None:
        gate = self._gates.pop(op, None)
        if gate is not None:
            gate.set()

    def release_all(self) -> None:
        for op in list(self._gates):
            self.release(op)

    def _gate(self, op: str) -> None:
        self.entered[op] += 1
        gate = self._gates.get(op)
        if gate is not None:
            gate.wait(HANG_S)

    def batch_exists(self, keys):
        self._gate("exists")
        return super().batch_exists(keys)

    def batch_put(self, keys, values):
        self._gate("put")
        return super().batch_put(keys, values)

    def batch_get_into(self, keys, buffers):
        self._gate("get")
        return super().batch_get_into(keys, buffers)


class BlockingPartsBackend(BlockingBackend):
    """With the worker's zero-copy parts protocol (as kv-store's embedded and Mooncake backends)."""

    capabilities = BackendCapabilities(zero_copy_parts=True)

    def batch_put_parts(self, keys, parts):
        return self.batch_put(keys, [b"".join(p) for p in parts])

    def batch_get_parts(self, keys, parts):
        self._gate("get")
        return [scatter_into_parts(v, bufs) for v, bufs in zip(super().batch_get(keys), parts, strict=True)]


class BlockingOwnedBackend(BlockingPartsBackend):
    """With kv-store's embedded backend's owned puts too: the saver joins and seals each value, the
    store keeps it (the path the embedded store takes)."""

    capabilities = BackendCapabilities(zero_copy_parts=True, owned_puts=True)

    def batch_put_owned(self, keys, values):
        self._gate("put")
        return EmbeddedStoreBackend.batch_put_owned(self, keys, values)


@pytest.fixture(params=[BlockingBackend, BlockingPartsBackend, BlockingOwnedBackend], ids=["staging", "parts", "owned"])
def backend(request):
    b = request.param(16 << 20)
    yield b
    b.release_all()


def timed(fn: Callable[[], object], limit_s: float) -> float:
    """Run ``fn`` on a thread; fail (instead of hanging the test run) when it takes over ``limit_s``."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["exc"] = exc

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    took = time.monotonic() - t0
    assert not thread.is_alive(), f"still blocked after {limit_s:.1f}s: a hung backend stalls the engine"
    if "exc" in box:
        raise box["exc"]  # type: ignore[misc]
    return took


def wait_until(condition: Callable[[], bool], limit_s: float = 10.0) -> None:
    """Poll ``condition`` (a thread of the code under test reaching a point) until it holds."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {limit_s:.0f}s"
        time.sleep(0.005)


def make_worker(backend, num_blocks=16, **cfg):
    torch.manual_seed(0)
    caches = {f"layer{i}": torch.randn(num_blocks, 2, BS, 8) for i in range(2)}
    worker = StoreWorker(backend=backend, namespace="ns", rank_tag="r0",
                         config=StoreConnectorConfig(staging_bytes=1 << 16, **cfg))
    worker.register_kv_caches(caches)
    return worker, caches


def transfer(req_id: str, hashes: list[bytes], ids: list[int]) -> BlockTransfer:
    return BlockTransfer(request_id=req_id, block_hashes=hashes, block_ids=[ids])


HASHES = [bytes([i]) * 32 for i in range(1, 5)]


def saved_worker(backend, **cfg):
    """A worker whose blocks 1-4 are in the store (saved with the backend still answering)."""
    worker, caches = make_worker(backend, **cfg)
    worker.submit_saves(StorePlan(saves=[transfer("w", HASHES, [1, 2, 3, 4])]))
    worker.wait_for_request_saves(["w"])
    assert backend.batch_exists(worker.keys(HASHES)) == [True] * 4
    return worker, caches


# ---- lookups ---------------------------------------------------------------------------------

def test_lookup_breaker_stops_waiting_on_a_hung_backend():
    """Sync lookups wait lookup_timeout_s each; after 3 timeouts in a row the breaker opens and
    every later request is a miss at once (counted), until the back-off ends and a probe answers."""
    backend = BlockingBackend(16 << 20)
    offset = [0.0]
    sched = StoreScheduler(
        backend=backend, namespace="ns", rank_tags=["r0"], block_size=BS,
        config=StoreConnectorConfig(lookup_timeout_s=0.2), load_enabled=True, save_enabled=True,
        clock=lambda: time.monotonic() + offset[0],
    )
    backend.hold("exists")
    requests = [FakeRequest(f"r{i}", list(range(i, i + 18))) for i in range(10)]
    answers = []
    took = timed(lambda: answers.extend(sched.get_num_new_matched_tokens(r, 0) for r in requests), 20.0)
    assert answers == [(0, False)] * 10
    # 3 lookups wait 0.2 s each, the 7 after them none (the counters below prove it; the time
    # only shows that no lookup waited for the hung call).
    assert took < 10, took
    counters = sched.stats.reduce()
    assert counters.get("lookup_timeouts") == 3, counters
    assert counters.get("lookup_breaker_opened") == 1, counters
    assert counters.get("lookup_breaker_skips") == 7, counters
    # The first lookup hangs in the backend, the 2 queued behind it were cancelled. (On a loaded
    # machine the lookup thread may not even have started the first before its deadline: then
    # all 3 were cancelled and none reached the backend.)
    futures = [sched._lookups[r.request_id].future for r in requests[:3]]
    started = sum(not f.cancelled() for f in futures)
    assert started <= 1, started
    for r in requests:
        sched.update_state_after_alloc(r, FakeBlocks([]), 0)
    # The backend recovers; once the back-off is over a probe goes through and closes the breaker.
    backend.release("exists")
    sched._executor.submit(lambda: None).result(5)  # the released call is over
    assert backend.entered["exists"] == started  # no cancelled lookup reached the backend
    offset[0] += StoreConnectorConfig().lookup_backoff_s + 1
    # A generous deadline for the probe: it proves the breaker lets it through, not its speed.
    sched.config = msgspec.structs.replace(sched.config, lookup_timeout_s=10.0)
    probe = FakeRequest("probe", list(range(100, 118)))
    assert sched.get_num_new_matched_tokens(probe, 0) == (0, False)
    assert backend.entered["exists"] == started + 1  # the probe
    counters = sched.stats.reduce()
    assert counters.get("lookup_breaker_skips") == 7, counters
    assert counters.get("lookup_timeouts") == 3, counters  # the probe was answered
    sched.update_state_after_alloc(probe, FakeBlocks([]), 0)
    assert sched.leak_report()["pending_loads"] == 0
    sched.close()


def test_async_lookups_pending_on_a_hung_backend_end_when_the_breaker_opens():
    backend = BlockingBackend(16 << 20)
    # Async lookups never wait, so a clock the test moves replaces wall time: a descheduled test
    # thread cannot push a lookup past its deadline before the first answer.
    now = [0.0]
    sched = StoreScheduler(
        backend=backend, namespace="ns", rank_tags=["r0"], block_size=BS,
        config=StoreConnectorConfig(lookup_mode="async", lookup_timeout_s=0.1, lookup_breaker_threshold=2),
        load_enabled=True, save_enabled=True, clock=lambda: now[0],
    )
    backend.hold("exists")
    reqs = [FakeRequest(f"a{i}", list(range(i, i + 18))) for i in range(4)]
    assert [sched.get_num_new_matched_tokens(r, 0) for r in reqs] == [(None, False)] * 4
    now[0] += 0.15
    # all four are past their deadline: two time out (opening the breaker), the rest are misses now
    assert [sched.get_num_new_matched_tokens(r, 0) for r in reqs] == [(0, False)] * 4
    assert sched.stats.reduce().get("lookup_breaker_opened") == 1
    backend.release_all()
    sched.close()


# ---- loads -----------------------------------------------------------------------------------

def test_hung_load_becomes_a_load_error_within_its_deadline(backend):
    worker, caches = saved_worker(backend, load_timeout_s=0.3)
    before = {name: c[9:13].clone() for name, c in caches.items()}
    backend.hold("get")
    plan = StorePlan(loads=[transfer("x", HASHES, [9, 10, 11, 12])])
    took = timed(lambda: worker.load_sync(plan), 15.0)
    assert 0.25 <= took < 10, took  # the deadline, not the 30 s hang
    assert worker.ledger.take_block_ids_with_load_errors() == {9, 10, 11, 12}
    # While the late fetch still hangs, the next load fails at once instead of queueing behind it
    # (skipped, not timed out: the counters below).
    timed(lambda: worker.load_sync(StorePlan(loads=[transfer("y", HASHES[:2], [13, 14])])), 15.0)
    assert worker.ledger.take_block_ids_with_load_errors() == {13, 14}
    counters = worker.stats.reduce()
    assert counters["load_timeouts"] == 1 and counters["loads_skipped_backend_stalled"] == 1, counters
    # The late fetch returns: nothing of it lands in the KV cache vLLM recomputes, nor in the ledger.
    backend.release("get")
    wait_until(lambda: not worker.loader.busy())
    for name, c in caches.items():
        assert torch.equal(c[9:13], before[name]), f"{name}: a late fetch wrote into the KV cache"
    assert worker.ledger.take_block_ids_with_load_errors() == set()
    # The backend answers again: loads work again (a generous deadline: this load proves the
    # backend answers, not its speed on a loaded machine).
    worker.loader.config = msgspec.structs.replace(worker.config, load_timeout_s=10.0)
    worker.load_sync(StorePlan(loads=[transfer("z", HASHES, [9, 10, 11, 12])]))
    assert worker.ledger.take_block_ids_with_load_errors() == set()
    for c in caches.values():
        assert torch.equal(c[9:13], c[1:5])
    worker.close(1)


# ---- saves -----------------------------------------------------------------------------------

def test_hung_save_releases_its_request_and_later_saves_are_skipped(backend):
    worker, caches = make_worker(backend, save_timeout_s=0.3)
    backend.hold("put")
    t0 = time.monotonic()
    worker.submit_saves(StorePlan(saves=[transfer("s", HASHES[:2], [1, 2])]))
    worker.submit_saves(StorePlan(saves=[transfer("s", HASHES[2:], [3, 4])]))  # queued behind it
    wait_until(lambda: backend.entered["put"] >= 1)  # the first chunk hangs in the backend
    done = worker.get_finished({"s"})
    # not given up before its deadline (a descheduled test thread may only ask after it)
    assert not done or time.monotonic() - t0 > 0.3, done

    def finish():
        deadline = time.monotonic() + 10
        while "s" not in done and time.monotonic() < deadline:
            done.update(worker.get_finished(set()))
            time.sleep(0.02)

    took = timed(finish, 15.0)
    assert done == {"s"}, "a finished request waits for ever on a hung save: its blocks are never freed"
    assert took < 10, took  # the save deadline, not the 30 s hang
    # Preemption waits at most until the save deadline, too. "s" was given up save_timeout_s after
    # it was submitted; the saver counts from when it started the save, which may be later.
    wait_until(worker.saver.stalled)
    worker.submit_saves(StorePlan(saves=[transfer("p", [bytes([9]) * 32], [5])]))
    # (skipped: the saver has been stuck for longer than save_timeout_s)
    assert worker.stats.reduce().get("failures_save_skipped_backend_stalled") == 1
    assert timed(lambda: worker.wait_for_request_saves(["p"]), 15.0) < 10
    # vLLM reuses the released blocks; when the backend comes back, the queued chunk of "s" must
    # not be gathered from them.
    for c in caches.values():
        c[1:5] = 0
    backend.release("put")
    worker.saver._executor.submit(lambda: None).result(10)  # the saver has passed both chunks of "s"
    assert backend.batch_exists(worker.keys(HASHES[2:])) == [False, False]
    assert worker.get_finished({"p"}) == {"p"}  # vLLM finishes the preempted request later
    assert worker.leak_report()["held_requests"] == 0
    worker.close(1)


class LateReadingPartsBackend(BlockingPartsBackend):
    """Reads the parts of a put only after the gate opens (as Mooncake reads the KV buffers after
    the master answered): a given-up save can then read blocks vLLM has reused."""

    def batch_put_parts(self, keys, parts):
        self._gate("put")
        return EmbeddedBackend.batch_put(self, keys, [b"".join(p) for p in parts])


@pytest.mark.parametrize("checksum", [False, True], ids=["no-checksum", "checksum"])
def test_a_given_up_save_never_stores_another_requests_kv(checksum):
    backend = LateReadingPartsBackend(16 << 20)
    try:
        worker, caches = make_worker(backend, save_timeout_s=0.3, checksum=checksum)
        original = {name: c[1:3].clone() for name, c in caches.items()}
        backend.hold("put")
        worker.submit_saves(StorePlan(saves=[transfer("s", HASHES[:2], [1, 2])]))
        wait_until(lambda: backend.entered["put"] >= 1)  # the save is running, not still queued
        time.sleep(0.4)
        assert worker.get_finished({"s"}) == {"s"}  # given up: vLLM frees and reuses blocks 1-2
        for c in caches.values():
            c[1:3] = 7.0
        backend.release("put")
        deadline = time.monotonic() + 10
        while backend.batch_exists(worker.keys(HASHES[:2])) != [True, True] and time.monotonic() < deadline:
            time.sleep(0.02)
        worker.load_sync(StorePlan(loads=[transfer("l", HASHES[:2], [9, 10])]))
        failed = worker.ledger.take_block_ids_with_load_errors()
        for name, c in caches.items():
            # either the request's own KV was stored, or the load fails (recompute): never the 7s
            assert failed == {9, 10} or torch.equal(c[9:11], original[name]), "another request's KV was stored"
        worker.close(1)
    finally:
        backend.release_all()


def test_saves_of_a_healthy_backend_are_not_given_up(backend):
    # A deadline (so saves can be given up) that a healthy save meets even on a loaded machine.
    worker, _ = make_worker(backend, save_timeout_s=10)
    worker.submit_saves(StorePlan(saves=[transfer("s", HASHES, [1, 2, 3, 4])]))
    worker.wait_for_request_saves(["s"])
    assert worker.get_finished({"s"}) == {"s"}
    assert backend.batch_exists(worker.keys(HASHES)) == [True] * 4
    assert "save_timeouts" not in worker.stats.reduce()
    worker.close(1)


def test_scheduler_plan_after_breaker_skip_schedules_no_load():
    """A request answered "miss" by the open breaker gets no load and still saves its blocks."""
    backend = BlockingBackend(16 << 20)
    sched = StoreScheduler(
        backend=backend, namespace="ns", rank_tags=["r0"], block_size=BS,
        config=StoreConnectorConfig(lookup_timeout_s=0.05, lookup_breaker_threshold=1),
        load_enabled=True, save_enabled=True,
    )
    backend.hold("exists")
    first, second = FakeRequest("f", list(range(18))), FakeRequest("g", list(range(18)))
    assert sched.get_num_new_matched_tokens(first, 0) == (0, False)  # times out, opens the breaker
    assert sched.get_num_new_matched_tokens(second, 0) == (0, False)  # skipped
    sched.update_state_after_alloc(second, FakeBlocks([1, 2, 3, 4, 5]), 0)
    plan = sched.build_plan(new_req_output(second, [1, 2, 3, 4, 5], 0, 18))
    assert not plan.loads and [len(s.block_hashes) for s in plan.saves] == [4]
    backend.release_all()
    sched.close()


class SecondGetHangs(BlockingBackend):
    """Staging only: once ``arm``ed, the first get answers and every later one hangs (until
    ``release``), so a load of several passes is cut off between them."""

    def arm(self) -> None:
        self._armed_at = self.entered["get"]

    def batch_get_into(self, keys, buffers):
        if getattr(self, "_armed_at", None) is not None and self.entered["get"] > self._armed_at:
            self.hold("get")
        return super().batch_get_into(keys, buffers)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_staged_load_scatters_each_checked_pass_and_nothing_after_its_deadline(mode):
    """Through staging each pass lands in the KV cache as soon as it is checked, while the next
    one is fetched; once the load is given up at its deadline, nothing more lands, even when the
    hung get returns."""
    backend = SecondGetHangs(16 << 20)
    worker, caches = saved_worker(backend, load_timeout_s=3.0, load_mode=mode)
    backend.pass_bytes = 2 * worker.value_size  # 4 blocks: two passes
    before = {name: c[9:13].clone() for name, c in caches.items()}
    backend.arm()
    plan = StorePlan(loads=[transfer("x", HASHES, [9, 10, 11, 12])])
    t0 = time.monotonic()
    done = threading.Thread(target=worker.load_sync if mode == "sync" else worker.start_async, args=(plan,))
    done.start()
    # The second pass hangs in the backend; the first pass is in the KV cache already.
    wait_until(lambda: backend.entered["get"] >= 2, 2.5)
    wait_until(lambda: all(torch.equal(c[9:11], c[1:3]) for c in caches.values()), 2.5)
    assert time.monotonic() - t0 < 3.0, "the first pass landed only after the deadline: nothing shown"
    if mode == "sync":
        done.join(15)
        assert not done.is_alive()
    else:
        done.join(15)
        wait_until(lambda: worker.take_finished_loads(set()) == {"x"}, 15)
    assert time.monotonic() - t0 >= 2.9  # given up at the deadline, not earlier
    assert worker.ledger.take_block_ids_with_load_errors() == {9, 10, 11, 12}
    backend.release_all()  # the hung get returns: its pass never reaches the KV cache
    late = worker.loader._late_fetch if mode == "sync" else worker.loader._async_late
    assert late is not None
    late.exception(10)
    for name, c in caches.items():
        assert torch.equal(c[11:13], before[name][2:]), f"{name}: a given-up load wrote into the KV cache"
    assert worker.ledger.take_block_ids_with_load_errors() == set()
    worker.close(1)
