from __future__ import annotations

import threading

from kv_common.failure_ledger import FailureLedger


def test_all_groups_are_reported():
    ledger = FailureLedger()
    ledger.record_failed_load("r1", [[1, 2, 3], [10, 11], [20]])  # three KV-cache groups
    assert len(ledger) == 1
    assert ledger.take_block_ids_with_load_errors() == {1, 2, 3, 10, 11, 20}
    assert ledger.take_failed_requests() == {"r1"}


def test_take_drains():
    ledger = FailureLedger()
    ledger.record_failed_load("r1", [(1,), (2,)])
    ledger.record_failed_load("r2", [(3,), ()])
    assert ledger.take_block_ids_with_load_errors() == {1, 2, 3}
    assert ledger.take_block_ids_with_load_errors() == set()
    assert ledger.take_failed_requests() == {"r1", "r2"}
    assert ledger.take_failed_requests() == set()
    assert len(ledger) == 0


def test_blocks_and_requests_drain_independently():
    ledger = FailureLedger()
    ledger.record_failed_load("r1", [[5]])
    assert ledger.take_failed_requests() == {"r1"}
    assert ledger.take_block_ids_with_load_errors() == {5}


def test_concurrent_records_none_lost():
    ledger = FailureLedger()
    taken: set[int] = set()

    def recorder(base: int) -> None:
        for i in range(500):
            ledger.record_failed_load(f"r{base}-{i}", [[base * 10_000 + i], [base * 10_000 + 5000 + i]])

    def drainer() -> None:
        for _ in range(200):
            taken.update(ledger.take_block_ids_with_load_errors())

    threads = [threading.Thread(target=recorder, args=(b,)) for b in range(4)]
    threads.append(threading.Thread(target=drainer))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    taken.update(ledger.take_block_ids_with_load_errors())
    assert len(taken) == 4 * 500 * 2
    assert len(ledger.take_failed_requests()) == 2000


def test_memory_stays_bounded_over_100k_failed_loads():
    """Issue 23 §8: the ledger kept one request id per failed load for ever (nobody takes them)."""
    import tracemalloc

    ledger = FailureLedger()
    tracemalloc.start()
    try:
        for step in range(1000):
            for i in range(100):
                ledger.record_failed_load(f"request-{step}-{i}", [[i]])
            ledger.take_block_ids_with_load_errors()  # vLLM drains the blocks every step
            if step == 99:
                after_10k = tracemalloc.get_traced_memory()[0]
        grown = tracemalloc.get_traced_memory()[0] - after_10k
    finally:
        tracemalloc.stop()
    assert len(ledger) <= 10_000, f"{len(ledger)} request ids kept after 100k failed loads"
    assert grown < 256 << 10, f"{grown} bytes more after 100k failed loads than after 10k"


def test_a_finished_requests_entry_is_gone():
    ledger = FailureLedger()
    ledger.record_failed_load("finished", [[1]])
    ledger.record_failed_load("running", [[2]])
    ledger.forget_requests({"finished"})
    assert len(ledger) == 1
    assert ledger.take_failed_requests() == {"running"}
    assert ledger.take_block_ids_with_load_errors() == {1, 2}  # the step's blocks are still reported
