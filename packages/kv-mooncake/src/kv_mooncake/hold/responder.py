"""Prefill side of the pull protocol: hold finished requests' blocks until their readers are done.

A prefill rank keeps each finished request's blocks in a ``DelayedFreeTracker`` and answers the
decode's side-channel messages: the handshake (this rank's KV layout and TE address), pull leases
(``PullStarted`` / ``LeaseRenew``), ``PullDone``, ``FreeNow`` and ``HoldKeepAlive``. Blocks are
freed once: after the last expected ``PullDone``, when the hold expires without a current lease,
or when the decode says nobody will read them. Messages may overtake the hold they are about (the
scheduler hands the hold over one step after the decode may have heard of it): such a DONE or
FreeNow is remembered and applied when the hold arrives.
"""

from __future__ import annotations

import functools
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from kv_common.logging_utils import get_logger
from kv_common.stats import TransferStatsBase

from kv_mooncake.config import MooncakeConfig
from kv_mooncake.hold.ledger import DelayedFreeTracker, HeldBlocks
from kv_mooncake.identity import head_digests
from kv_mooncake.kv_regions import LocalCache, head_ranges
from kv_mooncake.pipeline_stages import waive_stage_fields
from kv_mooncake.rank_layout import PrefillLayout
from kv_mooncake.wire import messages as P

logger = get_logger(__name__)

_RECENT = 4096  # remembered freed / early-signalled requests (bounded)


@dataclass
class _Overtaken:
    """The DONEs / FreeNow that came before their request's hold, applied when the hold comes."""

    readers_done: set[str] = field(default_factory=set)
    expected_readers: int = 1  # as those DONEs announced it
    free_now: bool = False


