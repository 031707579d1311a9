"""Worker-side logic of MooncakeConnectorV1 (one per worker process, owns the KV tensors).

Prefill rank: registers its KV cache with the TransferEngine, answers the side channel (handshake,
pull leases, DONE, FreeNow) and keeps finished requests' blocks in a ``DelayedFreeTracker`` until
every expected reader is done, the hold expires, or the decode says nobody will read them.

Decode rank: plans each request's pulls (``pull_plan``) and reads from every prefill rank in
parallel, each rank on its own queue behind a circuit breaker (``peer_health``), with a deadline;
the blocks not read become load errors so vLLM's ``kv_load_failure_policy`` decides, and the
request is reported finished either way. Accepted requests keep their prefill hold alive
(``HoldKeepAlive``) until their pull takes a lease.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
from kv_common.failure_ledger import FailureLedger
from kv_common.logging_utils import get_logger
from kv_common.stats import TransferStatsBase

from kv_mooncake import protocol as P
from kv_mooncake import side_channel
from kv_mooncake.config import MooncakeConfig
from kv_mooncake.delayed_free import DelayedFreeTracker
from kv_mooncake.kv_digest import head_digests
from kv_mooncake.kv_regions import KVPart, LayoutError, head_span_runs, infer_roles, layout_name, pair_runs
from kv_mooncake.metadata import MooncakeStep, PullRequest, RemoteSource
from kv_mooncake.peer_health import PeerBreaker, PeerQueues
from kv_mooncake.pull_plan import (
    DecodeLayout,
    DecodeRank,
    PrefillLayout,
    PrefillRank,
    RankPull,
    plan_pulls,
    readers_per_prefill_rank,
    request_seed,
)

logger = get_logger(__name__)

_RECENT = 4096  # remembered freed / early-signalled requests (bounded)


class PullFailed(RuntimeError):
    pass


class PeerDown(PullFailed):
    """The prefill rank is presumed down: failed without waiting for it."""


PULL_BATCH_BLOCKS = 16  # blocks per TE read batch: the granularity of a partial pull's report


@dataclass(eq=False)
class _PullJob:
    """One request's pull on this decode rank, over all the prefill ranks it reads from."""

    req: PullRequest
    prefill: PrefillLayout
    start: float
    deadline: float = 0.0
    counts: dict[PrefillRank, int] = field(default_factory=dict)
    pulls: list[RankPull] = field(default_factory=list)
    remaining: int = 0
    nbytes: int = 0
    errors: list[Exception] = field(default_factory=list)
    failed_ranks: set[PrefillRank] = field(default_factory=set)
    unread: set[int] = field(default_factory=set)  # local block positions not read
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class LocalCache:
    """This rank's registered KV cache, as the pull arithmetic needs it.

    ``parts``: per layer, its KV tensors (``kv_regions``); without it (raw regions, tests and
    benchmarks) each layer is one region of ``num_blocks`` blocks of ``block_bytes``, heads
    contiguous inside a block. ``num_blocks`` counts the tensor's (kernel) blocks; a logical block
    id ``b`` is kernel blocks ``b*kernel_blocks_per_block ...`` (vLLM may split a block for its
    attention kernel).
    """

    layer_names: list[str]
    base_addresses: list[int]
    block_bytes: list[int]
    num_blocks: int
    heads_on_rank: int
    parts: list[list[KVPart]] | None = None
    kernel_blocks_per_block: int = 1
    layout: str = "raw:[blocks,heads,bytes]"

    def layer_parts(self, li: int) -> list[KVPart]:
        if self.parts is not None:
            return self.parts[li]
        per_head = self.block_bytes[li] // self.heads_on_rank
        return [KVPart(base=self.base_addresses[li], shape=(self.num_blocks, self.heads_on_rank, per_head),
                       strides=(self.block_bytes[li], per_head, 1), element_size=1,
                       roles=("block", "head", "dim"))]

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) to register with the TransferEngine."""
        return [(part.base, part.span_bytes()) for li in range(len(self.layer_names))
                for part in self.layer_parts(li)]


def _parts_of(name: str, value: Any, heads: int, head_size: int, use_mla: bool) -> list[KVPart]:
    tensors = list(value) if isinstance(value, (list, tuple)) else [value]
    parts = []
    for t in tensors:
        roles = infer_roles(tuple(int(x) for x in t.shape), heads, head_size, use_mla)
        parts.append(KVPart(base=int(t.data_ptr()), shape=tuple(int(x) for x in t.shape),
                            strides=tuple(int(x) for x in t.stride()), element_size=int(t.element_size()),
                            roles=roles))
    return parts


def describe_kv_caches(
    kv_caches: dict[str, Any],
    *,
    heads_on_rank: int | None = None,
    head_size: int | None = None,
    use_mla: bool = False,
    block_size: int | None = None,
) -> tuple[LocalCache, dict[str, int]]:
    """Describe each layer's KV tensor(s) in any layout ``kv_regions.infer_roles`` knows (the CPU
    ``[num_blocks, heads, block_size, 2*head_size]``, CUDA, FlashInfer, separate K and V, MLA).

    ``block_size`` is the logical (scheduler) block size per rank; the tensor's block may be
    smaller (vLLM's kernel block), never larger. Without ``heads_on_rank`` / ``head_size`` only the
    CPU layout is read (heads and head size from its shape)."""
    names = list(kv_caches)
    if not names:
        raise ValueError("MooncakeConnectorV1: no KV cache tensors to register")
    first = kv_caches[names[0]]
    first = first[0] if isinstance(first, (list, tuple)) else first
    if heads_on_rank is None or head_size is None:
        if first.dim() != 4 or use_mla:
            raise ValueError(
                f"MooncakeConnectorV1: unsupported KV cache shape {tuple(first.shape)} for layer {names[0]} "
                "(expected [num_blocks, kv_heads, block_size, 2*head_size])"
            )
        heads_on_rank, head_size = int(first.shape[1]), int(first.shape[3]) // 2
    try:
        parts = [_parts_of(n, kv_caches[n], heads_on_rank, head_size, use_mla) for n in names]
    except LayoutError as exc:
        raise ValueError(f"MooncakeConnectorV1: {exc}") from exc
    ref = parts[0]
    for name, layer in zip(names, parts):
        if [(p.shape, p.strides, p.roles, p.element_size) for p in layer] != \
                [(p.shape, p.strides, p.roles, p.element_size) for p in ref]:
            raise ValueError(f"MooncakeConnectorV1: layer {name} differs in KV layout from layer {names[0]}")
        if any(p.num_blocks != ref[0].num_blocks for p in layer):
            raise ValueError(f"MooncakeConnectorV1: layer {name}: its K and V tensors differ in blocks")
    kernel_block = ref[0].size("token")
    logical = block_size or kernel_block
    if logical % kernel_block or ref[0].num_blocks % (logical // kernel_block):
        raise ValueError(
            f"MooncakeConnectorV1: KV tensor blocks of {kernel_block} tokens ({ref[0].num_blocks} of them) do "
            f"not tile logical blocks of block_size={logical}"
        )
    cache = LocalCache(
        layer_names=names,
        base_addresses=[layer[0].base for layer in parts],
        block_bytes=[layer[0].block_stride_bytes for layer in parts],
        num_blocks=ref[0].num_blocks,
        heads_on_rank=1 if use_mla else heads_on_rank,
        parts=parts,
        kernel_blocks_per_block=logical // kernel_block,
        layout=layout_name(ref),
    )
    return cache, {"block_size": logical, "kernel_block_size": kernel_block, "head_size": head_size,
                   "num_layers": len(names)}


def check_kv_cache_groups(kv_cache_config: Any) -> None:
    """Refuse hybrid KV caches (several groups, e.g. sliding-window plus full-attention layers).

    Each group has its own block table; the pull addresses every layer through one list of block
    ids, so a second group would be read from the wrong blocks: wrong tokens, silently.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise ValueError(
            f"MooncakeConnectorV1 supports one KV-cache group; this model has {len(groups)} "
            "(hybrid attention, e.g. sliding-window layers). Use a store connector (AscendStoreConnector) "
            "for it, or run it without disaggregated prefill."
        )


class MooncakeWorker:
    def __init__(
        self,
        config: MooncakeConfig,
        *,
        engine_id: str,
        is_producer: bool,
        is_consumer: bool,
        side_channel_port: int,
        prefill_rank: PrefillRank = PrefillRank(0, 0),
        decode_rank: DecodeRank = DecodeRank(0),
        decode_layout: DecodeLayout = DecodeLayout(1),
        prefill_layout: PrefillLayout | None = None,
        total_kv_heads: int = 1,
        use_mla: bool = False,
        compatibility_base: dict[str, Any] | None = None,
        engine_factory: Callable[..., Any] | None = None,
    ):
        self.config = config
        self.engine_id = engine_id
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.side_channel_port = side_channel_port  # this instance's base (DP rank included)
        self.prefill_rank, self.decode_rank = prefill_rank, decode_rank
        self.decode_layout = decode_layout
        self.prefill_layout = prefill_layout or PrefillLayout(tp_size=1, total_kv_heads=total_kv_heads, use_mla=use_mla)
        self.total_kv_heads, self.use_mla = total_kv_heads, use_mla
        self._compat_base = dict(compatibility_base or {})
        self._engine_factory = engine_factory
        self.reader_id = f"{engine_id}:{decode_rank.tp_rank}"

        self.stats = TransferStatsBase()
        self.ledger = FailureLedger()
        self._lock = threading.Lock()
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._held_blocks: dict[str, int] = {}
        self._held_block_ids: dict[str, frozenset[int]] = {}  # what a reader may read, per request
        self._active_reads: set[tuple[str, str]] = set()  # (request, reader) between PullStarted and PullDone
        self._expected_known: set[str] = set()
        self._recently_freed: OrderedDict[str, str] = OrderedDict()
        # DONEs that overtook their hold: readers seen and the reader count they announced.
        self._early_done: dict[str, tuple[set[str], int]] = {}
        self._early_free: OrderedDict[str, None] = OrderedDict()
        self._pending_pulls: set[str] = set()
        self._digests: dict[str, dict[int, list[int]]] = {}  # verify_kv: request -> block -> per head
        self._handshakes: dict[tuple[str, str], P.HandshakeReply] = {}
        self._run_cache: dict[tuple, list[tuple[int, int, int]]] = {}  # paired byte runs per layout pair
        self.tracker = DelayedFreeTracker(self._on_free)

        self.cache: LocalCache | None = None
        self.compatibility: P.Compatibility | None = None
        self.te: Any = None
        self.server: side_channel.SideChannelServer | None = None
        self._queues: PeerQueues | None = None  # decode: one pull queue per prefill rank
        self._notifier: ThreadPoolExecutor | None = None  # DONE / FreeNow delivery, off the pull threads
        # Hold heartbeats on their own thread: one to a frozen prefill must not delay a DONE.
        self._heartbeats: ThreadPoolExecutor | None = None
        self._heartbeats_queued: set[str] = set()
        self._breaker = PeerBreaker()  # decode: prefill ranks presumed down fail fast
        # Kept-open connections to the prefill ranks: a new one per message cost ~5 ms per pull.
        self._client = side_channel.SideChannelClient(P.REPLY_TYPES, config.max_message_bytes)
        self._closed = False

    # ---- setup -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        layout = self._compat_base
        cache, shape = describe_kv_caches(
            kv_caches, heads_on_rank=layout.get("heads_on_rank"), head_size=layout.get("head_size"),
            use_mla=self.use_mla, block_size=layout.get("block_size"),
        )
        first = next(iter(kv_caches.values()))
        first = first[0] if isinstance(first, (list, tuple)) else first
        self.register_cache(cache, shape, dtype=str(first.dtype).removeprefix("torch."))

    def register_cache(self, cache: LocalCache, shape: dict[str, int], dtype: str) -> None:
        """Register raw regions (tests and benchmarks use this without torch)."""
        self.cache = cache
        base = self._compat_base
        self.compatibility = P.Compatibility(
            model=str(base.get("model", "")),
            dtype=dtype,
            block_size=shape["block_size"],
            head_size=shape["head_size"],
            num_layers=shape["num_layers"],
            total_kv_heads=1 if self.use_mla else self.total_kv_heads,
            use_mla=self.use_mla,
            layout=cache.layout,
            revision=str(base.get("revision", "")),
            quantization=str(base.get("quantization", "")),
            model_dtype=str(base.get("model_dtype", "")),
            cache_dtype=str(base.get("cache_dtype", "")),
            kernel_block_size=int(shape.get("kernel_block_size", shape["block_size"])),
            pipeline_parallel_size=int(base.get("pipeline_parallel_size", 1)),
            cp_kv_cache_interleave_size=int(base.get("cp_kv_cache_interleave_size", 0)),
        )
        if self._engine_factory is not None:
            self.te = self._engine_factory()
        else:
            from kv_mooncake.transfer_engine import MooncakeTransferEngine

            self.te = MooncakeTransferEngine(
                self.config.te_host or self.config.side_channel_host,
                self.config.protocol,
                self.config.device_name,
                self.config.max_inflight_transfers,
                self.config.transfer_attempt_timeout_s,
            )
        self.te.register(cache.regions())
        if self.is_producer or self.config.decode_side_channel:
            if self.is_producer:
                port = self.side_channel_port + self.prefill_rank.index(self.prefill_layout)
            else:
                port = self.side_channel_port + self.decode_rank.index(self.decode_layout)
            self.server = side_channel.SideChannelServer(
                self.config.side_channel_host, port, self.handle, P.REQUEST_TYPES,
                self.config.max_message_bytes, name=f"mooncake-side-channel:{port}",
            ).start()
            logger.info("MooncakeConnectorV1 %s rank: side channel %s, TE %s",
                        "prefill" if self.is_producer else "decode", self.server.address, self.te.rpc_address)
        if self.is_consumer:
            self._queues = PeerQueues(self.config.num_pull_threads, name="mooncake-pull")
            self._notifier = ThreadPoolExecutor(2, thread_name_prefix="mooncake-done")
            self._heartbeats = ThreadPoolExecutor(1, thread_name_prefix="mooncake-heartbeat")

    # ---- per step ----------------------------------------------------------------------------
    def start_step(self, step: MooncakeStep) -> None:
        for hold in step.holds:
            self._hold(hold.request_id, hold.num_blocks, hold.block_ids, hold.ttl_s)
        for source in step.keepalives:
            if self._heartbeats is not None and self.decode_rank == DecodeRank(0):
                with self._lock:  # one queued heartbeat per request: a silent peer cannot pile them up
                    queued = source.request_id in self._heartbeats_queued
                    self._heartbeats_queued.add(source.request_id)
                if not queued:
                    self._heartbeats.submit(self._keep_alive, source)
        for source in step.frees:
            if self._notifier is not None:
                self._notifier.submit(self._tell_free, source)
            else:  # kv_producer only: still answer the protocol, inline
                self._tell_free(source)
        for pull in step.pulls:
            with self._lock:
                self._pending_pulls.add(pull.request_id)
            self._pull(pull)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        self.tracker.expire()
        with self._lock:
            sending, self._finished_sending = self._finished_sending, set()
            recving, self._finished_recving = self._finished_recving, set()
        return sending or None, recving or None

    def leak_report(self) -> dict[str, int]:
        with self._lock:
            return {
                "held_blocks": sum(self._held_blocks.values()),
                "held_requests": len(self._held_blocks),
                "pending_pulls": len(self._pending_pulls),
                "active_reads": len(self._active_reads),
            }

    # ---- prefill: holds and the side channel --------------------------------------------------
    def _hold(self, request_id: str, num_blocks: int, block_ids: list[int] | None = None,
              ttl_s: float | None = None) -> None:
        digests = None
        if self.config.verify_kv and self.cache is not None:  # the request finished: its KV is final
            cache = self.cache
            digests = {b: head_digests(self._head_ranges, range(len(cache.layer_names)), b, range(cache.heads_on_rank))
                       for b in block_ids or ()}
        with self._lock:
            if digests is not None:
                self._digests[request_id] = digests
            self._held_blocks[request_id] = num_blocks
            self._held_block_ids[request_id] = frozenset(block_ids or ())
            early_free = self._early_free.pop(request_id, 0) is None
            early_done, expected = self._early_done.pop(request_id, (set(), 1))
            if early_done:
                self._expected_known.add(request_id)
        self.tracker.hold(request_id, max(1, expected), ttl_s or self.config.hold_timeout_s)
        for reader in early_done:
            self.tracker.done(request_id, reader)
        if early_free:
            self.tracker.abort(request_id)

    def _on_free(self, request_id: str, reason: str) -> None:
        with self._lock:
            self._held_blocks.pop(request_id, None)
            self._held_block_ids.pop(request_id, None)
            self._digests.pop(request_id, None)
            self._active_reads = {r for r in self._active_reads if r[0] != request_id}
            self._expected_known.discard(request_id)
            self._finished_sending.add(request_id)
            self._recently_freed[request_id] = reason
            while len(self._recently_freed) > _RECENT:
                self._recently_freed.popitem(last=False)
        if reason == "expired":
            self.stats.incr("expired_holds")
        logger.debug("MooncakeConnectorV1: request %s freed (%s)", request_id, reason)

    def _learn_expected(self, request_id: str, expected: int) -> None:
        """The first reader tells how many readers to wait for (the prefill cannot know it earlier)."""
        with self._lock:
            if request_id in self._expected_known or request_id not in self._held_blocks:
                return
            self._expected_known.add(request_id)
        if expected > 1:
            self.tracker.expect(request_id, expected)  # the hold's deadline stays as it was

    def _not_held(self, request_id: str) -> P.Refused:
        with self._lock:
            reason = self._recently_freed.get(request_id)
        if reason is not None:
            return P.Refused(reason=f"request {request_id} already freed ({reason})")
        return P.Refused(reason=f"request {request_id} not held (yet)", retry=True)

    def handle(self, message: msgspec.Struct) -> msgspec.Struct:
        if isinstance(message, P.Handshake):
            return self._handshake_reply(message)
        if isinstance(message, P.PullStarted):
            refused = self._check_block_ids(message)
            if refused is not None:
                return refused
            self._learn_expected(message.request_id, message.expected_readers)
            if self.tracker.begin_read(message.request_id, message.reader_id, self.config.lease_s):
                with self._lock:
                    if message.request_id in self._held_blocks:
                        self._active_reads.add((message.request_id, message.reader_id))
                    digests = self._digests.get(message.request_id)
                if digests is not None:  # verify_kv: the reader checks what it read against these
                    return P.Ack(digests=[d for b in message.block_ids for d in digests.get(b, ())])
                return P.Ack()
            return self._not_held(message.request_id)
        if isinstance(message, P.LeaseRenew):
            if self.tracker.renew(message.request_id, self.config.lease_s, message.reader_id):
                return P.Ack()
            return self._not_held(message.request_id)
        if isinstance(message, P.PullDone):
            self._learn_expected(message.request_id, message.expected_readers)
            with self._lock:
                self._active_reads.discard((message.request_id, message.reader_id))
                held = message.request_id in self._held_blocks
                if not held and message.request_id not in self._recently_freed:
                    readers, expected = self._early_done.get(message.request_id, (set(), 1))
                    readers.add(message.reader_id)
                    self._early_done[message.request_id] = (readers, max(expected, message.expected_readers))
                    while len(self._early_done) > _RECENT:
                        self._early_done.pop(next(iter(self._early_done)))
            if held:
                self.tracker.done(message.request_id, message.reader_id)
            return P.Ack()
        if isinstance(message, P.FreeNow):
            with self._lock:
                held = message.request_id in self._held_blocks
                if not held and message.request_id not in self._recently_freed:
                    self._early_free[message.request_id] = None
                    while len(self._early_free) > _RECENT:
                        self._early_free.popitem(last=False)
            if held:
                self.tracker.abort(message.request_id)
            return P.Ack()
        if isinstance(message, P.HoldKeepAlive):
            if self.tracker.keep_alive(message.request_id, self.config.lease_s, self.config.keepalive_max_s):
                return P.Ack()
            return self._not_held(message.request_id)
        if isinstance(message, P.LeakQuery):
            r = self.leak_report()
            return P.LeakReport(held_blocks=r["held_blocks"], held_requests=r["held_requests"],
                                pending_pulls=r["pending_pulls"], active_reads=r["active_reads"])
        return P.Refused(reason=f"unexpected message {type(message).__name__}")

    def _check_block_ids(self, message: P.PullStarted) -> P.Refused | None:
        """A reader may only read blocks this rank holds for that very request."""
        with self._lock:
            allowed = self._held_block_ids.get(message.request_id)
        if allowed is None:
            return None  # not held (yet / any more): begin_read answers
        wanted = set(message.block_ids)
        bad = sorted(wanted - allowed) if wanted else None
        if bad is None or bad:
            what = "no block ids" if bad is None else f"block ids {bad[:8]}{'...' if len(bad) > 8 else ''}"
            logger.warning("MooncakeConnectorV1: refusing reader %s of request %s: %s not held for it",
                           message.reader_id, message.request_id, what)
            self.stats.incr("rejected_reads")
            return P.Refused(reason=f"request {message.request_id}: {what} not held for this request")
        return None

    def _handshake_reply(self, message: P.Handshake) -> msgspec.Struct:
        if self.cache is None or self.compatibility is None:
            return P.Refused(reason="KV cache not registered yet", retry=True)
        if message.engine_id != self.engine_id:
            return P.Refused(reason=f"engine id {message.engine_id!r} vs {self.engine_id!r} (prefill restarted?)")
        diff = message.compatibility.differences(self.compatibility)
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
            kernel_blocks_per_block=cache.kernel_blocks_per_block,
            parts=[[P.PartInfo(base=p.base, shape=list(p.shape), strides=list(p.strides),
                               element_size=p.element_size, roles=list(p.roles))
                    for p in cache.layer_parts(li)] for li in range(len(cache.layer_names))],
        )

    # ---- decode: pulls -----------------------------------------------------------------------
    def _request(self, address: str, message: msgspec.Struct, timeout_s: float) -> msgspec.Struct:
        return self._client.request(address, message, max(0.05, timeout_s))

    def _peer_address(self, source: RemoteSource, rank: PrefillRank, layout: PrefillLayout) -> str:
        return f"{source.host}:{source.port + rank.index(layout)}"

    def _handshake(self, address: str, engine_id: str, deadline: float) -> P.HandshakeReply:
        key = (address, engine_id)
        cached = self._handshakes.get(key)
        if cached is not None:
            return cached
        assert self.compatibility is not None
        msg = P.Handshake(engine_id=engine_id, compatibility=self.compatibility, reader_id=self.reader_id)
        reply = self._until(deadline, address,
                            lambda left: self._request(address, msg, min(left, self.config.handshake_timeout_s)))
        if not isinstance(reply, P.HandshakeReply):
            raise PullFailed(f"handshake with {address} failed: {getattr(reply, 'reason', reply)}")
        if reply.heads_on_rank < 1 or len(reply.layer_names) != len(reply.base_addresses) or \
                len(reply.block_bytes) != len(reply.layer_names):
            raise PullFailed(f"malformed handshake reply from {address}")
        # Both sides compare: a prefill that skipped the check must not be read either.
        diff = self.compatibility.differences(reply.compatibility)
        if diff:
            raise PullFailed(f"handshake with {address}: incompatible KV caches: " + "; ".join(diff))
        self._handshakes[key] = reply
        return reply

    def _until(self, deadline: float, address: str, call: Callable[[float], msgspec.Struct]) -> msgspec.Struct:
        """Repeat ``call`` while the peer answers Refused(retry=True) or not at all, until the deadline.
        A peer silent until the deadline is presumed down (``PeerBreaker``); a pull waiting on a peer
        that another pull found down gives up at once."""
        delay = 0.005
        while True:
            if self._breaker.is_open(address):
                raise PeerDown(f"{address} presumed down (silent for a whole pull); it is probed again later")
            left = deadline - time.monotonic()
            if left <= 0:
                raise PullFailed("deadline passed")
            try:
                reply = call(left)
            except side_channel.SideChannelTimeout:
                # A busy prefill (its side-channel thread starved on a shared core) gets until the
                # pull's deadline, not just one request's timeout; the request is idempotent.
                if deadline - time.monotonic() <= 0:
                    self._breaker.silent(address)
                    raise
                continue
            self._breaker.answered(address)
            if not (isinstance(reply, P.Refused) and reply.retry):
                return reply
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.1)

    def _layouts(self, source: RemoteSource) -> PrefillLayout:
        return PrefillLayout(tp_size=source.tp_size, total_kv_heads=self.total_kv_heads,
                             pcp_size=source.pcp_size, dcp_size=source.dcp_size, use_mla=self.use_mla)

    def _pull(self, req: PullRequest) -> None:
        """Plan the request's pulls (on the engine's thread: pure arithmetic), then read from every
        prefill rank in parallel, each on that rank's own queue; the last rank to finish reports."""
        job = _PullJob(req=req, prefill=self._layouts(req.source), start=time.monotonic())
        job.deadline = job.start + self.config.pull_timeout_s
        seed = request_seed(req.source.request_id)
        try:
            job.counts = readers_per_prefill_rank(job.prefill, self.decode_layout, req.num_blocks, req.skip_blocks, seed)
            job.pulls = plan_pulls(job.prefill, self.decode_layout, self.decode_rank, req.num_blocks,
                                   req.skip_blocks, seed)
        except Exception as exc:  # noqa: BLE001 - any failure becomes a load error, never a hang
            job.errors.append(exc)
            job.unread.update(range(max(0, req.skip_blocks), req.num_blocks))
            self._finish(job)
            return
        job.remaining = len(job.pulls)
        if not job.pulls:
            self._finish(job)
            return
        for pull in job.pulls:
            address = self._peer_address(req.source, pull.source, job.prefill)
            if self._queues is None:  # kv_producer only: still answer the protocol, inline
                self._pull_rank(job, pull, address)
                continue
            try:
                self._queues.submit(address, self._pull_rank, job, pull, address)
            except RuntimeError as exc:  # shutting down
                self._rank_done(job, pull, 0, set(), exc)

    def _pull_rank(self, job: _PullJob, pull: RankPull, address: str) -> None:
        read: set[int] = set()  # local block positions fully read from this rank
        nbytes, error = 0, None
        try:
            if not self._breaker.allow(address):
                raise PeerDown(f"{address} presumed down (silent for a whole pull); it is probed again later")
            nbytes = self._pull_from_rank(job, pull, address, read)
        except Exception as exc:  # noqa: BLE001 - any failure becomes a load error, never a hang
            error = exc
        self._rank_done(job, pull, nbytes, read, error)

    def _rank_done(self, job: _PullJob, pull: RankPull, nbytes: int, read: set[int], error: Exception | None) -> None:
        with job.lock:
            job.nbytes += nbytes
            if error is not None:
                job.errors.append(error)
                job.failed_ranks.add(pull.source)
                job.unread.update(dst for _, dst in pull.blocks if dst not in read)
            job.remaining -= 1
            last = job.remaining == 0
        if last:
            self._finish(job)

    def _finish(self, job: _PullJob) -> None:
        """Report the request finished (its unread blocks as load errors) to vLLM at once, then send
        the DONE / FreeNow messages owed to the prefill ranks: the blocks are already read, so the
        decode request need not wait for the prefill's ack."""
        req, source = job.req, job.req.source
        if not job.errors:
            self.stats.record_transfer(job.nbytes, time.monotonic() - job.start)
        else:
            error = job.errors[0]
            logger.warning("MooncakeConnectorV1: pull of request %s (remote %s) failed after %.2fs: %s "
                           "(%d of %d blocks not read)", req.request_id, source.request_id,
                           time.monotonic() - job.start, error, len(job.unread), req.num_blocks - req.skip_blocks)
            self.stats.record_failure("timeout" if "deadline" in str(error) else "pull")
            # Only what was not read: vLLM recomputes from the first failed block on.
            unread = sorted(job.unread)
            self.ledger.record_failed_load(req.request_id, [[g[p] for p in unread if p < len(g)]
                                                            for g in req.local_block_ids])
            self._handshakes = {k: v for k, v in self._handshakes.items() if k[1] != source.engine_id}
        # Always DONE, also after a failure: the prefill must not wait for us until expiry.
        owed: list[tuple[str, msgspec.Struct]] = []
        if not job.counts:
            # No plan: nobody will read any rank. Every decode rank that gets here says so (FreeNow is
            # idempotent), so the prefill frees now even if decode rank 0 is gone.
            for rank in job.prefill.ranks():
                owed.append((self._peer_address(source, rank, job.prefill),
                             P.FreeNow(request_id=source.request_id, reader_id=self.reader_id)))
        for rank, n in job.counts.items():
            if n == 0 and self.decode_rank == DecodeRank(0):  # one decode rank tells the idle ranks
                owed.append((self._peer_address(source, rank, job.prefill),
                             P.FreeNow(request_id=source.request_id, reader_id=self.reader_id)))
        for pull in job.pulls:
            owed.append((self._peer_address(source, pull.source, job.prefill),
                         P.PullDone(request_id=source.request_id, reader_id=self.reader_id,
                                    ok=pull.source not in job.failed_ranks, expected_readers=job.counts[pull.source])))
        with self._lock:
            self._pending_pulls.discard(req.request_id)
            self._finished_recving.add(req.request_id)
        if not owed:
            return
        if self._notifier is None:
            self._send_done(owed)
        else:
            try:
                self._notifier.submit(self._send_done, owed)
            except RuntimeError:  # shutting down
                self._send_done(owed)

    def _send_done(self, owed: list[tuple[str, msgspec.Struct]]) -> None:
        for address, message in owed:
            self._notify(address, message)

    def _notify(self, address: str, message: msgspec.Struct) -> None:
        """Deliver a DONE / FreeNow, retrying for up to ``lease_s``: a busy prefill (its side channel
        thread starved on a loaded host) must not keep the blocks until expiry because one answer
        came late. DONE and FreeNow are idempotent on the prefill, so a repeat is harmless. A peer
        presumed down (``PeerBreaker``) gets one short try per message."""
        now = time.monotonic()
        presumed_dead = self._breaker.state(address) != "closed"
        give_up = now + (0.0 if presumed_dead else self.config.lease_s)
        timeout = 0.2 if presumed_dead else min(1.0, self.config.handshake_timeout_s)
        while True:
            try:
                self._request(address, message, timeout)
                self._breaker.answered(address)
                return
            except side_channel.SideChannelError as exc:
                left = give_up - time.monotonic()
                if left <= 0:
                    if isinstance(exc, side_channel.SideChannelTimeout) and not presumed_dead:
                        self._breaker.silent(address)
                    self._client.forget(address)
                    logger.warning("MooncakeConnectorV1: %s to %s not delivered: %s",
                                   type(message).__name__, address, exc)
                    return
                timeout = min(2 * timeout, self.config.handshake_timeout_s, max(0.05, left))

    def _pull_from_rank(self, job: _PullJob, pull: RankPull, address: str, read: set[int]) -> int:
        req, deadline = job.req, job.deadline
        source = req.source
        hs = self._handshake(address, source.engine_id, deadline)
        block_ids = sorted({source.block_ids[src_pos] for src_pos, _ in pull.blocks})
        started = P.PullStarted(request_id=source.request_id, reader_id=self.reader_id,
                                expected_readers=job.counts[pull.source], block_ids=block_ids)
        reply = self._until(deadline, address,
                            lambda left: self._request(address, started, min(left, self.config.handshake_timeout_s)))
        if not isinstance(reply, P.Ack):
            raise PullFailed(f"{address} refused the pull: {getattr(reply, 'reason', reply)}")
        digests = self._expected_digests(reply, block_ids, hs, address) if self.config.verify_kv else None
        renew = P.LeaseRenew(request_id=source.request_id, reader_id=self.reader_id)
        last_renew = [time.monotonic()]
        delay = self.config.debug_pull_chunk_delay_s

        def on_chunk() -> None:  # keep the lease alive during long pulls
            if delay:
                time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            if time.monotonic() - last_renew[0] > self.config.lease_s / 3:
                last_renew[0] = time.monotonic()
                # A starved prefill answers late: retry until the pull's deadline, never fail early.
                reply = self._until(deadline, address, lambda left: self._request(
                    address, renew, min(left, self.config.handshake_timeout_s)))
                if not isinstance(reply, P.Ack):
                    raise PullFailed(f"{address} refused the lease renewal: {getattr(reply, 'reason', reply)}")

        if delay:  # test-only: a window in which the lease is taken but no byte has moved
            time.sleep(max(0.0, min(delay, deadline - time.monotonic())))

        # Blocks in request order, a batch at a time: a read that fails midway leaves a prefix of
        # the request's blocks complete, and only the rest is reported (and recomputed).
        total = 0
        for start in range(0, len(pull.blocks), PULL_BATCH_BLOCKS):
            batch = dataclasses.replace(pull, blocks=pull.blocks[start:start + PULL_BATCH_BLOCKS])
            local, remote, lengths = self._addresses(req, batch, hs)
            total += self.te.read_blocks(hs.te_address, local, remote, lengths, deadline, on_chunk,
                                         on_retry=lambda _why: self.stats.incr("transfer_retries"))
            if digests is not None:
                self._verify(req, batch, hs, digests)
            read.update(dst for _, dst in batch.blocks)
        return total

    def _remote_parts(self, hs: P.HandshakeReply) -> list[list[KVPart]]:
        if not hs.parts:  # raw regions (tests, benchmarks): heads contiguous inside a block
            raw = LocalCache(hs.layer_names, hs.base_addresses, hs.block_bytes, hs.num_blocks, hs.heads_on_rank)
            return [raw.layer_parts(i) for i in range(len(hs.layer_names))]
        try:
            return [[KVPart(base=p.base, shape=tuple(p.shape), strides=tuple(p.strides),
                            element_size=p.element_size, roles=tuple(p.roles)) for p in layer]
                    for layer in hs.parts]
        except LayoutError as exc:
            raise PullFailed(f"malformed KV layout from the prefill: {exc}") from exc

    def _check_peer(self, source: RemoteSource, hs: P.HandshakeReply) -> None:
        """The plan was made from kv_transfer_params: the prefill must really be laid out that way."""
        assert self.cache is not None
        said = (source.tp_size, source.pcp_size, source.dcp_size)
        has = (hs.tp_size, hs.pcp_size, hs.dcp_size)
        if said != has:
            raise PullFailed(f"kv_transfer_params say the prefill runs TP/PCP/DCP {said}, it runs {has}")
        if hs.kernel_blocks_per_block != self.cache.kernel_blocks_per_block or len(hs.parts or hs.layer_names) \
                != len(hs.layer_names):
            raise PullFailed(f"kernel blocks per block: decode {self.cache.kernel_blocks_per_block}, "
                             f"prefill {hs.kernel_blocks_per_block}")

    def _paired_runs(self, lp: KVPart, rp: KVPart, span: Any) -> list[tuple[int, int, int]]:
        key = (lp.shape, lp.strides, lp.roles, lp.element_size, rp.shape, rp.strides, rp.roles, rp.element_size,
               span.src_head, span.dst_head, span.num_heads)
        runs = self._run_cache.get(key)
        if runs is None:
            try:
                runs = pair_runs(head_span_runs(lp, span.dst_head, span.num_heads),
                                 head_span_runs(rp, span.src_head, span.num_heads))
            except LayoutError as exc:
                raise PullFailed(str(exc)) from exc
            if len(self._run_cache) > 4096:
                self._run_cache.clear()
            self._run_cache[key] = runs
        return runs

    def _addresses(self, req: PullRequest, pull: Any, hs: P.HandshakeReply) -> tuple[list[int], list[int], list[int]]:
        """Byte ranges of ``pull``: every layer, every KV tensor of it, every logical block (each of
        its kernel blocks), every head span; ranges contiguous on both sides are merged."""
        assert self.cache is not None
        cache = self.cache
        self._check_peer(req.source, hs)
        remote_parts = self._remote_parts(hs)
        remote_index = {name: i for i, name in enumerate(hs.layer_names)}
        local_ids = req.local_block_ids[0]
        remote_ids = req.source.block_ids
        ratio = cache.kernel_blocks_per_block
        local: list[int] = []
        remote: list[int] = []
        lengths: list[int] = []
        for li, name in enumerate(cache.layer_names):
            ri = remote_index.get(name)
            if ri is None:
                raise PullFailed(f"layer {name} missing on the prefill")
            lparts, rparts = cache.layer_parts(li), remote_parts[ri]
            if len(lparts) != len(rparts):
                raise PullFailed(f"layer {name}: {len(lparts)} KV tensors here vs {len(rparts)} on the prefill")
            for src_pos, dst_pos in pull.blocks:
                if src_pos >= len(remote_ids) or dst_pos >= len(local_ids):
                    raise PullFailed(f"block position {src_pos}/{dst_pos} outside the request's blocks")
                r_block, l_block = remote_ids[src_pos], local_ids[dst_pos]
                for lp, rp in zip(lparts, rparts):
                    if not (r_block >= 0 and (r_block + 1) * ratio <= rp.num_blocks
                            and l_block >= 0 and (l_block + 1) * ratio <= lp.num_blocks):
                        raise PullFailed(f"block id {r_block}/{l_block} outside the KV cache")
                    for span in pull.spans:
                        runs = self._paired_runs(lp, rp, span)
                        for k in range(ratio):  # kernel blocks of the logical block, in order
                            l_base = lp.base + (l_block * ratio + k) * lp.block_stride_bytes
                            r_base = rp.base + (r_block * ratio + k) * rp.block_stride_bytes
                            for lo, ro, n in runs:
                                loc, r = l_base + lo, r_base + ro
                                if lengths and remote[-1] + lengths[-1] == r and local[-1] + lengths[-1] == loc:
                                    lengths[-1] += n  # contiguous on both sides: one bigger transfer
                                else:
                                    remote.append(r)
                                    local.append(loc)
                                    lengths.append(n)
        return local, remote, lengths

    # ---- verify_kv ---------------------------------------------------------------------------
    def _head_ranges(self, li: int, block: int, head: int) -> list[tuple[int, int]]:
        """(address, length) runs of one KV head of logical ``block`` in layer ``li`` of this rank."""
        assert self.cache is not None
        k = self.cache.kernel_blocks_per_block
        out: list[tuple[int, int]] = []
        for part in self.cache.layer_parts(li):
            step = part.stride("block") * part.element_size
            runs = head_span_runs(part, head, 1)
            for kernel_block in range(block * k, (block + 1) * k):
                start = part.base + kernel_block * step
                out.extend((start + offset, length) for offset, length in runs)
        return out

    def _expected_digests(self, reply: P.Ack, block_ids: list[int], hs: P.HandshakeReply,
                          address: str) -> dict[int, list[int]]:
        heads = hs.heads_on_rank
        if len(reply.digests) != len(block_ids) * heads:  # fail closed: nothing to verify against
            raise PullFailed(f"verify_kv: {address} sent {len(reply.digests)} digests for {len(block_ids)} blocks "
                             f"of {heads} heads (is verify_kv set on the prefill too?)")
        return {b: reply.digests[i * heads:(i + 1) * heads] for i, b in enumerate(block_ids)}

    def _verify(self, req: PullRequest, batch: RankPull, hs: P.HandshakeReply, digests: dict[int, list[int]]) -> None:
        """The blocks of ``batch`` as read here, head by head, against the prefill's digests."""
        assert self.cache is not None
        index = {name: i for i, name in enumerate(self.cache.layer_names)}
        layers = [index[name] for name in hs.layer_names]  # the prefill's layer order
        for src_pos, dst_pos in batch.blocks:
            remote_block, local_block = req.source.block_ids[src_pos], req.local_block_ids[0][dst_pos]
            for span in batch.spans:
                got = head_digests(self._head_ranges, layers, local_block,
                                   range(span.dst_head, span.dst_head + span.num_heads))
                if got != digests[remote_block][span.src_head:span.src_head + span.num_heads]:
                    self.stats.incr("digest_mismatches")
                    raise PullFailed(f"verify_kv: KV of remote block {remote_block} (heads {span.src_head}.."
                                     f"{span.src_head + span.num_heads - 1}) differs from the prefill's digest")

    def _keep_alive(self, source: RemoteSource) -> None:
        """One short try per prefill rank: the next heartbeat comes a third of a lease later."""
        with self._lock:
            self._heartbeats_queued.discard(source.request_id)
        prefill = self._layouts(source)
        message = P.HoldKeepAlive(request_id=source.request_id, reader_id=self.reader_id)
        for rank in prefill.ranks():
            address = self._peer_address(source, rank, prefill)
            if self._breaker.state(address) != "closed":
                continue  # presumed down: its pulls fail fast anyway
            try:
                self._request(address, message, min(1.0, self.config.lease_s / 3, self.config.handshake_timeout_s))
                self._breaker.answered(address)
            except side_channel.SideChannelError as exc:
                logger.debug("MooncakeConnectorV1: keep-alive to %s not delivered: %s", address, exc)

    def _tell_free(self, source: RemoteSource) -> None:
        """Nothing will be pulled for this request (aborted, or a full local hit): free it there."""
        prefill = self._layouts(source)
        if self.decode_rank != DecodeRank(0):
            return
        for rank in prefill.ranks():
            self._notify(self._peer_address(source, rank, prefill),
                         P.FreeNow(request_id=source.request_id, reader_id=self.reader_id))

    # ---- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._queues is not None:
            self._queues.close(cancel=True)
        if self._heartbeats is not None:
            self._heartbeats.shutdown(wait=True, cancel_futures=True)
        if self._notifier is not None:
            self._notifier.shutdown(wait=True)  # owed DONEs go out (each bounded by lease_s)
        self._client.close()
        if self.server is not None:
            self.server.close()
        if self.te is not None:
            self.te.close()

def query_leaks(address: str, timeout_s: float = 2.0) -> dict[str, int]:
    reply = side_channel.request(address, P.LeakQuery(), P.REPLY_TYPES, timeout_s)
    if not isinstance(reply, P.LeakReport):
        raise RuntimeError(f"unexpected reply {reply!r}")
    return msgspec.structs.asdict(reply)
