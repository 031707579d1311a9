"""Failed KV loads, collected on the worker and drained once per step for vLLM.

vLLM asks the worker for ``get_block_ids_with_load_errors()`` so it can recompute those blocks
instead of reading garbage; a request can span several KV-cache groups (full attention, sliding
window, ...), and every group's blocks are bad after a failed load, not only the first group's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence


class FailureLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # transfers fail on background threads
        self._block_ids: set[int] = set()
        self._requests: set[str] = set()

    def record_failed_load(self, request_id: str, block_ids: Sequence[Iterable[int]]) -> None:
        """``block_ids``: one sequence of block ids per KV-cache group."""
        with self._lock:
            self._requests.add(request_id)
            for group in block_ids:
                self._block_ids.update(int(block_id) for block_id in group)

    def take_block_ids_with_load_errors(self) -> set[int]:
        """All failed block ids across all groups since the last call, then forgets them."""
        with self._lock:
            taken, self._block_ids = self._block_ids, set()
        return taken

    def take_failed_requests(self) -> set[str]:
        with self._lock:
            taken, self._requests = self._requests, set()
        return taken

    def __len__(self) -> int:
        """Requests recorded and not yet taken."""
        with self._lock:
            return len(self._requests)