class PrefillHolder:
    """One prefill rank's held requests and its answers to the readers. What is kept about a held
    request is its one record in ``tracker``; here only what comes before a hold or outlives it."""

    def __init__(self, config: MooncakeConfig, *, engine_id: str, prefill_layout: PrefillLayout,
                 stats: TransferStatsBase, pp_rank: int = 0, on_freed: Callable[[], None] = lambda: None):
        self.config = config
        self._on_freed = on_freed  # blocks freed: the worker's idle step stops waiting (idle_step)
        self.engine_id = engine_id
        self.prefill_layout = prefill_layout
        self.pp_rank = pp_rank  # this worker's pipeline stage
        self.stats = stats
        self._lock = threading.Lock()
        self._freed: set[str] = set()  # freed since the last ``take_freed`` (vLLM's finished_sending)
        self._recently_freed: OrderedDict[str, str] = OrderedDict()  # request -> why it was freed
        self._overtaken: OrderedDict[str, _Overtaken] = OrderedDict()
        # request -> readers whose DONE found their lease intact: a repeated DONE (its first answer
        # came too late) gets the same answer, also after that DONE freed the blocks.
        self._confirmed: OrderedDict[str, set[str]] = OrderedDict()
        self.tracker = DelayedFreeTracker(self._on_free)
        # Set when the KV cache is registered: until then a handshake is refused (retry).
        self.cache: LocalCache | None = None
        self.compatibility: P.Compatibility | None = None
        self.te: Any = None
        # This worker's boot: a decode's cached handshake of another boot is stale (see protocol).
        self.boot_id = secrets.token_hex(8)

    def attach(self, cache: LocalCache, compatibility: P.Compatibility, te: Any) -> None:
        self.cache, self.compatibility, self.te = cache, compatibility, te

    # ---- holds -------------------------------------------------------------------------------
    def hold(self, request_id: str, num_blocks: int, block_ids: list[int] | None = None,
             ttl_s: float | None = None, prompt_digest: str | None = None) -> None:
        blocks = HeldBlocks(num_blocks, frozenset(block_ids or ()), self._digests(block_ids or ()), prompt_digest)
        with self._lock:  # atomic with the overtaken check: a message now finds the hold or is kept for it
            overtaken = self._overtaken.pop(request_id, None) or _Overtaken()
            self._confirmed.pop(request_id, None)  # a new hold: no read of it is confirmed yet
            self.tracker.hold(request_id, max(1, overtaken.expected_readers),
                              ttl_s or self.config.hold_timeout_s, blocks)
            if overtaken.readers_done:  # their count of readers is the one announced
                self.tracker.expect_readers(request_id, overtaken.expected_readers)
        for reader in overtaken.readers_done:
            self.tracker.done(request_id, reader)
        if overtaken.free_now:
            self.tracker.abort(request_id)

    def _digests(self, block_ids: Iterable[int]) -> dict[int, list[int]] | None:
        """verify_kv: the blocks' per-head digests (the request finished: its KV is final)."""
        if not self.config.verify_kv or self.cache is None:
            return None
        cache = self.cache
        return {b: head_digests(functools.partial(head_ranges, cache), range(len(cache.layer_names)), b,
                                range(cache.heads_on_rank))
                for b in block_ids}

    def take_freed(self) -> set[str]:
        """Requests freed since the last call (expired holds included)."""
        self.tracker.expire()
        with self._lock:
            freed, self._freed = self._freed, set()
        return freed

    def counts(self) -> dict[str, int]:
        return self.tracker.counts()

    def _on_free(self, request_id: str, reason: str) -> None:
        with self._lock:
            self._freed.add(request_id)
            self._recently_freed[request_id] = reason
            while len(self._recently_freed) > _RECENT:
                self._recently_freed.popitem(last=False)
        self._on_freed()
        if reason == "expired":
            self.stats.incr("expired_holds")
        logger.debug("MooncakeConnectorV1: request %s freed (%s)", request_id, reason)

    def _overtaken_by(self, request_id: str) -> _Overtaken:
        """Under ``_lock``: what overtook the hold of ``request_id`` so far (bounded)."""
        overtaken = self._overtaken.get(request_id)
        if overtaken is None:
            overtaken = self._overtaken[request_id] = _Overtaken()
            while len(self._overtaken) > _RECENT:
                self._overtaken.popitem(last=False)
        return overtaken

    def _not_held(self, request_id: str) -> P.Refused:
        with self._lock:
            reason = self._recently_freed.get(request_id)
        if reason is not None:
            return P.Refused(reason=f"request {request_id} already freed ({reason})")
        return P.Refused(reason=f"request {request_id} not held (yet)", retry=True)

    # ---- the readers' messages ---------------------------------------------------------------
    def handle(self, message: msgspec.Struct) -> msgspec.Struct:
        if isinstance(message, P.Handshake):
            return self._handshake_reply(message)
        if isinstance(message, P.PullStarted):
            refused = self._check_block_ids(message) or self._check_prompt(message)
            if refused is not None:
                return refused
            self.tracker.expect_readers(message.request_id, message.expected_readers)
            if self.tracker.begin_read(message.request_id, message.reader_id, self.config.lease_s):
                blocks = self.tracker.blocks(message.request_id)
                # Read after the lease began (its DONE vouches for the rest): a reader that read first
                # counts its read only if these blocks were held since before it began.
                held_for = self.tracker.held_for(message.request_id)
                held_for_s = -1.0 if held_for is None else held_for
                if blocks is not None and blocks.digests is not None:  # verify_kv: the reader checks against these
                    return P.Ack(digests=[d for b in message.block_ids for d in blocks.digests.get(b, ())],
                                 boot_id=self.boot_id, held_for_s=held_for_s)
                return P.Ack(boot_id=self.boot_id, held_for_s=held_for_s)
            return self._not_held(message.request_id)
        if isinstance(message, P.LeaseRenew):
            if self.tracker.renew(message.request_id, self.config.lease_s, message.reader_id):
                return P.Ack()
            return self._not_held(message.request_id)
        if isinstance(message, P.PullDone):
            self.tracker.expect_readers(message.request_id, message.expected_readers)
            with self._lock:
                held = message.request_id in self.tracker
                if not held and message.request_id not in self._recently_freed:
                    overtaken = self._overtaken_by(message.request_id)
                    overtaken.readers_done.add(message.reader_id)
                    overtaken.expected_readers = max(overtaken.expected_readers, message.expected_readers)
            end = self.tracker.end_read(message.request_id, message.reader_id) if held else None
            return P.PullDoneReply(held_throughout=self._confirm(message, end is not None and end.held_throughout))
        if isinstance(message, P.FreeNow):
            with self._lock:
                held = message.request_id in self.tracker
                if not held and message.request_id not in self._recently_freed:
                    self._overtaken_by(message.request_id).free_now = True
            if held:
                self.tracker.abort(message.request_id)
            return P.Ack()
        if isinstance(message, P.HoldKeepAlive):
            if self.tracker.keep_alive(message.request_id, self.config.lease_s, self.config.keepalive_max_s):
                return P.Ack()
            return self._not_held(message.request_id)
        return P.Refused(reason=f"unexpected message {type(message).__name__}")

    def _check_block_ids(self, message: P.PullStarted) -> P.Refused | None:
        """A reader may only read blocks this rank holds for that very request."""
        blocks = self.tracker.blocks(message.request_id)
        if blocks is None:
            return None  # not held (yet / any more): begin_read answers
        wanted = set(message.block_ids)
        bad = sorted(wanted - blocks.block_ids) if wanted else None
        if bad is None or bad:
            what = "no block ids" if bad is None else f"block ids {bad[:8]}{'...' if len(bad) > 8 else ''}"
            logger.warning("MooncakeConnectorV1: refusing reader %s of request %s: %s not held for it",
                           message.reader_id, message.request_id, what)
            self.stats.incr("rejected_reads")
            return P.Refused(reason=f"request {message.request_id}: {what} not held for this request")
        return None

    def _confirm(self, message: P.PullDone, held_throughout: bool) -> bool:
        """Whether ``message``'s reader read under a lease that held to its DONE (this one, or the
        same DONE sent before)."""
        with self._lock:
            readers = self._confirmed.get(message.request_id)
            if held_throughout:
                if readers is None:
                    readers = self._confirmed[message.request_id] = set()
                    while len(self._confirmed) > _RECENT:
                        self._confirmed.popitem(last=False)
                readers.add(message.reader_id)
            confirmed = readers is not None and message.reader_id in readers
        if message.ok and not confirmed:
            logger.warning("MooncakeConnectorV1: reader %s of request %s read without a current lease "
                           "(lapsed, or never taken): its read is void", message.reader_id, message.request_id)
        return confirmed

    def _check_prompt(self, message: P.PullStarted) -> P.Refused | None:
        """A reader reads only the prompt the blocks were computed for (kv_transfer_params can be
        forged to pass the decode's own check). The held digest is not echoed: it would let a
        stranger confirm a guess of another user's prompt."""
        blocks = self.tracker.blocks(message.request_id)
        if blocks is None or blocks.prompt_digest is None:
            return None  # not held (begin_read answers), or a hold nobody computed a digest for
        if message.prompt_digest and message.prompt_digest == blocks.prompt_digest:
            return None
        logger.warning("MooncakeConnectorV1: refusing reader %s of request %s: prompt digest %r, the "
                       "request's %r", message.reader_id, message.request_id, message.prompt_digest,
                       blocks.prompt_digest)
        self.stats.incr("rejected_reads")
        return P.Refused(reason=f"request {message.request_id}: the reader's prompt_digest "
                                f"{message.prompt_digest or 'missing'!r} is not the held prompt's")

    def _handshake_reply(self, message: P.Handshake) -> msgspec.Struct:
        if self.cache is None or self.compatibility is None:
            return P.Refused(reason="KV cache not registered yet", retry=True)
        if message.engine_id != self.engine_id:
            return P.Refused(reason=f"engine id {message.engine_id!r} vs {self.engine_id!r} (prefill restarted?)")
        diff = waive_stage_fields(message.compatibility, self.compatibility).differences(self.compatibility)
        if diff:
            logger.warning("MooncakeConnectorV1: refusing reader %s: incompatible KV caches: %s",
                           message.reader_id, "; ".join(diff))
            return P.Refused(reason="incompatible KV caches: " + "; ".join(diff))
        cache, layout = self.cache, self.prefill_layout
        return P.HandshakeReply(
            engine_id=self.engine_id,
            te_address=self.te.rpc_address,
            layer_names=cache.layer_names,
            base_addresses=cache.base_addresses,
            block_bytes=cache.block_bytes,
            num_blocks=cache.num_blocks,
            heads_on_rank=cache.heads_on_rank,
            compatibility=self.compatibility,
            tp_size=layout.tp_size, pcp_size=layout.pcp_size, dcp_size=layout.dcp_size,
            pp_size=layout.pp_size, pp_rank=self.pp_rank,
            kernel_blocks_per_block=cache.kernel_blocks_per_block,
            parts=[[P.PartInfo(base=p.base, shape=list(p.shape), strides=list(p.strides),
                               element_size=p.element_size, roles=list(p.roles))
                    for p in cache.layer_parts(li)] for li in range(len(cache.layer_names))],
            boot_id=self.boot_id,
        )
