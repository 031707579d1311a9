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
