"""``MooncakeConnectorV1``: vLLM's entry point; delegates to the scheduler or worker side by role."""

from __future__ import annotations

import os
from typing import Any

from kv_common import vllm_compat
from kv_common.idle_step import idle_step
from kv_common.kv_byte_settings import KVByteSettings
from kv_common.logging_utils import get_logger
from kv_common.stats import PromCounter, PromHistogram, counter, failures_total, make_vllm_stats_class
from kv_common.stats import build_prom_metrics as _build_prom_metrics

from kv_mooncake.config import load_config, side_channel_base_port, start_up_contradictions
from kv_mooncake.group_blocks import plans_per_group
from kv_mooncake.identity import config_fingerprint, unsupported_settings
from kv_mooncake.pipeline_stages import stage_partition
from kv_mooncake.rank_layout import DecodeLayout, DecodeRank, PrefillLayout, PrefillRank
from kv_mooncake.scheduler import MooncakeScheduler
from kv_mooncake.step import MooncakeStep
from kv_mooncake.worker import MooncakeWorker, RankContext, check_kv_cache_groups

logger = get_logger(__name__)

_base = vllm_compat.base_module()
# vLLM keeps its hybrid KV-cache manager on only for connectors that are SupportsHMA.
_SupportsHMA: Any = getattr(_base, "SupportsHMA", object)


class MooncakeConnectorMetadata(_base.KVConnectorMetadata):  # type: ignore[name-defined]  # vLLM's, at run time
    def __init__(self, step: MooncakeStep):
        self.step = step


def _parallel(vllm_config: Any, settings: KVByteSettings) -> dict[str, int]:
    parallel = vllm_config.parallel_config
    return {
        "tp": settings.tp_size,
        "pcp": settings.pcp_size,
        "dcp": settings.dcp_size,
        "dp_rank": int(getattr(parallel, "data_parallel_rank", 0) or 0),
    }


def _num_hidden_layers(vllm_config: Any) -> int:
    """The model's decoder layers (vLLM's ``get_pp_indices`` splits these over the stages); 0 when
    the config cannot tell (partial configs in unit tests)."""
    try:
        return int(vllm_config.model_config.get_total_num_hidden_layers())
    except Exception:  # noqa: BLE001 - unknown: the decode counts its own layers instead
        return 0


def _own_partition(vllm_config: Any, pp_size: int) -> tuple[int, ...] | None:
    """The layers per stage this instance runs, by vLLM's rule (``VLLM_PP_LAYER_PARTITION`` else the
    even split); None with one stage or when the layer count is unknown."""
    layers = _num_hidden_layers(vllm_config)
    if pp_size == 1 or not layers:
        return None
    return stage_partition(layers, pp_size, os.environ.get("VLLM_PP_LAYER_PARTITION") or None)


