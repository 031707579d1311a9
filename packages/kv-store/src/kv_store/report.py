"""What the worker tells the scheduler after each step: block hashes it stored (saver thread) and
found missing or corrupt (loads), for the scheduler's KV events."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kv_store.metadata import StoreReport


class BlockReport:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stored: list[bytes] = []
        self._removed: list[bytes] = []

    def add_stored(self, hashes: Iterable[bytes]) -> None:
        with self._lock:
            self._stored.extend(hashes)

    def add_removed(self, block_hash: bytes) -> None:
        with self._lock:
            self._removed.append(block_hash)

    def take(self, rank_tag: str) -> StoreReport | None:
        """Everything since the last call; None when there is nothing to say."""
        with self._lock:
            stored, removed = self._stored, self._removed
            self._stored, self._removed = [], []
        if not (stored or removed):
            return None
        # stored under this rank's tag: the scheduler announces a block once every tag stored it
        return StoreReport(stored_by_tag={rank_tag: stored} if stored else {}, removed=removed)
