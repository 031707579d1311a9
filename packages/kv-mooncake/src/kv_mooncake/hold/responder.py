"""Prefill side of the pull protocol: the responder that answers a rank's readers.

A prefill rank keeps each finished request's blocks in its ``HoldLedger`` (``hold.ledger``) and
answers the decode's side-channel messages: the handshake (this rank's KV layout and TE address),
pull leases (``PullStarted`` / ``LeaseRenew``), ``PullDone``, ``FreeNow`` and ``HoldKeepAlive``.
Each message is one call on the ledger; here only the translation to replies, the log and the
counters. Blocks are freed once: after the last expected ``PullDone``, when the hold expires
without a current lease, or when the decode says nobody will read them.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from kv_common.logging_utils import get_logger
from kv_common.stats import TransferStatsBase

from kv_mooncake.config import MooncakeConfig
from kv_mooncake.hold.ledger import HeldBlocks, HoldLedger, NotHeld, ReadRefused
from kv_mooncake.identity import head_digests
from kv_mooncake.kv_regions import LocalCache, head_ranges
from kv_mooncake.pipeline_stages import waive_stage_fields
from kv_mooncake.rank_layout import PrefillLayout
from kv_mooncake.wire import messages as P

logger = get_logger(__name__)

_RECENT = 4096  # remembered freed / early-signalled requests (bounded)


class PrefillHolder:
    """One prefill rank's answers to its readers; what is held, for whom and until when, is the
    ``ledger``'s."""

    def __init__(self, config: MooncakeConfig, *, engine_id: str, prefill_layout: PrefillLayout,
                 stats: TransferStatsBase, pp_rank: int = 0, on_freed: Callable[[], None] = lambda: None):
        self.config = config
        self._on_freed = on_freed  # blocks freed: the worker's idle step stops waiting (idle_step)
        self.engine_id = engine_id
        self.prefill_layout = prefill_layout
        self.pp_rank = pp_rank  # this worker's pipeline stage
        self.stats = stats
        self.ledger = HoldLedger(self._on_free)
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
        self.ledger.hold(request_id, 1, ttl_s or self.config.hold_timeout_s, blocks)

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
        return self.ledger.take_freed()

    def counts(self) -> dict[str, int]:
        return self.ledger.counts()

    def _on_free(self, request_id: str, reason: str) -> None:
        self._on_freed()
        if reason == "expired":
            self.stats.incr("expired_holds")
        logger.debug("MooncakeConnectorV1: request %s freed (%s)", request_id, reason)

    @staticmethod
    def _not_held(request_id: str, not_held: NotHeld) -> P.Refused:
        if not_held.freed_reason is not None:
            return P.Refused(reason=f"request {request_id} already freed ({not_held.freed_reason})")
        return P.Refused(reason=f"request {request_id} not held (yet)", retry=True)

    # ---- the readers' messages ---------------------------------------------------------------
    def handle(self, message: msgspec.Struct) -> msgspec.Struct:
        if isinstance(message, P.Handshake):
            return self._handshake_reply(message)
        ledger = self.ledger
        if isinstance(message, P.PullStarted):
            start = ledger.start_read(message.request_id, message.reader_id, expected_readers=message.expected_readers,
                                      block_ids=message.block_ids, prompt_digest=message.prompt_digest,
                                      lease_s=self.config.lease_s)
            if isinstance(start, ReadRefused):
                logger.warning("MooncakeConnectorV1: refusing reader %s of request %s: %s", message.reader_id,
                               message.request_id, start.detail)
                self.stats.incr("rejected_reads")
                return P.Refused(reason=start.reason)
            if isinstance(start, NotHeld):
                return self._not_held(message.request_id, start)
            # Read after the lease began (its DONE vouches for the rest): a reader that read first
            # counts its read only if these blocks were held since before it began.
            digests = start.blocks.digests
            if digests is not None:  # verify_kv: the reader checks against these
                return P.Ack(digests=[d for b in message.block_ids for d in digests.get(b, ())],
                             boot_id=self.boot_id, held_for_s=start.held_for_s)
            return P.Ack(boot_id=self.boot_id, held_for_s=start.held_for_s)
        if isinstance(message, P.LeaseRenew):
            not_held = ledger.renew_read(message.request_id, message.reader_id, self.config.lease_s)
            return P.Ack() if not_held is None else self._not_held(message.request_id, not_held)
        if isinstance(message, P.PullDone):
            confirmed = ledger.finish_read(message.request_id, message.reader_id, message.expected_readers)
            if message.ok and not confirmed:
                logger.warning("MooncakeConnectorV1: reader %s of request %s read without a current lease "
                               "(lapsed, or never taken): its read is void", message.reader_id, message.request_id)
            return P.PullDoneReply(held_throughout=confirmed)
        if isinstance(message, P.FreeNow):
            ledger.free_now(message.request_id)
            return P.Ack()
        if isinstance(message, P.HoldKeepAlive):
            not_held = ledger.keep_hold(message.request_id, self.config.lease_s, self.config.keepalive_max_s)
            return P.Ack() if not_held is None else self._not_held(message.request_id, not_held)
        return P.Refused(reason=f"unexpected message {type(message).__name__}")

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
