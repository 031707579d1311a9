"""Scheduler-side logic of MooncakeConnectorV1 (runs in the EngineCore process, no torch).

Prefill (producer): a finished ``do_remote_decode`` request keeps its blocks (``request_finished``
returns True) and hands the decode the ``kv_transfer_params`` to pull them; the worker frees them
when the readers are done. Decode (consumer): a ``do_remote_prefill`` request is loaded
asynchronously; the worker pulls and reports it in ``finished_recving``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

from kv_common.kv_cache_groups import NULL_BLOCK_ID, KVGroup
from kv_common.logging_utils import get_logger
from kv_common.stats import TransferStatsBase

from kv_mooncake.config import MooncakeConfig, peer_layout_contradiction
from kv_mooncake.group_blocks import GroupBlocks, group_blocks_to_pull, plans_per_group
from kv_mooncake.identity import request_digest, same_prompt
from kv_mooncake.params import (
    MAX_PREFILL_RANKS,
    TransferParams,
    flag,
    parse_transfer_params,
    pull_problem,
    read_transfer_params,
)
from kv_mooncake.step import HoldRequest, MooncakeStep, PullRequest

logger = get_logger(__name__)

_FINISHED_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")




class _Incoming(NamedTuple):
    """A decode request's parsed params, from the first time vLLM asks about it until it finishes."""

    params: TransferParams
    local_computed: int  # prefix hit seen by the latest get_num_new_matched_tokens


