"""Failed KV loads, collected on the worker and drained once per step for vLLM.

vLLM asks the worker for ``get_block_ids_with_load_errors()`` so it can recompute those blocks
instead of reading garbage; a request can span several KV-cache groups (full attention, sliding
window, ...), and every group's blocks are bad after a failed load, not only the first group's.

The ids of the requests whose loads failed are kept for ``take_failed_requests`` until taken, or
until the request finishes (``forget_requests``), and at most ``MAX_FAILED_REQUESTS`` of them
(oldest dropped first): a worker that nobody asks must not grow by one id per failed load.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

MAX_FAILED_REQUESTS = 10_000


class FailureLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # transfers fail on background threads
        self._block_ids: set[int] = set()
        self._requests: dict[str, None] = {}  # insertion order: the oldest is dropped first

    def record_failed_load(self, request_id: str, block_ids: Sequence[Iterable[int]]) -> None:
        """``block_ids``: one sequence of block ids per KV-cache group."""
        with self._lock:
            self._requests[request_id] = None
            while len(self._requests) > MAX_FAILED_REQUESTS:
                del self._requests[next(iter(self._requests))]
            for group in block_ids:
                self._block_ids.update(int(block_id) for block_id in group)

    def take_block_ids_with_load_errors(self) -> set[int]:
        """All failed block ids across all groups since the last call, then forgets them."""
        with self._lock:
            taken, self._block_ids = self._block_ids, set()
        return taken

    def take_failed_requests(self) -> set[str]:
        with self._lock:
            taken, self._requests = self._requests, {}
        return set(taken)

    def forget_requests(self, request_ids: Iterable[str]) -> None:
        """vLLM finished these requests: their failures are no longer anybody's business (their
        blocks were reported in the step they failed)."""
        with self._lock:
            for request_id in request_ids:
                self._requests.pop(request_id, None)

    def __len__(self) -> int:
        """Requests recorded and not yet taken."""
        with self._lock:
            return len(self._requests)
