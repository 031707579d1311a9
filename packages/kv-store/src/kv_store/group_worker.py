"""Worker side under several KV-cache groups: one ``StoreWorker`` per group, one request view.

Each group's blocks are values of their own (its layers, then the trailer) under the group's tag
(``group_blocks``), so each group has a ``StoreWorker`` of its own: its block view, saver, loader
and namespace manifest. The scheduler sends each transfer to one group (``BlockTransfer.group``).
vLLM knows requests, not groups: a request's saves (or async load) are over once every group that
was given one reported it, and that is when this worker reports it.

- A windowed group's blocks are freed by vLLM while the request runs (they leave the window), not
  held until it finishes like full-attention blocks: its saves complete (or are given up at
  ``save_timeout_s``) before the step returns, so no save reads a block vLLM gave away.
- Load errors: with several groups vLLM takes no block ids (block ids are per group), only whole
  requests of an async load (``failed_recving``); the connector loads asynchronously then.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kv_common.kv_cache_groups import FULL, KVGroup

from kv_store.metadata import BlockTransfer, StorePlan, StoreReport
from kv_store.worker import StoreWorker


def _by_group(transfers: Iterable[BlockTransfer]) -> dict[int, list[BlockTransfer]]:
    out: dict[int, list[BlockTransfer]] = defaultdict(list)
    for t in transfers:
        out[t.group].append(t)
    return out


class _Completion:
    """Per request: the groups given work, and those that reported it over."""

    def __init__(self) -> None:
        self.given: dict[str, set[int]] = defaultdict(set)
        self.over: dict[str, set[int]] = defaultdict(set)

    def give(self, request_id: str, group: int) -> None:
        self.given[request_id].add(group)

    def report(self, group: int, request_ids: Iterable[str]) -> None:
        for req_id in request_ids:
            if req_id in self.given:
                self.over[req_id].add(group)

    def take_complete(self) -> set[str]:
        done = {r for r, groups in self.over.items() if self.given[r] <= groups}
        for req_id in done:
            del self.given[req_id], self.over[req_id]
        return done


class GroupedStoreWorker:
    def __init__(self, groups: Sequence[KVGroup], workers: Mapping[int, StoreWorker]) -> None:
        self.groups = tuple(groups)
        self.workers = dict(workers)  # vLLM's group index -> its worker
        self._windowed = {g.index for g in self.groups if g.kind != FULL}
        self._saves = _Completion()
        self._loads = _Completion()

    # ---- layout ---------------------------------------------------------------------------
    def split_kv_caches(self, kv_caches: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
        """Each group's layers of ``kv_caches``; a layer of no group is refused (its KV would be
        neither saved nor loaded while the others are)."""
        owner = {name: g.index for g in self.groups for name in g.layer_names}
        out: dict[int, dict[str, Any]] = {g.index: {} for g in self.groups}
        for name, tensor in kv_caches.items():
            if name not in owner:
                raise ValueError(f"KV cache layer {name} is in none of the KV-cache groups "
                                 f"{[list(g.layer_names) for g in self.groups]}")
            out[owner[name]][name] = tensor
        return out

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        for index, caches in self.split_kv_caches(kv_caches).items():
            self.workers[index].register_kv_caches(caches)

    @property
    def value_size(self) -> int:
        """0 until every group's layout is known; else the largest value of a group."""
        sizes = [w.value_size for w in self.workers.values()]
        return 0 if not sizes or 0 in sizes else max(sizes)

    # ---- per step -------------------------------------------------------------------------
    def submit_saves(self, plan: StorePlan) -> None:
        for index, saves in _by_group(plan.saves).items():
            for t in saves:
                self._saves.give(t.request_id, index)
            self.workers[index].submit_saves(StorePlan(saves=saves))
            if index in self._windowed:
                self.workers[index].wait_for_request_saves([t.request_id for t in saves])

    def wait_for_request_saves(self, request_ids: Sequence[str]) -> None:
        for worker in self.workers.values():
            worker.wait_for_request_saves(request_ids)

    def in_flight(self) -> bool:
        """``StoreWorker.in_flight`` of any group's worker."""
        return any(w.in_flight() for w in self.workers.values())

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        for index, worker in self.workers.items():
            self._saves.report(index, worker.get_finished(finished_req_ids))
        return self._saves.take_complete()

    def _split_loads(self, plan: StorePlan) -> dict[int, StorePlan]:
        return {index: StorePlan(loads=loads) for index, loads in _by_group(plan.loads).items()}

    def load_sync(self, plan: StorePlan) -> None:
        for index, part in self._split_loads(plan).items():
            self.workers[index].load_sync(part)

    def start_async(self, plan: StorePlan) -> None:
        for index, part in self._split_loads(plan).items():
            for t in part.loads:
                self._loads.give(t.request_id, index)
            self.workers[index].start_async(part)

    def take_finished_loads(self, finished_req_ids: set[str]) -> set[str]:
        for index, worker in self.workers.items():
            self._loads.report(index, worker.take_finished_loads(finished_req_ids))
        return self._loads.take_complete()

    def take_report(self) -> StoreReport | None:
        by_tag: dict[str, list[bytes]] = {}
        removed: list[bytes] = []
        for worker in self.workers.values():
            report = worker.take_report()
            if report is None:
                continue
            for tag, hashes in report.stored_by_tag.items():
                by_tag.setdefault(tag, []).extend(hashes)
            removed.extend(report.removed)
        if not (by_tag or removed):
            return None
        return StoreReport(stored_by_tag=by_tag, removed=list(dict.fromkeys(removed)))

    def leak_report(self) -> dict[str, int]:
        total: dict[str, int] = defaultdict(int)
        for worker in self.workers.values():
            for key, n in worker.leak_report().items():
                total[key] += n
        total["held_requests"] += len(self._saves.given) + len(self._loads.given)
        return dict(total)

    def close(self, timeout_s: float) -> None:
        for worker in self.workers.values():
            worker.close(timeout_s)