class MooncakeScheduler:
    def __init__(
        self,
        config: MooncakeConfig,
        *,
        engine_id: str,
        block_size: int,
        is_producer: bool,
        is_consumer: bool,
        side_channel_port: int,
        tp_size: int = 1,
        pcp_size: int = 1,
        dcp_size: int = 1,
        groups: tuple[KVGroup, ...] = (),
        pp_size: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.side_channel_port = side_channel_port
        # What the decode is told to reach this prefill at: asked once (vLLM's helper may look up routes).
        self.advertised_host = config.advertised_host() if is_producer else ""
        self.tp_size, self.pcp_size, self.dcp_size, self.pp_size = tp_size, pcp_size, dcp_size, pp_size
        # vLLM's KV-cache groups (local_cache.check_kv_cache_groups); several with its hybrid manager.
        self.groups = groups
        if is_producer and tp_size * pcp_size * pp_size > MAX_PREFILL_RANKS:  # no decode would accept its answers
            raise ValueError(f"MooncakeConnectorV1: a prefill of tensor_parallel_size {tp_size} x "
                             f"prefill_context_parallel_size {pcp_size} x pipeline_parallel_size {pp_size} "
                             f"ranks; decodes accept at most "
                             f"{MAX_PREFILL_RANKS} (kv_mooncake.params.MAX_PREFILL_RANKS)")
        # decode: requests with do_remote_prefill, parsed once (vLLM asks again every step until one fits)
        self._incoming: dict[str, _Incoming] = {}
        self._step = MooncakeStep()
        self._clock = clock
        # prefill: requests whose blocks the workers still hold -> when the hold was handed over
        self._held: dict[str, float] = {}
        # decode: requests accepted for a remote load and not loaded yet -> [source, accepted, last beat]
        self._waiting: dict[str, list] = {}
        self.stats = TransferStatsBase()  # scheduler-side counters (prompt mismatches)

    # ---- decode side -------------------------------------------------------------------------
    def _remote_prefill(self, request: Any) -> TransferParams | None:
        """The params of a decode request still to be pulled (read and checked on first sight; vLLM
        asks again every step until the request fits); None for any other request, and for one whose
        params are refused (it is computed locally)."""
        if not self.is_consumer or not flag(request.kv_transfer_params, "do_remote_prefill"):
            return None
        entry = self._incoming.get(request.request_id)
        if entry is not None:
            return entry.params
        read = read_transfer_params(request.kv_transfer_params)
        assert read is not None  # the flag is set
        problem = read.problem or pull_problem(read.params, prompt_len=len(request.prompt_token_ids or ()),
                                               block_size=self.block_size, groups=self.groups)
        if problem:
            self._refuse_params(request, read.params, problem)
            return None
        self._incoming[request.request_id] = _Incoming(read.params, 0)
        return read.params

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = self._remote_prefill(request)
        if params is None:
            return 0, False
        contradiction = peer_layout_contradiction(self.config, remote_tp_size=params.tp_size,
                                                  remote_pp_size=params.pp_size)
        if contradiction:
            self._refuse_declared_layout(request, params, contradiction)
            return 0, False
        if not same_prompt(params.prompt_digest, request_digest(request)):
            self._refuse_other_prompt(request, params)
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        self._incoming[request.request_id] = _Incoming(params, num_computed_tokens)
        source = params.source()
        if count > 0 and request.request_id not in self._waiting and source is not None:
            now = self._clock()  # from now on the prefill's hold is kept alive (see build_step)
            self._waiting[request.request_id] = [source, now, now]
        return (count, True) if count > 0 else (0, False)

    def _decide(self, request: Any) -> None:
        """One transfer per request: vLLM's dict is the request's state and may be asked about again."""
        request.kv_transfer_params["do_remote_prefill"] = False
        self._incoming.pop(request.request_id, None)

    def _compute_locally(self, request: Any, params: TransferParams) -> None:
        """Nothing will be pulled for this request: vLLM computes it; the prefill may free."""
        self._decide(request)
        source = params.source()
        if source is not None:
            self._step.frees.append(source)

    def _refuse_params(self, request: Any, params: TransferParams, problem: str) -> None:
        """kv_transfer_params a client got wrong (or forged): computed locally, never an error. A
        prefill the valid keys still name is told to free."""
        logger.warning("MooncakeConnectorV1: request %s: invalid kv_transfer_params (%s); computing it "
                       "locally instead of pulling", request.request_id, problem)
        self._compute_locally(request, params)

    def _refuse_declared_layout(self, request: Any, params: TransferParams, contradiction: str) -> None:
        """The prefill's layout is not the one the config declares: a misconfigured pair. Pull
        nothing (compute locally) and let the prefill free, as for another prompt."""
        logger.warning("MooncakeConnectorV1: request %s: kv_connector_extra_config %s; computing it "
                       "locally instead of pulling", request.request_id, contradiction)
        self._compute_locally(request, params)

    def _refuse_other_prompt(self, request: Any, params: TransferParams) -> None:
        """The prefill computed another prompt (or sent no digest): pull nothing, compute locally
        (a cache miss, so every kv_load_failure_policy recomputes), and let the prefill free."""
        self.stats.incr("prompt_mismatches")
        logger.warning(
            "MooncakeConnectorV1: request %s: kv_transfer_params were made for another prompt "
            "(prompt digest %s, this prompt %s); computing it locally instead of pulling",
            request.request_id, params.prompt_digest or "missing", request_digest(request) or "none (embeddings)",
        )
        self._compute_locally(request, params)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = self._remote_prefill(request)
        if params is None:
            return
        local_computed = self._incoming[request.request_id].local_computed
        self._decide(request)
        source = params.source()
        if source is None:
            return
        if num_external_tokens <= 0:
            self._waiting.pop(request.request_id, None)
            self._step.frees.append(source)  # full local hit: nothing to pull, the prefill may free
            return
        num_tokens = local_computed + num_external_tokens
        by_group = plans_per_group(self.groups)
        to_pull = group_blocks_to_pull(self.groups, num_tokens=num_tokens, num_computed_tokens=local_computed) \
            if by_group else [GroupBlocks(local_computed // self.block_size, -(-num_tokens // self.block_size))]
        self._step.pulls.append(
            PullRequest(
                request_id=request.request_id,
                source=source,
                local_block_ids=[list(g) for g in blocks.get_block_ids()],
                blocks_by_group=to_pull,
                prompt_digest=params.prompt_digest or "",  # equal to this request's: checked above
                check_null_blocks=by_group,
            )
        )

    # ---- both --------------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        entry = self._incoming.pop(request.request_id, None)
        self._waiting.pop(request.request_id, None)
        raw = request.kv_transfer_params
        if flag(raw, "do_remote_prefill"):
            # Finished (aborted) before its blocks were allocated: the prefill still holds them.
            params = entry.params if entry is not None else parse_transfer_params(raw)  # valid keys only
            assert params is not None  # the flag is set
            self._compute_locally(request, params)
            return False, None
        if not flag(raw, "do_remote_decode") or not self.is_producer:
            return False, None
        params = parse_transfer_params(raw)  # the prefill's one parse of a request's params
        assert params is not None  # the flag is set
        status = getattr(request.status, "name", str(request.status))
        groups = [list(g) for g in block_ids] if block_ids and isinstance(block_ids[0], (list, tuple)) else [list(block_ids or [])]
        if status not in _FINISHED_OK or not any(groups):
            return False, None  # aborted prefill: vLLM frees its blocks now, nothing to hand over
        self._held[request.request_id] = self._clock()
        digest = request_digest(request)
        # Every group's blocks are held (vLLM keeps them all until finished_sending); not the null
        # block standing in for a sliding window's dropped ones.
        held = groups[0] if not plans_per_group(self.groups) else sorted({b for g in groups for b in g if b != NULL_BLOCK_ID})
        self._step.holds.append(HoldRequest(request_id=request.request_id, num_blocks=len(held),
                                            block_ids=list(held), ttl_s=self._hold_ttl(params.hold_timeout_s),
                                            prompt_digest=digest or ""))
        return True, TransferParams(
            do_remote_prefill=True,
            engine_id=self.engine_id,
            host=self.advertised_host,
            port=self.side_channel_port,
            block_ids=list(groups[0]) if not plans_per_group(self.groups) else list(groups),
            request_id=request.request_id,
            tp_size=self.tp_size,
            pcp_size=self.pcp_size,
            dcp_size=self.dcp_size,
            pp_size=self.pp_size,
            prompt_digest=digest,
        ).to_dict()

    def _hold_ttl(self, requested: float | None) -> float | None:
        """A client may shorten (never extend) the hold with ``kv_transfer_params["hold_timeout_s"]``
        (one that is not a number never gets here: ``parse_transfer_params`` drops it)."""
        if requested is None:
            return None
        if not requested > 0:  # also NaN
            logger.warning("MooncakeConnectorV1: ignoring hold_timeout_s=%r (must be > 0)", requested)
            return None
        return min(requested, self.config.hold_timeout_s)

    def build_step(self) -> MooncakeStep:
        self._keep_waiting_holds_alive()
        step, self._step = self._step, MooncakeStep()
        return step

    def _keep_waiting_holds_alive(self) -> None:
        """A request accepted for a remote load may wait here (no free blocks, or queued for a pull
        thread) before any pull takes a lease: tell its prefill to keep the hold, every third of a
        lease, for at most ``keepalive_max_s`` (then the prefill's own hold time decides)."""
        now = self._clock()
        interval = self.config.lease_s / 3
        for request_id, entry in list(self._waiting.items()):
            source, accepted, last = entry
            if now - accepted > self.config.keepalive_max_s:
                del self._waiting[request_id]
            elif now - last >= interval:
                entry[2] = now
                self._step.keepalives.append(source)

    def update_connector_output(self, finished_sending: set[str] | None,
                                finished_recving: set[str] | None = None) -> None:
        for request_id in finished_sending or ():
            self._held.pop(request_id, None)
        for request_id in finished_recving or ():
            self._waiting.pop(request_id, None)

    def has_pending_block_frees(self) -> bool:
        """vLLM does not preempt while this is True: it waits for the frees instead. Only a young
        hold will be freed soon (a healthy decode pulls within ``pending_free_window_s``); an old one
        waits for a slow or dead decode, and waiting on it would stall this prefill's scheduling for
        the whole hold time."""
        now = self._clock()
        return any(now - since < self.config.pending_free_window_s for since in self._held.values())
