"""Decode side of the pull protocol: read each request's KV blocks from the prefill ranks.

A decode rank plans each request's pulls (``pull_plan``, pure arithmetic on the engine's thread)
and reads from every prefill rank in parallel, each rank on its own queue behind a circuit breaker
(``peer_health``), with a deadline. Blocks are read a batch at a time under a lease the pull renews;
what a rank's read brought counts only once that rank's answer to the DONE says the lease held
throughout (else the blocks may have been freed and reused under the read). The blocks not read
become load errors so vLLM's ``kv_load_failure_policy`` decides, and the request is reported
finished either way, before the DONE / FreeNow still owed to the other prefill ranks goes out.
With ``verify_kv`` each read batch is checked against the prefill's per-head digests. What is said
to the prefill ranks (handshakes, leases, DONE / FreeNow, keep-alives) is ``prefill_messenger``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_common.failure_ledger import FailureLedger
from kv_common.kv_cache_groups import NULL_BLOCK_ID
from kv_common.kv_layout import KVPart, LayoutError, head_span_runs, pair_runs
from kv_common.logging_utils import get_logger
from kv_common.stats import TransferStatsBase

from kv_mooncake import protocol as P
from kv_mooncake.config import MooncakeConfig
from kv_mooncake.early_lease import EarlyLease, ReadBeforeLease
from kv_mooncake.kv_digest import head_digests
from kv_mooncake.local_cache import LocalCache, head_ranges
from kv_mooncake.metadata import MooncakeStep, PullRequest, RemoteSource
from kv_mooncake.peer_health import PeerQueues
from kv_mooncake.pipeline_stages import decode_stage_layers, stage_layer_problem
from kv_mooncake.prefill_messenger import PrefillMessenger, peer_address
from kv_mooncake.pull_errors import PeerDown, PullFailed
from kv_mooncake.pull_plan import (
    DecodeLayout,
    DecodeRank,
    GroupBlocks,
    PlanError,
    PrefillLayout,
    PrefillRank,
    RankPull,
    group_readers_per_prefill_rank,
    plan_group_pulls,
    request_seed,
)

__all__ = ["PULL_BATCH_BLOCKS", "DecodePuller", "PeerDown", "PullFailed", "check_peer", "remote_parts", "transfer_ranges"]

logger = get_logger(__name__)

PULL_BATCH_BLOCKS = 16  # blocks per TE read batch: the granularity of a partial pull's report
ARRAY_MIN_BLOCK_LAYERS = 64  # blocks x layers from which numpy computes a pull's ranges (address_arrays)


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


# ---- byte ranges of a pull (pure: the handshake and this rank's cache in, addresses out) ----------
def remote_parts(hs: P.HandshakeReply) -> list[list[KVPart]]:
    """The prefill rank's KV tensors per layer, as its handshake describes them."""
    if not hs.parts:  # raw regions (tests, benchmarks): heads contiguous inside a block
        raw = LocalCache(hs.layer_names, hs.base_addresses, hs.block_bytes, hs.num_blocks, hs.heads_on_rank)
        return [raw.layer_parts(i) for i in range(len(hs.layer_names))]
    try:
        return [[KVPart(base=p.base, shape=tuple(p.shape), strides=tuple(p.strides),
                        element_size=p.element_size, roles=tuple(p.roles)) for p in layer]
                for layer in hs.parts]
    except LayoutError as exc:
        raise PullFailed(f"malformed KV layout from the prefill: {exc}") from exc


def check_peer(cache: LocalCache, source: RemoteSource, hs: P.HandshakeReply) -> None:
    """The plan was made from kv_transfer_params: the prefill must really be laid out that way."""
    said = (source.tp_size, source.pcp_size, source.dcp_size, source.pp_size)
    has = (hs.tp_size, hs.pcp_size, hs.dcp_size, hs.pp_size or 1)  # no pp_size: a peer from before PP
    if said != has:
        raise PullFailed(f"kv_transfer_params say the prefill runs TP/PCP/DCP/PP {said}, it runs {has}")
    if hs.kernel_blocks_per_block != cache.kernel_blocks_per_block or len(hs.parts or hs.layer_names) \
            != len(hs.layer_names):
        raise PullFailed(f"kernel blocks per block: decode {cache.kernel_blocks_per_block}, "
                         f"prefill {hs.kernel_blocks_per_block}")


def no_null_blocks(req: PullRequest, groups: list[GroupBlocks]) -> None:
    """With several KV-cache groups, vLLM's null block (id 0) stands for a sliding window's dropped
    blocks: a block to pull must be a real one on both sides, else its KV is gone (or would land in
    the null block, which every request shares)."""
    remote = req.source.group_block_ids()
    if not (len(groups) == len(remote) == len(req.local_block_ids)):
        raise PlanError(f"KV-cache groups: {len(groups)} planned, the decode has {len(req.local_block_ids)} "
                        f"block lists, the prefill sent {len(remote)}")
    for g, blocks in enumerate(groups):
        for side, ids in (("prefill", remote[g]), ("decode", req.local_block_ids[g])):
            if len(ids) < blocks.end:
                raise PlanError(f"KV-cache group {g}: the {side} has {len(ids)} blocks, {blocks.end} needed")
            if NULL_BLOCK_ID in ids[max(0, blocks.first):blocks.end]:
                raise PlanError(f"KV-cache group {g}: the {side}'s blocks {blocks.first}..{blocks.end - 1} "
                                "include vLLM's null block (a block its sliding window dropped)")


