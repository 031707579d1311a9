"""Decode side of the pull protocol: read each request's KV blocks from the prefill ranks.

A decode rank plans each request's pulls (``pull.plan``, pure arithmetic on the engine's thread)
and reads from every prefill rank in parallel, each rank on its own queue behind a circuit breaker
(``pull.peers``), with a deadline. Blocks are read a batch at a time under a lease the pull renews;
what a rank's read brought counts only once that rank's answer to the DONE says the lease held
throughout (else the blocks may have been freed and reused under the read). The blocks not read
become load errors so vLLM's ``kv_load_failure_policy`` decides, and the request is reported
finished either way, before the DONE / FreeNow still owed to the other prefill ranks goes out.
With ``verify_kv`` each read batch is checked against the prefill's per-head digests. What is said
to the prefill ranks (handshakes, leases, DONE / FreeNow, keep-alives) is ``pull.messenger``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_common.failure_ledger import FailureLedger
from kv_common.kv_layout import KVPart, LayoutError, head_span_runs, pair_runs
from kv_common.logging_utils import get_logger
from kv_common.stats import TransferStatsBase

from kv_mooncake.config import MooncakeConfig
from kv_mooncake.errors import PeerDown, PullFailed, ReadBeforeLease
from kv_mooncake.identity import head_digests
from kv_mooncake.kv_regions import LocalCache, head_ranges
from kv_mooncake.params import RemoteSource
from kv_mooncake.pipeline_stages import decode_stage_layers, stage_layer_problem
from kv_mooncake.pull.byte_ranges import check_peer, no_null_blocks, remote_parts, transfer_ranges
from kv_mooncake.pull.lease import EarlyLease
from kv_mooncake.pull.messenger import PrefillMessenger, peer_address
from kv_mooncake.pull.peers import PeerQueues
from kv_mooncake.pull.plan import RankPull, group_readers_per_prefill_rank, plan_group_pulls, request_seed
from kv_mooncake.rank_layout import DecodeLayout, DecodeRank, PrefillLayout, PrefillRank
from kv_mooncake.step import MooncakeStep, PullRequest
from kv_mooncake.wire import messages as P

__all__ = ["PULL_BATCH_BLOCKS", "DecodePuller", "PeerDown", "PullFailed", "check_peer", "remote_parts", "transfer_ranges"]

logger = get_logger(__name__)

PULL_BATCH_BLOCKS = 16  # blocks per TE read batch: the granularity of a partial pull's report


@dataclass(eq=False)
class _PullJob:
    """One request's pull on this decode rank, over all the prefill ranks it reads from."""

    req: PullRequest
    prefill: PrefillLayout
    start: float
    deadline: float = 0.0
    planned: float = 0.0  # time.monotonic() once planned and handed to the ranks' queues
    counts: dict[PrefillRank, int] = field(default_factory=dict)
    pulls: list[RankPull] = field(default_factory=list)
    by_source: dict[PrefillRank, list[RankPull]] = field(default_factory=dict)  # ``pulls`` per prefill rank
    remaining: int = 0
    nbytes: int = 0
    errors: list[Exception] = field(default_factory=list)
    failed_ranks: set[PrefillRank] = field(default_factory=set)
    told: set[PrefillRank] = field(default_factory=set)  # ranks whose DONE went out with the read
    unread: set[tuple[int, int]] = field(default_factory=set)  # (group, local block position) not read
    # A pipeline-parallel prefill: its layers per stage, and this decode's layers pulled from each.
    partition: tuple[int, ...] = ()
    stage_layers: tuple[tuple[str, ...], ...] = ()
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _RankTimes:
    """When one rank's pull passed each point (``time.monotonic()``), for ``stats.record_phases``."""

    begun: float  # a pull thread took it
    read_begun: float = 0.0  # handshake known, PullStarted sent: the read starts
    read_done: float = 0.0

    def phases(self, job: _PullJob, confirmed: float) -> dict[str, float]:
        """Seconds of: planning on the engine's thread, the hand-off to a pull thread, the lease
        (handshake lookup, PullStarted sent), the read (with verify_kv's check), the DONE's round trip."""
        planned = job.planned or self.begun  # inline (no pull threads): no hand-off
        return {"pull_plan": planned - job.start, "pull_hand_off": self.begun - planned,
                "pull_lease": self.read_begun - self.begun, "pull_read": self.read_done - self.read_begun,
                "pull_confirm": confirmed - self.read_done}