class MooncakeConnectorV1(_base.KVConnectorBase_V1, _SupportsHMA):  # type: ignore[name-defined]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        groups = check_kv_cache_groups(kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.config = load_config(dict(ktc.kv_connector_extra_config or {}))
        if plans_per_group(groups) and self.config.verify_kv:
            raise ValueError("MooncakeConnectorV1: verify_kv=true with hybrid KV-cache groups "
                             f"({', '.join(g.kind for g in groups)}): set verify_kv=false (its digests "
                             "cover one group's layers)")
        self.engine_id = str(ktc.engine_id)
        fingerprint = config_fingerprint(vllm_config)
        par = _parallel(vllm_config, fingerprint)
        problems = unsupported_settings(fingerprint, is_consumer=bool(ktc.is_kv_consumer))
        if plans_per_group(groups) and fingerprint.dcp_size > 1:
            problems.append(f"decode_context_parallel_size={fingerprint.dcp_size} with hybrid KV-cache groups "
                            f"({', '.join(g.kind for g in groups)}): supported with 1")
        if problems:
            raise ValueError("MooncakeConnectorV1 cannot read this KV layout right: " + "; ".join(problems))
        is_producer, is_consumer = bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer)
        # vllm-ascend's declared prefill/decode sizes must describe what really runs here.
        pp_size = fingerprint.pipeline_parallel_size
        partition = _own_partition(vllm_config, pp_size)
        contradictions = start_up_contradictions(
            self.config, is_producer=is_producer, is_consumer=is_consumer, tp_size=par["tp"], pp_size=pp_size,
            layer_partition=partition,
        )
        if contradictions:
            raise ValueError(f"MooncakeConnectorV1: kv_connector_extra_config {'; '.join(contradictions)}")
        world = par["tp"] * par["pcp"] * pp_size  # DCP reuses the TP ranks; each stage has its own
        port = side_channel_base_port(self.config, int(ktc.kv_port), par["dp_rank"], world)
        self._scheduler: MooncakeScheduler | None = None
        self._worker: MooncakeWorker | None = None
        if role == _base.KVConnectorRole.SCHEDULER:
            self._scheduler = MooncakeScheduler(
                self.config, engine_id=self.engine_id, block_size=int(vllm_config.cache_config.block_size),
                is_producer=is_producer, is_consumer=is_consumer, side_channel_port=port,
                tp_size=par["tp"], pcp_size=par["pcp"], dcp_size=par["dcp"], groups=groups, pp_size=pp_size,
            )
        else:
            model = vllm_config.model_config
            ranks = vllm_compat.parallel_ranks()  # 0 where a group is not initialised
            tp_rank, pcp_rank, dcp_rank = ranks["tp_rank"], ranks["pcp_rank"], ranks["dcp_rank"]
            # PCP/DCP ranks come from vLLM's groups (all 0 on CPU: PCP/DCP need GPU attention
            # backends). The pull plan derives every peer's DCP rank as tp_rank % dcp: refuse a
            # platform whose DCP groups are laid out differently rather than pull wrong tokens.
            if dcp_rank != tp_rank % par["dcp"]:
                raise ValueError(
                    f"MooncakeConnectorV1: DCP rank {dcp_rank} on TP rank {tp_rank} (DCP {par['dcp']}); "
                    "the pull plan expects DCP groups of consecutive TP ranks (dcp_rank == tp_rank % dcp)"
                )
            use_mla = fingerprint.use_mla
            total_heads = 1 if use_mla else int(model.get_total_num_kv_heads())
            self._worker = MooncakeWorker(self.config, RankContext(
                engine_id=self.engine_id, is_producer=is_producer, is_consumer=is_consumer,
                side_channel_port=port,
                prefill_rank=PrefillRank(tp_rank, pcp_rank, ranks["pp_rank"]),
                decode_rank=DecodeRank(tp_rank),
                prefill_layout=PrefillLayout(tp_size=par["tp"], total_kv_heads=total_heads, pcp_size=par["pcp"],
                                             dcp_size=par["dcp"], use_mla=use_mla, pp_size=pp_size),
                layer_partition=partition, num_hidden_layers=_num_hidden_layers(vllm_config),
                decode_layout=DecodeLayout(tp_size=par["tp"], dcp_size=par["dcp"]),
                total_kv_heads=total_heads, use_mla=use_mla,
                kv_byte_settings=fingerprint, kv_shape=vllm_compat.kv_heads_on_rank(vllm_config, use_mla),
                kv_groups=groups,
            ))

    # ---- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        assert self._scheduler is not None
        step = self._scheduler.build_step()
        step.idle = idle_step(scheduler_output)
        return MooncakeConnectorMetadata(step)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """vLLM's hybrid manager (SupportsHMA): the request's block ids of every KV-cache group."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, tuple(block_ids))

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(getattr(connector_output, "finished_sending", None),
                                                    getattr(connector_output, "finished_recving", None))

    def has_pending_block_frees(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_block_frees()

    # ---- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        if isinstance(meta, MooncakeConnectorMetadata):
            self._worker.start_step(meta.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: a request runs only after its pull finished

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # the decode pulls; nothing to push

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM >= 0.32 asks this rather than ``get_finished``: a failed pull of a request of several
        KV-cache groups goes out in ``failed_recving`` (the MultiConnector unites its children's)."""
        results = super().get_transfer_results(finished_req_ids)
        assert self._worker is not None
        results.failed_recving = self._worker.take_failed_pulls(set(results.finished_recving), finished_req_ids)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_block_ids_with_load_errors() if self._worker else set()

    def get_kv_connector_stats(self) -> Any:
        # Workers count pulls; the scheduler counts prompt mismatches (vLLM aggregates both).
        acc = self._worker.stats if self._worker is not None else getattr(self._scheduler, "stats", None)
        if acc is None or acc.is_empty():
            return None
        from kv_mooncake.connector import MooncakeConnectorStats

        out = MooncakeConnectorStats.from_accumulator(acc)
        acc.reset()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> Any:
        from kv_mooncake.connector import MooncakeConnectorStats

        return MooncakeConnectorStats.build(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from kv_mooncake.connector import build_prom_metrics

        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def leak_report(self) -> dict[str, int]:
        return self._worker.leak_report() if self._worker else {"held_blocks": 0, "pending_pulls": 0}

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


class KvMooncakeConnectorV1(MooncakeConnectorV1):
    """This connector under our own name, which no other package registers (vllm-ascend registers
    ``MooncakeConnectorV1`` for its own class). A registered name is always its class's ``__name__``:
    vLLM's MultiConnector looks a child's class up in the registry by that name."""


# ---- Prometheus metrics ----
# vLLM-facing stats classes (import vLLM: only the connector module imports this).

MooncakeConnectorStats = make_vllm_stats_class("MooncakeConnectorStats")

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
_COUNTERS = [
    PromCounter("vllm:mooncake_pulled_bytes", "Bytes pulled from prefill instances.", lambda d: d.get("bytes", 0)),
    PromCounter("vllm:mooncake_pulls", "Successful KV pulls (one per request and decode rank).",
                lambda d: d.get("transfers", 0)),
    PromCounter("vllm:mooncake_pull_failures",
                "Failed or timed-out KV pulls (their blocks were reported as load errors).", failures_total),
    PromCounter("vllm:mooncake_expired_holds", "Prefill holds freed on expiry (no decode pulled in time).",
                counter("expired_holds")),
    PromCounter("vllm:mooncake_rejected_reads",
                "Pull requests refused because they named blocks not held for that request.",
                counter("rejected_reads")),
    PromCounter("vllm:mooncake_prompt_mismatches",
                "Decode requests whose kv_transfer_params were made for another prompt "
                "(nothing pulled, computed locally).", counter("prompt_mismatches")),
    PromCounter("vllm:mooncake_transfer_retries",
                "TransferEngine reads attempted again after a failed or stalled attempt.",
                counter("transfer_retries")),
]
_PULL_SECONDS = PromHistogram("vllm:mooncake_pull_seconds", "KV pull latency (seconds).", _LATENCY_BUCKETS,
                              lambda d: d.get("durations_s") or ())


def build_prom_metrics(vllm_config: Any, metric_types: dict, labelnames: list[str],
                       per_engine_labelvalues: dict[int, list[object]]) -> Any:
    """``KVConnectorBase_V1.build_prom_metrics``: counters and a pull-latency histogram, fed from the
    same ``KVConnectorStats`` data vLLM logs."""
    return _build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                               counters=_COUNTERS, histograms=[_PULL_SECONDS])
