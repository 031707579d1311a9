"""Scheduler side: lookup with a deadline, the per-step load/save plan, held blocks, KV events.

No torch here; the backend is only asked ``batch_exists``.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from kv_common.backend import Backend
from kv_common.kv_cache_groups import KVGroup
from kv_common.logging_utils import get_logger

from kv_store import group_blocks
from kv_store import keys as keys_mod
from kv_store.config import StoreConnectorConfig
from kv_store.lookup import external_tokens, leading_present, loadable_blocks, lookup_breaker
from kv_store.metadata import BlockTransfer, StorePlan, StoreReport
from kv_store.stats import StoreStats

logger = get_logger(__name__)

MAX_EVENTS = 10_000  # events nobody drains are dropped oldest first
MAX_TRACKED_BLOCKS = 100_000  # token ids kept for BlockStored events of saves in flight


@dataclass
class _Lookup:
    first_block: int
    num_blocks: int
    deadline: float
    future: Future | None
    present: int | None = None  # leading blocks found (from first_block), once answered


@dataclass
class _RequestState:
    request: Any
    block_ids: list[list[int]] = field(default_factory=list)
    saved_upto: int = 0  # blocks [0, saved_upto) are in the store or scheduled for saving
    has_saves: bool = False


def hash_block_size(cache_block_size: int, dcp_size: int, kv_cache_config: Any = None) -> int:
    """Tokens per ``Request.block_hashes`` entry and per scheduler block id: the unit of every
    count on this side. vLLM 0.32 hashes and aligns prefixes in blocks of ``block_size * dcp``
    under decode context parallelism (each DCP rank holds its share of a block's tokens in a cache
    block of ``block_size`` rows) and says so in ``kv_cache_config.hash_block_size``."""
    resolved = int(getattr(kv_cache_config, "hash_block_size", 0) or 0)
    return resolved if resolved > 0 else cache_block_size * max(1, dcp_size)


class StoreScheduler:
    def __init__(
        self,
        *,
        backend: Backend,
        namespace: str,
        rank_tags: Sequence[str],
        block_size: int,
        config: StoreConnectorConfig,
        load_enabled: bool,
        save_enabled: bool,
        stats: StoreStats | None = None,
        clock: Callable[[], float] = time.monotonic,
        groups: Sequence[KVGroup] = (),
    ) -> None:
        """``groups``: vLLM's KV-cache groups (``kv_common.kv_cache_groups.kv_groups``). With more
        than one, each group's blocks are values of their own under the group's tags, and each
        transfer names its group (``group_blocks``); with one or none, one value holds every layer."""
        self.backend = backend
        self.namespace = namespace
        self.groups = tuple(groups) if len(groups) > 1 else ()
        n = len(self.groups)
        # per group: its tag on every rank (single group: the rank tags themselves)
        self.group_tags = [[group_blocks.group_tag(t, g, n) for t in rank_tags] for g in self.groups]
        events = group_blocks.event_groups(self.groups)
        # the tags a block must be stored under before its BlockStored event
        self.rank_tags = ([t for g in events for t in self.group_tags[self.groups.index(g)]] if self.groups
                          else list(rank_tags))
        self.block_size = block_size
        self.config = config
        self.load_enabled = load_enabled
        self.save_enabled = save_enabled
        self.stats = stats if stats is not None else StoreStats()
        self._clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-lookup")
        self._lookups: dict[str, _Lookup] = {}
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: list[BlockTransfer] = []
        self._held: set[str] = set()  # finished, blocks kept until the workers' saves complete
        # Requests given an async load once: when vLLM asks again (the load failed with no valid
        # block, or a preemption) they are a miss. Otherwise a hit whose load keeps failing (a get
        # past load_timeout_s while exists still answers) would be offered, fail, be freed and
        # looked up again for ever; a sync load recovers in place instead.
        self._async_loaded: set[str] = set()
        self._events: deque[Any] = deque(maxlen=MAX_EVENTS)
        self._lookup_errors_logged = False
        self._breaker = lookup_breaker(config.lookup_breaker_threshold, config.lookup_backoff_s, clock)
        # block hash -> (parent hash, token ids) of saves in flight, for BlockStored events
        self._block_tokens: dict[bytes, tuple[bytes | None, list[int]]] = {}
        # block hash -> rank tags that stored it, until every tag has (oldest first, bounded)
        self._stored_tags: OrderedDict[bytes, set[str]] = OrderedDict()

    # ---- lookup -------------------------------------------------------------------------
    def _exists(self, hashes: list[Any], tags: Sequence[str] | None = None) -> list[list[bool]]:
        per_rank = keys_mod.keys_for_ranks(self.namespace, self.rank_tags if tags is None else tags, hashes)
        flat = [k for keys in per_rank for k in keys]
        found = self.backend.batch_exists(flat)
        n = len(hashes)
        return [list(found[i * n : (i + 1) * n]) for i in range(len(per_rank))]

    def _present_blocks(self, hashes: list[Any], first: int) -> int:
        """Blocks from ``first`` (``hashes`` = the request's hashes ``first:end``) a hit can load."""
        if not self.groups:
            return leading_present(self._exists(hashes))
        end = first + len(hashes)
        present: list[list[bool]] = []
        for group, tags in zip(self.groups, self.group_tags, strict=True):
            lo, _ = group_blocks.lookup_range(group, first, end, self.block_size)
            found = self._exists(hashes[lo - first :], tags)
            # blocks below lo are never needed: count them present
            present.append([True] * (lo - first) + [all(col) for col in zip(*found, strict=True)])
        return group_blocks.hit_blocks(self.groups, present, first, end, self.block_size)

    def _answer(self, lookup: _Lookup, wait_s: float) -> bool:
        """Fill ``lookup.present`` if the lookup finished within ``wait_s``; True when answered."""
        if lookup.present is not None:
            return True
        assert lookup.future is not None
        try:
            result = lookup.future.result(timeout=max(wait_s, 0.0))
        except FutureTimeout:
            if self._clock() < lookup.deadline and not self._breaker.cooling_down:
                return False
            lookup.future.cancel()
            lookup.present = 0
            if self._breaker.cooling_down:  # opened by another lookup meanwhile: do not wait out this one
                return True
            self.stats.incr("lookup_timeouts")
            if self._breaker.failure():
                self.stats.incr("lookup_breaker_opened")
                logger.warning(
                    "store lookup timed out %d times in a row (%.3fs each): not asking the backend for %.0fs "
                    "(every lookup is a miss meanwhile)", self._breaker.failures,
                    self.config.lookup_timeout_s, self.config.lookup_backoff_s,
                )
            else:
                logger.warning("store lookup exceeded %.3fs: counted as a miss", self.config.lookup_timeout_s)
            return True
        except Exception as exc:  # noqa: BLE001 - a broken store is a miss, not a failed request
            self.stats.record_failure("lookup_error")
            if not self._lookup_errors_logged:
                logger.warning("store lookup failed (%s): counted as a miss", exc)
                self._lookup_errors_logged = True
            lookup.present = 0
            return True
        self._breaker.success()
        lookup.present = int(result)
        return True

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.load_enabled:
            return 0, False
        hashes = list(request.block_hashes)
        num_blocks = loadable_blocks(request.num_tokens, len(hashes), self.block_size)
        first = num_computed_tokens // self.block_size
        if num_blocks <= first:
            return 0, False
        req_id = request.request_id
        if req_id in self._async_loaded:
            return 0, False
        lookup = self._lookups.get(req_id)
        if lookup is None or (lookup.first_block, lookup.num_blocks) != (first, num_blocks):
            if not self._breaker.allow():
                self._lookups.pop(req_id, None)
                self.stats.incr("lookup_breaker_skips")
                return 0, False
            deadline = self._clock() + self.config.lookup_timeout_s
            future = self._executor.submit(self._present_blocks, hashes[first:num_blocks], first)
            lookup = self._lookups[req_id] = _Lookup(first, num_blocks, deadline, future)
        if self.config.lookup_mode == "async":
            if not self._answer(lookup, 0.0):
                return None, False  # ask again next step; the scheduler is not held up
        else:
            self._answer(lookup, lookup.deadline - self._clock())
        assert lookup.present is not None
        tokens = external_tokens(num_computed_tokens, first, lookup.present, self.block_size)
        # load_mode "async": vLLM holds the request in WAITING_FOR_REMOTE_KVS while the workers load
        # in the background and schedules it once every worker reports it in finished_recving.
        return tokens, self.config.load_mode == "async" and tokens > 0

    # ---- allocation and per-step plan -----------------------------------------------------
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = _RequestState(request)
        state.request = request
        lookup = self._lookups.pop(req_id, None)
        if num_external_tokens <= 0 or lookup is None:
            # saved_upto stays where it is (0 for a new request), not at the local hit: blocks vLLM
            # serves from its own prefix cache are saved too, so after the backend lost them (master
            # restart, eviction) they are published again; the worker's exists check skips the ones
            # the store still has.
            if lookup is not None:
                self.stats.incr("lookup_misses")
            return
        block_ids = [list(g) for g in blocks.get_block_ids()]
        first = lookup.first_block
        count = num_external_tokens // self.block_size
        hashes = [bytes(h) if isinstance(h, (bytes, bytearray)) else h for h in request.block_hashes[first : first + count]]
        if self.groups:
            self._pending_loads.extend(self._group_transfers(req_id, request.block_hashes, block_ids, [
                group_blocks.hit_range(g, first, first + count, self.block_size) for g in self.groups]))
        else:
            self._pending_loads.append(
                BlockTransfer(
                    request_id=req_id,
                    block_hashes=hashes,
                    block_ids=[g[first : first + count] for g in block_ids],
                )
            )
        state.saved_upto = max(state.saved_upto, first + count)
        if self.config.load_mode == "async":
            self._async_loaded.add(req_id)
        self.stats.incr("lookup_hits")
        self.stats.incr("lookup_hit_tokens", num_external_tokens)

    def _group_transfers(self, req_id: str, hashes: Sequence[Any], block_ids: Sequence[Sequence[int]],
                         ranges: Sequence[tuple[int, int]]) -> list[BlockTransfer]:
        """One transfer per group over its block range; vLLM's null block is never read nor written."""
        out = []
        for group, (lo, hi) in zip(self.groups, ranges, strict=True):
            ids = block_ids[group.index]
            idx = [k for k in range(lo, min(hi, len(ids))) if ids[k] != group_blocks.NULL_BLOCK_ID]
            if idx:
                out.append(BlockTransfer(request_id=req_id, block_hashes=[bytes(hashes[k]) for k in idx],
                                         block_ids=[[ids[k] for k in idx]], group=group.index))
        return out

    def _plan_save(self, state: _RequestState, computed_after: int, computed_before: int = 0) -> list[BlockTransfer]:
        if not self.save_enabled or not state.block_ids:
            return []
        hashes = state.request.block_hashes
        full = min(computed_after // self.block_size, len(hashes), len(state.block_ids[0]))
        if full <= state.saved_upto:
            return []
        start, state.saved_upto = state.saved_upto, full
        if self.groups:
            saves = self._group_transfers(state.request.request_id, hashes, state.block_ids, [
                group_blocks.save_range(g, start, full, computed_before) for g in self.groups])
        else:
            saves = [BlockTransfer(
                request_id=state.request.request_id,
                block_hashes=[bytes(h) for h in hashes[start:full]],
                block_ids=[g[start:full] for g in state.block_ids],
            )]
        if saves:
            state.has_saves = True
            self._track_tokens(state.request, start, full)
        return saves

    def _track_tokens(self, request: Any, start: int, end: int) -> None:
        tokens = getattr(request, "all_token_ids", None)  # None: parents still tracked (event order)
        hashes = request.block_hashes
        bs = self.block_size
        for i in range(start, end):
            parent = bytes(hashes[i - 1]) if i > 0 else None
            block_tokens = list(tokens[i * bs : (i + 1) * bs]) if tokens is not None else []
            self._block_tokens[bytes(hashes[i])] = (parent, block_tokens)
        while len(self._block_tokens) > MAX_TRACKED_BLOCKS:
            del self._block_tokens[next(iter(self._block_tokens))]

    def _stored_events(self, events: Any, stored: Sequence[bytes]) -> list[Any]:
        """One BlockStored per run of chained blocks (each the parent of the next), with tokens."""
        out = []
        runs: list[tuple[bytes | None, list[bytes], list[int] | None]] = []
        for h in stored:
            parent, tokens = self._block_tokens.pop(bytes(h), (None, None))
            if runs and parent is not None and runs[-1][1][-1] == parent:
                run = runs[-1]
                run[1].append(h)
                if run[2] is not None and tokens is not None:
                    run[2].extend(tokens)
                else:
                    runs[-1] = (run[0], run[1], None)
            else:
                runs.append((parent, [h], list(tokens) if tokens is not None else None))
        for parent, hashes, tokens in runs:
            out.append(events.BlockStored(
                block_hashes=hashes, parent_block_hash=parent, token_ids=tokens or [],
                block_size=self.block_size, lora_id=None, medium=self.backend.kv_event_medium, lora_name=None,
            ))
        return out

    def build_plan(self, scheduler_output: Any) -> StorePlan:
        plan = StorePlan()
        plan.loads = [t for t in self._pending_loads if t.request_id in self._requests]
        self._pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(g) for g in new.block_ids]
            plan.saves.extend(self._plan_save(state, new.num_computed_tokens + scheduled.get(new.req_id, 0),
                                              new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                state.block_ids = [list(g) for g in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                if not state.block_ids:
                    state.block_ids = [[] for _ in new_ids]
                for group, ids in zip(state.block_ids, new_ids, strict=True):
                    group.extend(ids)
            plan.saves.extend(self._plan_save(state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0),
                                              cached.num_computed_tokens[i]))
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            state = self._requests.get(req_id)
            if state is not None:
                state.block_ids = []  # freed by vLLM; the resumed request brings new ones
            plan.preempted.append(req_id)
        return plan

    # ---- finish, frees, events ------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._lookups.pop(req_id, None)
        self._async_loaded.discard(req_id)
        state = self._requests.pop(req_id, None)
        if state is not None and state.has_saves:
            self._held.add(req_id)
            return True, None  # freed when the workers report the saves done (finished_sending)
        return False, None

    def has_pending_block_frees(self) -> bool:
        """Finished requests whose blocks wait for their saves: vLLM waits for these frees instead of
        preempting a running request when it runs out of blocks."""
        return bool(self._held)

    def on_finished_sending(self, request_ids: Iterable[str]) -> None:
        for req_id in request_ids:
            self._held.discard(req_id)

    def on_worker_report(self, report: StoreReport | None) -> None:
        if report is None:
            return
        if report.removed and self.save_enabled:
            self._rewind_saves(report.removed)
        events = _events_module()
        if events is None:
            return
        complete = self._record_stored(report)
        if complete:
            self._events.extend(self._stored_events(events, complete))
        if report.removed:
            self._events.append(events.BlockRemoved(block_hashes=list(report.removed), medium=self.backend.kv_event_medium))

    def _rewind_saves(self, removed: Sequence[bytes]) -> None:
        """A block missing or corrupt at load time is recomputed by vLLM: save it (and what follows)
        again from the recomputed KV instead of leaving the store without it."""
        gone = {bytes(h) for h in removed}
        for state in self._requests.values():
            hashes = state.request.block_hashes
            for i in range(min(state.saved_upto, len(hashes))):
                if bytes(hashes[i]) in gone:
                    state.saved_upto = i
                    break

    def _record_stored(self, report: StoreReport) -> list[bytes]:
        """Blocks every rank tag has now stored, parents first; a block whose parent is still
        waiting for a tag waits with it (no BlockStored before its parent's)."""
        all_tags = set(self.rank_tags)
        for h in report.stored:
            self._stored_tags.setdefault(bytes(h), set()).update(all_tags)
        for tag, hashes in report.stored_by_tag.items():
            for h in hashes:
                self._stored_tags.setdefault(bytes(h), set()).add(tag)
        while len(self._stored_tags) > MAX_TRACKED_BLOCKS:  # a rank that never reports: drop oldest
            dropped, _ = self._stored_tags.popitem(last=False)
            self._block_tokens.pop(dropped, None)
        complete: list[bytes] = []
        progress = True
        while progress:
            progress = False
            for h, tags in list(self._stored_tags.items()):
                if not all_tags <= tags:
                    continue
                parent = self._block_tokens.get(h, (None, None))[0]
                if parent is not None and parent in self._stored_tags:
                    continue  # parent not stored by every tag yet
                del self._stored_tags[h]
                complete.append(h)
                progress = True
        return complete

    def take_events(self) -> list[Any]:
        taken = list(self._events)
        self._events.clear()
        return taken

    def leak_report(self) -> dict[str, int]:
        return {
            "pending_saves": len(self._held),
            "pending_loads": len(self._pending_loads) + len(self._lookups),
            "held_requests": len(self._requests) + len(self._held),
        }

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _events_module() -> Any:
    try:
        from kv_common.vllm_compat import kv_events_module

        return kv_events_module()
    except ImportError:
        return None