PairedRuns = Callable[[KVPart, KVPart, Any], list[tuple[int, int, int]]]


def _stage_layers(job: _PullJob, pull: RankPull, hs: P.HandshakeReply, address: str) -> tuple[str, ...] | None:
    """The layers to read from ``pull``'s pipeline stage (None: one stage, every layer), once the
    stage's handshake shows it is that stage and holds exactly those layers, by name."""
    if not job.stage_layers:
        return None
    stage = pull.source.pp_rank
    if hs.pp_rank != stage:
        raise PullFailed(f"{address} is pipeline stage {hs.pp_rank}, this decode pulls stage {stage} there")
    problem = stage_layer_problem(job.stage_layers[stage], hs.layer_names, stage, job.partition)
    if problem:
        raise PullFailed(f"{address}: {problem}")
    return job.stage_layers[stage]



@functools.lru_cache(maxsize=64)  # a decode pulls from a few prefill shapes; the params bound them
def _prefill_layout(tp_size: int, pcp_size: int, dcp_size: int, pp_size: int, total_kv_heads: int,
                    use_mla: bool) -> PrefillLayout:
    return PrefillLayout(tp_size=tp_size, total_kv_heads=total_kv_heads, pcp_size=pcp_size, dcp_size=dcp_size,
                         use_mla=use_mla, pp_size=pp_size)

