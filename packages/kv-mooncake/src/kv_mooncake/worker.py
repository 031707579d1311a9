"""Worker side of MooncakeConnectorV1: one per worker process, owns this rank's KV tensors.

A thin composition that vLLM's worker-side connector hooks call (``connector.py``): it registers
the KV cache with the TransferEngine, runs this rank's side channel, and hands each step's work to
the side it belongs to:

- ``hold.responder.PrefillHolder`` keeps finished requests' blocks until every expected reader is
  done, the hold expires, or the decode says nobody will read them, and answers the readers;
- ``pull.puller.DecodePuller`` reads requests' blocks from the prefill ranks (per-rank queues,
  circuit breaker, partial load errors, hold keep-alives, ``verify_kv``).

Both always exist (a kv_producer-only rank still answers FreeNow and pulls inline); only a consumer
starts the puller's threads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from kv_common.failure_ledger import FailureLedger
from kv_common.idle_step import IdleStepWait
from kv_common.kv_byte_settings import KVByteSettings
from kv_common.kv_cache_groups import KVGroup
from kv_common.logging_utils import get_logger
from kv_common.stats import TransferStatsBase

from kv_mooncake.config import MooncakeConfig
from kv_mooncake.errors import PeerDown, PullFailed, SideChannelError
from kv_mooncake.hold.responder import PrefillHolder
from kv_mooncake.identity import group_layouts
from kv_mooncake.kv_regions import LocalCache, check_kv_cache_groups, describe_kv_caches
from kv_mooncake.pipeline_stages import own_stage_problem
from kv_mooncake.pull.puller import PULL_BATCH_BLOCKS, DecodePuller
from kv_mooncake.rank_layout import DecodeLayout, DecodeRank, PrefillLayout, PrefillRank
from kv_mooncake.step import MooncakeStep
from kv_mooncake.wire import client as side_channel
from kv_mooncake.wire import messages as P
from kv_mooncake.wire.connection import rank_port
from kv_mooncake.wire.seal import SideChannelAuth, auth_from_env
from kv_mooncake.wire.server import SideChannelServer

__all__ = ["PULL_BATCH_BLOCKS", "LocalCache", "MooncakeWorker", "PeerDown", "PullFailed", "RankContext",
           "check_kv_cache_groups", "describe_kv_caches", "query_leaks"]

logger = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """What describes this worker rank, read from vLLM's config once by the connector: who it is
    (engine, role, ranks and layouts), what its KV bytes are and how they are grouped and staged."""

    engine_id: str
    is_producer: bool
    is_consumer: bool
    side_channel_port: int  # this instance's base port (DP rank included); each rank adds its index
    prefill_rank: PrefillRank = PrefillRank(0, 0)
    decode_rank: DecodeRank = DecodeRank(0)
    prefill_layout: PrefillLayout | None = None  # None: one TP rank holding total_kv_heads
    decode_layout: DecodeLayout = DecodeLayout(1)
    total_kv_heads: int = 1
    use_mla: bool = False
    # What peers must share (the handshake's Compatibility) and this instance's logical block size.
    kv_byte_settings: KVByteSettings = KVByteSettings(model="")
    # (KV heads on this rank, head size) from vLLM's model config, to recognise the KV tensors'
    # layout; None: read from the CPU layout's shape (kv_regions.describe_kv_caches).
    kv_shape: tuple[int, int] | None = None
    kv_groups: tuple[KVGroup, ...] = ()
    layer_partition: tuple[int, ...] | None = None  # a PP prefill's layers per stage (pipeline_stages)
    num_hidden_layers: int = 0


class MooncakeWorker:
    def __init__(self, config: MooncakeConfig, context: RankContext,
                 engine_factory: Callable[..., Any] | None = None):
        self.config = config
        self.context = context
        self.prefill_layout = context.prefill_layout or PrefillLayout(
            tp_size=1, total_kv_heads=context.total_kv_heads, use_mla=context.use_mla)
        self._engine_factory = engine_factory
        self.reader_id = f"{context.engine_id}:{context.decode_rank.tp_rank}"

        self.stats = TransferStatsBase()
        self.ledger = FailureLedger()
        # vLLM maps load-error block ids back to requests only with one KV-cache group (block ids are
        # unique only within a group; with more it raises in the EngineCore): report whole requests.
        self.failures_per_request = len(context.kv_groups) > 1
        self._failed_pulls: set[str] = set()  # failed, not yet seen in finished_recving
        # vLLM steps the engine while blocks are held or pulls run; a step that schedules nothing
        # waits here for news instead of spinning (kv_common.idle_step).
        self.idle_wait = IdleStepWait(config.idle_step_wait_ms)
        self.holder = PrefillHolder(config, engine_id=context.engine_id, prefill_layout=self.prefill_layout,
                                    stats=self.stats, pp_rank=context.prefill_rank.pp_rank,
                                    on_freed=self.idle_wait.notify)
        self.puller = DecodePuller(config, reader_id=self.reader_id, decode_rank=context.decode_rank,
                                   decode_layout=context.decode_layout, total_kv_heads=context.total_kv_heads,
                                   use_mla=context.use_mla, stats=self.stats, ledger=self.ledger,
                                   num_hidden_layers=context.num_hidden_layers, on_finished=self.idle_wait.notify)

        self.cache: LocalCache | None = None
        self.compatibility: P.Compatibility | None = None
        self.te: Any = None
        self.server: SideChannelServer | None = None
        self._closed = False

    # ---- setup -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        context = self.context
        heads_on_rank, head_size = context.kv_shape or (None, None)
        cache, shape = describe_kv_caches(
            kv_caches, heads_on_rank=heads_on_rank, head_size=head_size, use_mla=context.use_mla,
            block_size=context.kv_byte_settings.block_size,
        )
        first = next(iter(kv_caches.values()))
        first = first[0] if isinstance(first, (list, tuple)) else first
        self.register_cache(cache, shape, dtype=str(first.dtype).removeprefix("torch."))

    def register_cache(self, cache: LocalCache, shape: dict[str, int], dtype: str) -> None:
        """Register raw regions (tests and benchmarks use this without torch)."""
        context = self.context
        if context.kv_groups:
            cache.layer_groups = layer_groups(cache.layer_names, context.kv_groups)
        if context.is_producer and context.layer_partition is not None:
            # Every decode expects this stage's layers by the partition: a stage that holds others
            # would have each pull refused, so it does not start.
            problem = own_stage_problem(cache.layer_names, context.prefill_rank.pp_rank, context.layer_partition)
            if problem:
                raise ValueError(f"MooncakeConnectorV1: {problem}")
        self.cache = cache
        settings = context.kv_byte_settings
        self.compatibility = P.Compatibility(
            model=settings.model,
            dtype=dtype,
            block_size=shape["block_size"],
            head_size=shape["head_size"],
            num_layers=shape["num_layers"],
            total_kv_heads=1 if context.use_mla else context.total_kv_heads,
            use_mla=context.use_mla,
            layout=cache.layout,
            revision=settings.revision,
            model_weights=settings.model_weights,
            quantization=settings.quantization,
            model_dtype=settings.model_dtype,
            cache_dtype=settings.cache_dtype,
            kernel_block_size=int(shape.get("kernel_block_size", shape["block_size"])),
            pipeline_parallel_size=settings.pipeline_parallel_size,
            cp_kv_cache_interleave_size=settings.cp_kv_cache_interleave_size,
            protocol_version=P.PROTOCOL_VERSION,
            kv_groups=group_layouts(context.kv_groups),
        )
        if self._engine_factory is not None:
            self.te = self._engine_factory()
        else:
            from kv_mooncake.engine.transfer_engine import MooncakeTransferEngine

            self.te = MooncakeTransferEngine(
                self.config.transfer_engine_host(),
                self.config.protocol,
                self.config.device_name,
                self.config.max_inflight_transfers,
                self.config.transfer_attempt_timeout_s,
            )
        self.te.register(cache.regions())
        self.holder.attach(cache, self.compatibility, self.te)
        self.puller.attach(cache, self.compatibility, self.te)
        if context.is_producer or self.config.decode_side_channel:
            if context.is_producer:
                port = rank_port(context.side_channel_port, context.prefill_rank.index(self.prefill_layout))
            else:
                port = rank_port(context.side_channel_port, context.decode_rank.index(context.decode_layout))
            try:
                self.server = SideChannelServer(
                    self.config.bind_host(), port, self.handle, P.REQUEST_TYPES,
                    self.config.max_message_bytes, name=f"mooncake-side-channel:{port}",
                    auth=auth_from_env(self.config.side_channel_secret_env), trusted_only=(P.LeakQuery,),
                ).start()
            except SideChannelError as exc:  # say which setting chose the address
                raise SideChannelError(
                    f"{exc}; the side channel listens on side_channel_bind_host "
                    f"({self.config.side_channel_bind_host!r}), else on the address peers are told: "
                    f"side_channel_host ({self.config.side_channel_host!r}), else VLLM_HOST_IP or this "
                    f"machine's address ({self.config.advertised_host()!r})") from exc
            logger.info("MooncakeConnectorV1 %s rank: side channel listens on %s, peers are told %s; TE %s",
                        "prefill" if context.is_producer else "decode", self.server.address,
                        self.config.advertised_host(), self.te.rpc_address)
            if self.config.advertised_host() in ("0.0.0.0", "::"):  # vLLM's answer when no route is found
                logger.warning("MooncakeConnectorV1: peers are told %s, which no peer can connect to: set "
                               "VLLM_HOST_IP or side_channel_host to this machine's address",
                               self.config.advertised_host())
        if context.is_consumer:
            self.puller.start_threads()

    # ---- per step ----------------------------------------------------------------------------
    def start_step(self, step: MooncakeStep) -> None:
        self.idle_wait.begin_step(step.idle)
        for hold in step.holds:
            self.holder.hold(hold.request_id, hold.num_blocks, hold.block_ids, hold.ttl_s, hold.prompt_digest)
        self.puller.start_step(step)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        self.idle_wait.before_report()
        sending = self.holder.take_freed()
        recving = self.puller.take_finished()
        return sending or None, recving or None

    def take_failed_pulls(self, finished_recving: set[str], finished_req_ids: set[str]) -> set[str]:
        """The requests whose pull failed or was partial, for vLLM's ``failed_recving`` (it recomputes
        them whole, or fails them, by its kv_load_failure_policy): with several KV-cache groups only.
        A request is reported in the step that also reports it in ``finished_recving`` (vLLM drops a
        failure of a request it does not see finish); one vLLM finished first is forgotten."""
        failed = self.ledger.take_failed_requests()
        if not self.failures_per_request:
            return set()  # one group: its unread blocks go out as block ids
        self._failed_pulls |= failed
        reported = self._failed_pulls & finished_recving
        self._failed_pulls -= reported | finished_req_ids
        if reported:
            logger.warning("MooncakeConnectorV1: pull of %d hybrid request(s) failed; reported per request "
                           "(kv_load_failure_policy decides: recompute or fail)", len(reported))
        return reported

    def take_block_ids_with_load_errors(self) -> set[int]:
        """The unread blocks of failed pulls with one KV-cache group (vLLM recomputes from the first);
        none with several, whose failures go out per request (``take_failed_pulls``)."""
        block_ids = self.ledger.take_block_ids_with_load_errors()
        return set() if self.failures_per_request else block_ids

    def leak_report(self) -> dict[str, int]:
        held = self.holder.counts()
        return {
            "held_blocks": held["held_blocks"],
            "held_requests": held["held_requests"],
            "pending_pulls": self.puller.pending_pulls(),
            "active_reads": held["active_reads"],
        }

    def handle(self, message: msgspec.Struct) -> msgspec.Struct:
        """This rank's side channel: leak queries here, the pull protocol on the prefill holder."""
        if isinstance(message, P.LeakQuery):
            r = self.leak_report()
            return P.LeakReport(held_blocks=r["held_blocks"], held_requests=r["held_requests"],
                                pending_pulls=r["pending_pulls"], active_reads=r["active_reads"])
        return self.holder.handle(message)

    # ---- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.puller.close()
        if self.server is not None:
            self.server.close()
        if self.te is not None:
            self.te.close()
        # Release the engine here, on the closing thread: left to the reference cycles around this
        # worker, Mooncake's teardown (0.5-2.5 s measured) ran at some later garbage collection, on
        # whatever thread allocated then (another worker's pull). A call still in flight keeps it
        # alive through its own reference until it returns.
        self.te = self.holder.te = self.puller.te = None


def layer_groups(layer_names: list[str], groups: tuple[KVGroup, ...]) -> list[int]:
    """The KV-cache group of each registered layer; a layer no group names is refused (its block ids
    would be unknown)."""
    index = {name: position for position, group in enumerate(groups) for name in group.layer_names}
    missing = [name for name in layer_names if name not in index]
    if missing:
        raise ValueError(f"MooncakeConnectorV1: KV cache layers {missing} are in no KV-cache group")
    return [index[name] for name in layer_names]


def query_leaks(address: str, timeout_s: float = 2.0, auth: SideChannelAuth | None = None) -> dict[str, int]:
    """A rank's leak report; sealed with ``auth``, else with ``KV_SECRET`` when that is set."""
    reply = side_channel.request(address, P.LeakQuery(), P.REPLY_TYPES, timeout_s,
                                 auth=auth if auth is not None else auth_from_env(None))
    if not isinstance(reply, P.LeakReport):
        raise RuntimeError(f"unexpected reply {reply!r}")
    return msgspec.structs.asdict(reply)
