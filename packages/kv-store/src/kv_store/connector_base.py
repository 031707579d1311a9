"""``StoreConnectorBase``: the vLLM KV connector over any ``Backend``.

A concrete connector names itself, its config type and how to build its backend::

    class AscendStoreConnector(StoreConnectorBase):
        connector_name = "AscendStoreConnector"
        config_type = StoreConfig
        def make_backend(self, config, role): return make_backend_from(config)

Hybrid models (``SupportsHMA``): every KV-cache group vLLM hands over is stored, each group's
blocks as values of their own (``group_blocks``, ``group_worker``); the group layouts are in the
namespace digest and the manifest. State-space groups (Mamba and kin: one state per request, not
per token block) are refused at start-up.

Failure policy: a block missing or corrupt after a positive lookup is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes it (with several KV-cache groups: the whole
request of an async load, through ``failed_recving``; vLLM takes no block ids then). vLLM's own default
``kv_load_failure_policy`` is "fail"; with ``load_failure_policy="recompute"`` (our default) the
connector switches the scheduler to "recompute" so that a best-effort cache never fails a request.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
from kv_common.backend import Backend
from kv_common.config import parse_extra_config
from kv_common.failure_ledger import FailureLedger
from kv_common.idle_step import IdleStepWait, idle_step
from kv_common.kv_cache_groups import KVGroup, UnsupportedKVGroup, kv_groups, refuse_state_groups
from kv_common.logging_utils import get_logger
from kv_common.vllm_compat import (
    base_module,
    forward_context_kv_caches,
    kv_byte_settings,
    kv_heads_on_rank,
    parallel_ranks,
)

from kv_store import codec, group_blocks
from kv_store import keys as keys_mod
from kv_store import manifest as manifest_mod
from kv_store.config import StoreConnectorConfig
from kv_store.failure_policy import apply_recompute_policy
from kv_store.group_worker import GroupedStoreWorker
from kv_store.scheduler import StoreScheduler, hash_block_size
from kv_store.stats import StoreStats, vllm_stats_class
from kv_store.vllm_metadata import StoreConnectorMetadata, StoreWorkerMetadata
from kv_store.worker import StoreWorker

logger = get_logger(__name__)
_base = base_module()


def pp_stage(parallel: Any) -> tuple[int, int]:
    """(stage, number of stages) of this worker, by vLLM's own rule for which layers a worker holds
    (``ModelConfig.get_layers_start_end_indices``: ranks are laid out DP x PP x TP)."""
    pp_size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    rank = int(getattr(parallel, "rank", 0) or 0)
    return (rank // tp_size) % pp_size, pp_size


def store_fingerprint(vllm_config: Any) -> dict[str, Any]:
    """Everything that decides whether two instances can exchange a stored block: any setting that
    changes the bytes of a block under the same key. The same on the scheduler and on every worker
    (the PP stage is in the rank tag, not here)."""
    settings = kv_byte_settings(vllm_config)
    model = vllm_config.model_config
    # The keys and spellings of the first namespaces: a value spelled otherwise would orphan every
    # stored block ("dtype" is the model dtype as str(torch.dtype) prints it).
    fp: dict[str, Any] = {
        "model": settings.model,
        "dtype": f"torch.{settings.model_dtype}",
        "block_size": settings.block_size,
        "cache_dtype": settings.cache_dtype,
        "tp_size": settings.tp_size,
        "pcp_size": settings.pcp_size,
        "dcp_size": settings.dcp_size,
        "use_mla": settings.use_mla,
        "hash_algo": str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "")),
        "revision": settings.revision,
        "quantization": settings.quantization,
        # New weights at the same path: a new namespace (the old model's keys are never read) and,
        # through the manifest settings, a new layout tag (its values never verify).
        "model_weights": settings.model_weights,
    }
    # Layer set: the whole model's layers and how vLLM splits them over the PP stages (an uneven
    # VLLM_PP_LAYER_PARTITION gives a stage other layers under the same stage tag).
    # With DCP > 1 the interleave size decides which rank holds which tokens of a block (the same
    # rank tag and hash hold other tokens' KV). Only then: DCP 1 namespaces stay as they were.
    if settings.dcp_size > 1:
        fp["cp_kv_cache_interleave_size"] = settings.cp_kv_cache_interleave_size
    fp["pp_size"] = settings.pipeline_parallel_size
    fp["pp_layer_partition"] = os.environ.get("VLLM_PP_LAYER_PARTITION", "") if fp["pp_size"] > 1 else ""
    for name, getter in (
        ("total_kv_heads", lambda: model.get_total_num_kv_heads()),
        ("head_size", lambda: model.get_head_size()),
        ("num_layers", lambda: model.get_total_num_hidden_layers()),
    ):
        try:
            fp[name] = int(getter())
        except Exception:  # noqa: BLE001 - partial configs in unit tests
            fp[name] = 0
    return fp


def value_seal(config: StoreConnectorConfig, environ: Any = None) -> str:
    """How values are sealed, as far as readers must agree: a MAC deployment refuses plain values
    and a plain one refuses MAC-sealed values (``codec``), so two such instances sharing one
    namespace would load, fail and remove each other's blocks forever. Keyed: instances with
    different secrets must not share either; the name is a MAC of a constant, not the key."""
    key = codec.mac_key_from_env(config.mac_key_env, environ)
    if key is None:
        return "plain"
    import hashlib

    return "mac:" + hashlib.blake2b(b"kv-common store namespace", digest_size=8, key=key).hexdigest()


def manifest_settings(fingerprint: dict[str, Any], *, rank_tag: str, value_size: int, layout: dict[str, str],
                      environ: Any = None) -> dict[str, Any]:
    """Every byte-changing setting of this worker, by name, for the namespace manifest. The model is
    named by its last path component (one model served from different mount points agrees) and
    its revision; the full path is in the derived namespace only."""
    settings = {k: v for k, v in fingerprint.items() if k != "model"}
    settings["model_name"] = str(fingerprint.get("model", "")).rstrip("/").rsplit("/", 1)[-1]
    settings.update(layout)
    settings["rank_tag"] = rank_tag
    settings["value_size"] = value_size
    settings["value_trailer"] = f"{codec.TRAILER_SIZE} bytes"
    settings["store_format"] = manifest_mod.FORMAT_VERSION
    # Values sealed with the layout tag (codec): an engine of the untagged format shares nothing.
    settings["value_format"] = codec.VALUE_FORMAT
    import socket

    settings["writer"] = f"{socket.gethostname()} pid {os.getpid()}"
    return settings


_NON_CRYPTO_HASHES = ("xxhash", "xxhash_cbor")


def hash_seed_warning(hash_algo: str, environ: Any = None) -> str | None:
    """Why stored blocks cannot be shared between instances, or None.

    vLLM 0.32 (``vllm.v1.core.kv_cache_utils.resolve_none_hash_seed``) seeds the block-hash chain
    with PYTHONHASHSEED when set; otherwise with a fixed seed for sha256 / sha256_cbor but with a
    fresh random seed per process for xxhash / xxhash_cbor. With the latter, every instance
    computes different block hashes for the same prefix, so no other instance (and no restart of
    this one) ever hits what it stores.
    """
    env = os.environ if environ is None else environ
    if hash_algo in _NON_CRYPTO_HASHES and env.get("PYTHONHASHSEED") is None:
        return (
            f"prefix_caching_hash_algo={hash_algo!r} without PYTHONHASHSEED: vLLM seeds the block-hash "
            "chain randomly per process, so blocks this instance stores can never be found by another "
            "instance (or after a restart). Set PYTHONHASHSEED to the same value on every instance, or "
            "use prefix_caching_hash_algo='sha256' (vLLM's default)."
        )
    return None


def _kv_heads(vllm_config: Any, use_mla: bool) -> dict[str, Any]:
    """KV heads on this rank and head size, for the worker to find the block dimension of the KV
    tensors; {} when the model config cannot tell (the worker then reads the strides)."""
    shape = kv_heads_on_rank(vllm_config, use_mla)
    return {} if shape is None else {"kv_heads": shape[0], "head_size": shape[1], "use_mla": use_mla}


def hybrid_groups(kv_cache_config: Any, connector_name: str, *, block_size: int, dcp_size: int) -> tuple[KVGroup, ...]:
    """vLLM's KV-cache groups when there are several (the hybrid manager is on), else (): one value
    per block holds every layer, as before. Refused at start-up (``UnsupportedKVGroup``): state
    groups, and groups whose block size is not the scheduler's (their block i would hold other
    tokens than block hash i), or several groups under decode context parallelism."""
    groups = kv_groups(kv_cache_config)
    refuse_state_groups(groups, connector_name)
    if len(groups) <= 1:
        return ()
    for g in groups:
        if g.block_size != block_size:
            raise UnsupportedKVGroup(
                f"{connector_name}: KV-cache group {g.index} ({g.kind}) has block_size {g.block_size}, the "
                f"cache's block_size is {block_size}: a store block must hold the same tokens in every group")
    if dcp_size > 1:
        raise UnsupportedKVGroup(
            f"{connector_name}: {len(groups)} KV-cache groups with decode_context_parallel_size {dcp_size}: "
            "supported with decode_context_parallel_size 1 only")
    return groups


class StoreConnectorBase(_base.KVConnectorBase_V1, _base.SupportsHMA):  # type: ignore[name-defined]  # vLLM's
    connector_name: str = "StoreConnector"
    config_type: type[StoreConnectorConfig] = StoreConnectorConfig

    def make_backend(self, config: StoreConnectorConfig, role: Any) -> Backend:
        raise NotImplementedError(f"{type(self).__name__} must implement make_backend(config, role)")

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self.store_config = parse_extra_config(
            self.connector_name, self.config_type, ktc.kv_connector_extra_config
        )
        cfg = self.store_config
        load = cfg.load if cfg.load is not None else bool(ktc.is_kv_consumer)
        save = cfg.save if cfg.save is not None else bool(ktc.is_kv_producer)
        fp = store_fingerprint(vllm_config)
        fp["value_seal"] = value_seal(cfg)
        self.groups = hybrid_groups(kv_cache_config, self.connector_name, block_size=int(fp["block_size"]),
                                    dcp_size=int(fp["dcp_size"]))
        if self.groups:
            # Instances with other group layouts never share a value (single group: as before).
            fp["kv_groups"] = [g.describe() for g in self.groups]
            if cfg.load_mode == "sync":
                # vLLM takes load errors of several groups only per request, and only from an async
                # load (failed_recving): a sync load could not report a bad block.
                logger.info("%s: %d KV-cache groups: load_mode 'async' (was 'sync'), so that a failed "
                            "load is recomputed", self.connector_name, len(self.groups))
                cfg = self.store_config = msgspec.structs.replace(cfg, load_mode="async")
        # Values of another format (codec) are in another namespace: after an upgrade the old
        # blocks are misses, not a manifest that refuses the engine.
        fp["value_format"] = codec.VALUE_FORMAT
        self.fingerprint = fp
        # A pinned namespace bypasses the digest: the manifest check (register_kv_caches) is then
        # the only thing between this engine and KV of another layout.
        self.namespace = cfg.namespace or keys_mod.namespace(fp)
        self._num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        self.manifest_outcome = ""
        self.block_size = int(fp["block_size"]) or 16
        self.stats = StoreStats()
        self.ledger = FailureLedger()
        self._failed_loads: set[str] = set()  # several groups: async loads that failed, until reported
        # An idle vLLM step (no token scheduled, saves or async loads in flight) waits for news of
        # any group's worker instead of spinning (kv_common.idle_step).
        self._idle_wait = IdleStepWait(cfg.idle_step_wait_ms)
        self.backend = self.make_backend(cfg, role)
        self._scheduler: StoreScheduler | None = None
        self._worker: StoreWorker | GroupedStoreWorker | None = None
        if role == _base.KVConnectorRole.SCHEDULER:
            warning = hash_seed_warning(str(fp.get("hash_algo", "")))
            if warning:
                logger.warning("%s: %s", self.connector_name, warning)
            if cfg.load_failure_policy == "recompute":
                self._apply_recompute_policy(ktc)
            tags = keys_mod.all_rank_tags(
                tp_size=fp["tp_size"], pcp_size=fp["pcp_size"], dcp_size=fp["dcp_size"],
                use_mla=fp["use_mla"], total_kv_heads=fp["total_kv_heads"], pp_size=fp["pp_size"],
            )
            self._scheduler = StoreScheduler(
                backend=self.backend, namespace=self.namespace, rank_tags=tags,
                block_size=hash_block_size(self.block_size, fp["dcp_size"], kv_cache_config),
                config=cfg, load_enabled=load, save_enabled=save, stats=self.stats, groups=self.groups,
            )
        else:
            ranks = parallel_ranks()
            pp_rank, pp_size = pp_stage(vllm_config.parallel_config)
            tag = keys_mod.rank_tag(
                tp_rank=ranks["tp_rank"], tp_size=fp["tp_size"], pcp_rank=ranks["pcp_rank"],
                pcp_size=fp["pcp_size"], dcp_rank=ranks["dcp_rank"], dcp_size=fp["dcp_size"],
                use_mla=fp["use_mla"], total_kv_heads=fp["total_kv_heads"], pp_rank=pp_rank, pp_size=pp_size,
            )
            writes = keys_mod.writes_tag(
                tp_rank=ranks["tp_rank"], tp_size=fp["tp_size"], pcp_rank=ranks["pcp_rank"],
                pcp_size=fp["pcp_size"], dcp_size=fp["dcp_size"], use_mla=fp["use_mla"],
                total_kv_heads=fp["total_kv_heads"], pp_rank=pp_rank, pp_size=pp_size,
            )
            groups: dict[str, int] = {}
            for g, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
                for name in group.layer_names:
                    groups[name] = g

            def worker(tag: str, layer_groups: dict[str, int]) -> StoreWorker:
                return StoreWorker(
                    backend=self.backend, namespace=self.namespace, rank_tag=tag, config=cfg,
                    layer_groups=layer_groups, stats=self.stats, ledger=self.ledger, writes_blocks=writes,
                    idle_wait=self._idle_wait, **_kv_heads(vllm_config, bool(fp["use_mla"])),
                )

            if self.groups:
                self._worker = GroupedStoreWorker(self.groups, {
                    g.index: worker(group_blocks.group_tag(tag, g, len(self.groups)), dict.fromkeys(g.layer_names, 0))
                    for g in self.groups})
            else:
                self._worker = worker(tag, groups)
            self._layer_groups = groups

    def _apply_recompute_policy(self, ktc: Any) -> None:
        """A store miss or corrupt block must cost a recompute, never the request: set vLLM's
        kv_load_failure_policy on the config the scheduler reads (the outer one under
        MultiConnector, see ``failure_policy``)."""
        changed = apply_recompute_policy(ktc, type(self).__name__)
        outer = [c for c in changed if c is not ktc]
        if outer:
            logger.warning(
                "%s: set kv_load_failure_policy='recompute' on the enclosing MultiConnector's kv_transfer_config "
                "(was 'fail'): a store block that fails to load is recomputed instead of failing the request. "
                "This applies to every child connector's load failures (a failed P2P pull is recomputed too); "
                "set load_failure_policy='vllm' in this connector's extra config to keep vLLM's setting.",
                self.connector_name,
            )
        elif changed:
            logger.info("%s: setting kv_load_failure_policy='recompute' (a store miss recomputes)", self.connector_name)

    # ---- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)
        self.check_manifest(kv_caches)

    def check_manifest(self, kv_caches: dict[str, Any]) -> str:
        """Store this worker's layout manifest in the namespace unless one is there, and compare.
        Raises ``ManifestMismatch`` (the engine refuses to start) naming each differing setting;
        a store that cannot answer within ``manifest_timeout_s`` skips the check (logged)."""
        assert self._worker is not None
        if isinstance(self._worker, GroupedStoreWorker):
            # one manifest per group tag: its own layers and value size (every group's layout is in
            # the fingerprint's kv_groups)
            split = self._worker.split_kv_caches(kv_caches)
            outcomes = [self._check_one_manifest(self._worker.workers[g.index], split[g.index],
                                                 dict.fromkeys(g.layer_names, 0), {"kv_group": str(g.index)})
                        for g in self.groups]
            self.manifest_outcome = ", ".join(dict.fromkeys(outcomes))
        else:
            self.manifest_outcome = self._check_one_manifest(self._worker, kv_caches, self._layer_groups, {})
        return self.manifest_outcome

    def _check_one_manifest(self, worker: StoreWorker, kv_caches: dict[str, Any], layer_groups: dict[str, int],
                            extra: dict[str, str]) -> str:
        layout = manifest_mod.layout_settings(kv_caches, layer_groups, block_size=self.block_size,
                                              num_blocks=self._num_blocks or None)
        settings = manifest_settings(self.fingerprint, rank_tag=worker.rank_tag, value_size=worker.value_size,
                                     layout={**layout, **extra})
        where = (f"{self.connector_name}: store namespace {self.namespace!r} "
                 f"({'pinned' if self.store_config.namespace else 'derived'}), rank tag {worker.rank_tag!r},")
        mine = manifest_mod.make_manifest(settings)
        worker.layout_tag = manifest_mod.layout_tag(mine)  # before any value is sealed or checked
        outcome = manifest_mod.check_with_deadline(
            self.backend, keys_mod.manifest_key(self.namespace, worker.rank_tag), mine, worker.value_size, where=where,
            timeout_s=self.store_config.manifest_timeout_s,
        )
        logger.info("%s namespace manifest %s", where, outcome)
        return outcome

    def _plan(self):
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, StoreConnectorMetadata) else None

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        plan = self._plan()
        self._idle_wait.begin_step(plan is not None and plan.idle)
        # Async loads start as soon as the step's plan arrives: vLLM calls start_load_kv only after
        # the forward when no load of the step is synchronous.
        if self._worker is not None and self.store_config.load_mode == "async" and self._worker.value_size:
            plan = self._plan()
            if plan is not None and plan.loads:
                self._worker.start_async(plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        plan = self._plan()
        if plan is None or not plan.loads:
            return
        if self._worker.value_size == 0:  # register_kv_caches not called (V2 runner path)
            self.register_kv_caches(forward_context_kv_caches(forward_context))  # + manifest check
        if self.store_config.load_mode == "async":
            self._worker.start_async(plan)  # no-op for the loads bind_connector_metadata started
            return
        self._worker.load_sync(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole blocks: in place before the forward (sync) or outside it (async)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are saved after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        plan = self._plan()
        if plan is not None and plan.saves:
            self._worker.submit_saves(plan)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, StoreConnectorMetadata):
            self._worker.wait_for_request_saves(kv_connector_metadata.plan.preempted)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        self._idle_wait.before_report(self._worker.in_flight)
        done = self._worker.get_finished(finished_req_ids)
        loaded = self._worker.take_finished_loads(finished_req_ids)  # async loads, once each
        return (done or None), (loaded or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        if self.groups and self._worker is not None:
            # several groups: a failed async load is the whole request's (see the module doc)
            self._failed_loads |= self.ledger.take_failed_requests()
            failed = self._failed_loads & results.finished_recving
            self._failed_loads -= failed | finished_req_ids
            if failed:
                logger.warning("%s: store load of %d request(s) failed; vLLM recomputes them", self.connector_name,
                               len(failed))
            results.failed_recving = failed
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = self.ledger.take_block_ids_with_load_errors()
        if self.groups:
            return set()  # reported per request (get_transfer_results): vLLM refuses block ids of several groups
        if failed:
            logger.warning("%s: %d block(s) failed to load; vLLM recomputes them", self.connector_name, len(failed))
        return failed

    def build_connector_worker_meta(self) -> Any:
        if self._worker is None:
            return None
        report = self._worker.take_report()
        return StoreWorkerMetadata(report) if report is not None else None

    # ---- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        assert self._scheduler is not None
        plan = self._scheduler.build_plan(scheduler_output)
        plan.idle = idle_step(scheduler_output)
        return StoreConnectorMetadata(plan)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's SupportsHMA hook (every group's block ids): the same as ``request_finished``."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_block_frees()

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is None:
            return
        self._scheduler.on_finished_sending(connector_output.finished_sending or ())
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, StoreWorkerMetadata):
            self._scheduler.on_worker_report(meta.report)

    def take_events(self) -> Any:
        return self._scheduler.take_events() if self._scheduler is not None else ()

    # ---- both sides --------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> Any:
        if self.stats.is_empty():
            return None
        snapshot = StoreStats.from_dict(self.stats.to_dict())
        self.stats.reset()
        return vllm_stats_class().from_accumulator(snapshot)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return vllm_stats_class().build(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from kv_store.stats import build_prom_metrics

        return build_prom_metrics(cls.__name__, vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def leak_report(self) -> dict[str, int]:
        side = self._scheduler if self._scheduler is not None else self._worker
        assert side is not None
        return side.leak_report()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close(self.store_config.shutdown_timeout_s)
        if self._scheduler is not None:
            self._scheduler.close()
        try:
            self.backend.close()
        except Exception:  # noqa: BLE001
            logger.exception("%s: backend close failed", self.connector_name)