class DecodePuller:
    """One decode rank's pulls: plan, read with the TransferEngine, verify, report to vLLM."""

    def __init__(
        self,
        config: MooncakeConfig,
        *,
        reader_id: str,
        decode_rank: DecodeRank,
        decode_layout: DecodeLayout,
        total_kv_heads: int,
        use_mla: bool,
        stats: TransferStatsBase,
        ledger: FailureLedger,
        num_hidden_layers: int = 0,
        on_finished: Callable[[], None] = lambda: None,
    ):
        self.config = config
        self._on_finished = on_finished  # a pull ended: the worker's idle step stops waiting (idle_step)
        self.reader_id = reader_id
        self.decode_rank, self.decode_layout = decode_rank, decode_layout
        self.total_kv_heads, self.use_mla = total_kv_heads, use_mla
        self.stats, self.ledger = stats, ledger
        self.num_hidden_layers = num_hidden_layers  # the model's, for a PP prefill's stage ranges
        self.messenger = PrefillMessenger(config, reader_id=reader_id, decode_rank=decode_rank)
        self._lock = threading.Lock()
        self._finished: set[str] = set()  # pulls finished since the last ``take_finished`` (finished_recving)
        self._pending_pulls: set[str] = set()
        self._run_cache: dict[tuple, list[tuple[int, int, int]]] = {}  # paired byte runs per layout pair
        # Set when the KV cache is registered.
        self.cache: LocalCache | None = None
        self.te: Any = None
        # Without ``start_threads`` (a kv_producer-only rank) pulls still run, inline.
        self._queues: PeerQueues | None = None  # one pull queue per prefill rank

    def attach(self, cache: LocalCache, compatibility: P.Compatibility, te: Any) -> None:
        self.cache, self.te = cache, te
        self.messenger.compatibility = compatibility

    def start_threads(self) -> None:
        self._queues = PeerQueues(self.config.num_pull_threads, name="mooncake-pull")
        self.messenger.start_threads()

    # ---- per step ----------------------------------------------------------------------------
    def start_step(self, step: MooncakeStep) -> None:
        for source in step.keepalives:
            self.messenger.keep_alive(source, self._layouts(source))
        for source in step.frees:
            self.messenger.free_now(source, self._layouts(source))
        for pull in step.pulls:
            with self._lock:
                self._pending_pulls.add(pull.request_id)
            self._pull(pull)

    def take_finished(self) -> set[str]:
        """Requests whose pull finished (read, or its unread blocks reported) since the last call."""
        with self._lock:
            finished, self._finished = self._finished, set()
        return finished

    def pending_pulls(self) -> int:
        with self._lock:
            return len(self._pending_pulls)

    # ---- pulls -------------------------------------------------------------------------------
    def _layouts(self, source: RemoteSource) -> PrefillLayout:
        """The prefill instance's layout, made once per shape of prefill (not per pull, keep-alive
        and free): every request of the same prefill names the same sizes."""
        return _prefill_layout(source.tp_size, source.pcp_size, source.dcp_size, source.pp_size,
                               self.total_kv_heads, self.use_mla)

    def _pull(self, req: PullRequest) -> None:
        """Plan the request's pulls (on the engine's thread: pure arithmetic), then read from every
        prefill rank in parallel, each on that rank's own queue; the last rank to finish reports."""
        job = _PullJob(req=req, prefill=self._layouts(req.source), start=time.monotonic())
        job.deadline = job.start + self.config.pull_timeout_s
        seed = request_seed(req.source.request_id)
        groups = req.blocks_by_group
        try:
            if req.check_null_blocks:
                no_null_blocks(req)
            job.pulls = plan_group_pulls(job.prefill, self.decode_layout, self.decode_rank, groups, seed)
            job.counts = group_readers_per_prefill_rank(job.prefill, self.decode_layout, groups, seed,
                                                        planned={self.decode_rank: job.pulls})
            if req.source.pp_size > 1:
                assert self.cache is not None
                declared = self.config.prefill.pp_layer_partition if self.config.prefill is not None else None
                job.partition, job.stage_layers = decode_stage_layers(
                    self.cache.layer_names, self.num_hidden_layers, req.source.pp_size, declared)
        except Exception as exc:  # noqa: BLE001 - any failure becomes a load error, never a hang
            job.errors.append(exc)
            job.unread.update((g, p) for g, blocks in enumerate(groups) for p in range(max(0, blocks.first), blocks.end))
            self._finish(job)
            return
        for pull in job.pulls:  # one read (lease, DONE) per prefill rank, all groups in it
            job.by_source.setdefault(pull.source, []).append(pull)
        job.remaining = len(job.by_source)
        if not job.by_source:
            self._finish(job)
            return
        for source, pulls in job.by_source.items():
            address = peer_address(req.source, source, job.prefill)
            if self._queues is None:  # kv_producer only: still answer the protocol, inline
                self._pull_rank(job, pulls, address)
                continue
            job.planned = job.planned or time.monotonic()
            try:
                self._queues.submit(address, self._pull_rank, job, pulls, address)
            except RuntimeError as exc:  # shutting down
                self._rank_done(job, pulls, 0, set(), exc)

    def _pull_rank(self, job: _PullJob, pulls: list[RankPull], address: str) -> None:
        read: set[tuple[int, int]] = set()  # (group, local block position) fully read from this rank
        nbytes, error = 0, None
        times = _RankTimes(begun=time.monotonic())
        try:
            self.messenger.check_not_down(address)
            nbytes = self._pull_from_rank(job, pulls, address, read, times)
        except Exception as exc:  # noqa: BLE001 - any failure becomes a load error, never a hang
            error = exc
        times.read_done = time.monotonic()
        if read:
            error = self._confirm_read(job, pulls[0], address, read, error)
        if error is None and read:
            self.stats.record_phases(times.phases(job, time.monotonic()))
        self._rank_done(job, pulls, nbytes, read, error)

    def _confirm_read(self, job: _PullJob, pull: RankPull, address: str, read: set[tuple[int, int]],
                      error: Exception | None) -> Exception | None:
        """The DONE to this rank, now, with its reply: unless the lease held from PullStarted to the
        DONE, nothing read from the rank counts (``read`` is emptied, its blocks become load errors)."""
        source = job.req.source
        done = P.PullDone(request_id=source.request_id, reader_id=self.reader_id, ok=error is None,
                          expected_readers=job.counts[pull.source])
        # Its own bound too: a read that just made the pull's deadline still gets its answer.
        deadline = max(job.deadline, time.monotonic() + self.config.handshake_timeout_s)
        try:
            held = self.messenger.confirm_read(address, done, deadline)
            with job.lock:
                job.told.add(pull.source)
        except Exception as exc:  # noqa: BLE001 - unconfirmed is not read (the DONE is sent again later)
            held, why = False, f"no answer to the DONE: {exc}"
        else:
            why = "the prefill freed them, or the lease lapsed"
        if held:
            return error
        self.stats.incr("void_reads")
        read.clear()
        return error or PullFailed(f"{address}: the hold on request {source.request_id} did not last the "
                                   f"whole read ({why}): what was read is void")

    def _rank_done(self, job: _PullJob, pulls: list[RankPull], nbytes: int, read: set[tuple[int, int]],
                   error: Exception | None) -> None:
        with job.lock:
            job.nbytes += nbytes
            if error is not None:
                job.errors.append(error)
                job.failed_ranks.add(pulls[0].source)
                job.unread.update(block for pull in pulls for _, dst in pull.blocks
                                  if (block := (pull.group, dst)) not in read)
            job.remaining -= 1
            last = job.remaining == 0
        if last:
            self._finish(job)

    def _finish(self, job: _PullJob) -> None:
        """Report the request finished (its unread blocks as load errors) to vLLM at once, then send
        the DONE / FreeNow messages still owed to the prefill ranks (those that were read from had
        their DONE with the read, ``_confirm_read``): the decode request waits on no other ack."""
        req, source = job.req, job.req.source
        if not job.errors:
            self.stats.record_transfer(job.nbytes, time.monotonic() - job.start)
        else:
            error = job.errors[0]
            logger.warning("MooncakeConnectorV1: pull of request %s (remote %s) failed after %.2fs: %s "
                           "(%d of %d blocks not read)", req.request_id, source.request_id,
                           time.monotonic() - job.start, error, len(job.unread),
                           sum(max(0, b.end - max(0, b.first)) for b in req.blocks_by_group))
            self.stats.record_failure("timeout" if "deadline" in str(error) else "pull")
            # Only what was not read: vLLM recomputes from the first failed block on.
            unread = sorted(job.unread)
            self.ledger.record_failed_load(req.request_id, [[ids[p] for g, p in unread if g == group and p < len(ids)]
                                                            for group, ids in enumerate(req.local_block_ids)])
            self.messenger.forget_handshakes(source.engine_id)
        with self._lock:
            self._pending_pulls.discard(req.request_id)
            self._finished.add(req.request_id)
        self._on_finished()
        self.messenger.pull_finished(source, job.prefill, job.counts, [ps[0] for ps in job.by_source.values()],
                                     job.failed_ranks, frozenset(job.told))

    def _pull_from_rank(self, job: _PullJob, pulls: list[RankPull], address: str, read: set[tuple[int, int]],
                        times: _RankTimes) -> int:
        req, deadline = job.req, job.deadline
        source = req.source
        hs = self.messenger.handshake(address, source.engine_id, deadline)
        layers = _stage_layers(job, pulls[0], hs, address)
        remote_groups = source.block_ids_by_group
        try:
            block_ids = sorted({remote_groups[pull.group][src_pos] for pull in pulls for src_pos, _ in pull.blocks})
        except IndexError as exc:
            raise PullFailed(f"a planned block is outside the prefill's block lists: {exc}") from exc
        started = P.PullStarted(request_id=source.request_id, reader_id=self.reader_id,
                                expected_readers=job.counts[pulls[0].source], block_ids=block_ids,
                                prompt_digest=req.prompt_digest)
        # Read first, confirm after (pull.lease): the lease's answer is awaited once a batch landed.
        lease = self.messenger.start_lease(address, started, deadline)
        times.read_begun = time.monotonic()
        try:
            delay = self.config.debug_pull_chunk_delay_s
            if delay:  # test-only: a window in which the lease is taken but no byte has moved
                lease.answer()
                time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            try:
                return self._read_rank(job, pulls, address, read, hs, lease, block_ids, layers)
            except ReadBeforeLease:  # read again, now under the lease (with the handshake of its boot)
                self.stats.incr("reads_redone")
                read.clear()
                hs = self.messenger.same_boot(address, source.engine_id, hs, lease.answer().boot_id, deadline)
                layers = _stage_layers(job, pulls[0], hs, address)  # a new boot may hold other layers
                return self._read_rank(job, pulls, address, read, hs, lease, block_ids, layers)
        finally:
            lease.close()

    def _read_rank(self, job: _PullJob, pulls: list[RankPull], address: str, read: set[tuple[int, int]],
                   hs: P.HandshakeReply, lease: EarlyLease, block_ids: list[int],
                   layers: Sequence[str] | None) -> int:
        req, deadline = job.req, job.deadline
        renew_lease = self.messenger.lease_renewer(address, req.source.request_id, deadline)
        delay = self.config.debug_pull_chunk_delay_s
        digests: list[dict[int, list[int]] | None] = []

        def on_chunk() -> None:  # keep the lease alive during long pulls
            if delay:
                time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            renew_lease()

        # Blocks in request order, a batch at a time: a read that fails midway leaves a prefix of
        # the request's blocks complete, and only the rest is reported (and recomputed).
        # Several batches in flight (asynchronous TE reads, transfer_engine.read_batches); each is
        # verified and counted as read once its bytes landed, in order.
        batches = [dataclasses.replace(pull, blocks=pull.blocks[start:start + PULL_BATCH_BLOCKS])
                   for pull in pulls for start in range(0, len(pull.blocks), PULL_BATCH_BLOCKS)]

        def landed(i: int) -> None:
            if not digests:  # the first batch: the lease's answer (granted? held since before the read?)
                ack = lease.answer()
                if not lease.covers_read() or ack.boot_id != hs.boot_id:
                    raise ReadBeforeLease()
                digests.append(self._expected_digests(ack, block_ids, hs, address) if self.config.verify_kv
                               else None)
            on_chunk()  # first, as before: a refused lease renewal leaves this batch unread
            if digests[0] is not None:
                self._verify(req, batches[i], hs, digests[0])
            read.update((batches[i].group, dst) for _, dst in batches[i].blocks)

        lease.reading()
        return int(self.te.read_batches(hs.te_address, (self._addresses(req, b, hs, layers) for b in batches),
                                        deadline, landed, on_retry=lambda _why: self.stats.incr("transfer_retries"),
                                        idle=lease.idle, before_status=lease.settle))

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

    def _addresses(self, req: PullRequest, pull: Any, hs: P.HandshakeReply,
                   layers: Sequence[str] | None = None) -> tuple[list[int], list[int], list[int]]:
        assert self.cache is not None
        return transfer_ranges(self.cache, hs, req, pull, self._paired_runs, layers)

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
        ranges = functools.partial(head_ranges, self.cache)
        index = {name: i for i, name in enumerate(self.cache.layer_names)}
        layers = [index[name] for name in hs.layer_names]  # the prefill's layer order
        for src_pos, dst_pos in batch.blocks:
            remote_block = req.source.block_ids_by_group[batch.group][src_pos]
            local_block = req.local_block_ids[batch.group][dst_pos]
            for span in batch.spans:
                got = head_digests(ranges, layers, local_block,
                                   range(span.dst_head, span.dst_head + span.num_heads))
                if got != digests[remote_block][span.src_head:span.src_head + span.num_heads]:
                    self.stats.incr("digest_mismatches")
                    raise PullFailed(f"verify_kv: KV of remote block {remote_block} (heads {span.src_head}.."
                                     f"{span.src_head + span.num_heads - 1}) differs from the prefill's digest")

    def close(self) -> None:
        if self._queues is not None:
            self._queues.close(cancel=True)
        self.messenger.close()