PairedRuns = Callable[[KVPart, KVPart, Any], list[tuple[int, int, int]]]


def transfer_ranges(cache: LocalCache, hs: P.HandshakeReply, req: PullRequest, pull: Any,
                    paired_runs: PairedRuns, layers: Sequence[str] | None = None,
                    use_arrays: bool | None = None) -> tuple[list[int], list[int], list[int]]:
    """(local addresses, remote addresses, lengths) of ``pull``: every layer (of ``layers``, the
    pipeline stage's, when given; matched by name on both sides), every KV tensor of it,
    every logical block (each of its kernel blocks), every head span; ranges contiguous on both
    sides are merged. ``paired_runs(local part, remote part, span)``: the byte runs of a head span
    inside one block, paired between the two layouts. Only the layers of the pull's KV-cache group
    move, each addressed through that group's block lists. The same with numpy (``use_arrays``; by
    default for pulls of many blocks and layers): ``address_arrays``, held to this loop by tests."""
    check_peer(cache, req.source, hs)
    rparts_by_layer = remote_parts(hs)
    remote_groups = req.source.group_block_ids()
    if not (pull.group < len(req.local_block_ids) and pull.group < len(remote_groups)):
        raise PullFailed(f"KV-cache group {pull.group}: the decode has {len(req.local_block_ids)} block lists, "
                         f"the prefill sent {len(remote_groups)}")
    local_ids = req.local_block_ids[pull.group]
    remote_ids = remote_groups[pull.group]
    if use_arrays is None:  # numpy comes with vLLM; kv-mooncake itself does not require it
        use_arrays = len(pull.blocks) * len(cache.layer_names) >= ARRAY_MIN_BLOCK_LAYERS and _have_numpy()
    if use_arrays:
        from kv_mooncake.address_arrays import transfer_ranges_arrays

        wanted = set(cache.layer_names if layers is None else layers)
        in_group = [li for li, name in enumerate(cache.layer_names)
                    if name in wanted and cache.group_of(li) == pull.group]
        return transfer_ranges_arrays([cache.layer_names[li] for li in in_group],
                                      lambda i: cache.layer_parts(in_group[i]), hs.layer_names, rparts_by_layer,
                                      remote_ids, local_ids, pull, cache.kernel_blocks_per_block, paired_runs)
    remote_index = {name: i for i, name in enumerate(hs.layer_names)}
    ratio = cache.kernel_blocks_per_block
    local: list[int] = []
    remote: list[int] = []
    lengths: list[int] = []
    local_index = {name: i for i, name in enumerate(cache.layer_names)}
    for name in cache.layer_names if layers is None else layers:
        li, ri = local_index[name], remote_index.get(name)
        if cache.group_of(li) != pull.group:
            continue
        if ri is None:
            raise PullFailed(f"layer {name} missing on the prefill")
        lparts, rparts = cache.layer_parts(li), rparts_by_layer[ri]
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
                    runs = paired_runs(lp, rp, span)
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


@functools.cache
def _have_numpy() -> bool:
    return importlib.util.find_spec("numpy") is not None


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
        return PrefillLayout(tp_size=source.tp_size, total_kv_heads=self.total_kv_heads, pcp_size=source.pcp_size,
                             dcp_size=source.dcp_size, use_mla=self.use_mla, pp_size=source.pp_size)

    def _pull(self, req: PullRequest) -> None:
        """Plan the request's pulls (on the engine's thread: pure arithmetic), then read from every
        prefill rank in parallel, each on that rank's own queue; the last rank to finish reports."""
        job = _PullJob(req=req, prefill=self._layouts(req.source), start=time.monotonic())
        job.deadline = job.start + self.config.pull_timeout_s
        seed = request_seed(req.source.request_id)
        groups = req.blocks_by_group()
        try:
            if req.group_blocks:
                no_null_blocks(req, groups)
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
                           sum(max(0, b.end - max(0, b.first)) for b in req.blocks_by_group()))
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
        remote_groups = source.group_block_ids()
        try:
            block_ids = sorted({remote_groups[pull.group][src_pos] for pull in pulls for src_pos, _ in pull.blocks})
        except IndexError as exc:
            raise PullFailed(f"a planned block is outside the prefill's block lists: {exc}") from exc
        started = P.PullStarted(request_id=source.request_id, reader_id=self.reader_id,
                                expected_readers=job.counts[pulls[0].source], block_ids=block_ids,
                                prompt_digest=req.prompt_digest)
        # Read first, confirm after (early_lease): the lease's answer is awaited once a batch landed.
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
            remote_block = req.source.group_block_ids()[batch.group][src_pos]
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
