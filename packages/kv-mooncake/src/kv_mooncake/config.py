"""``kv_connector_extra_config`` of MooncakeConnectorV1, typed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

from kv_common import vllm_compat
from kv_common.config import ConfigKeyError, ConnectorConfig, parse_extra_config
from kv_common.idle_step import DEFAULT_IDLE_STEP_WAIT_MS, check_idle_step_wait_ms

from kv_mooncake.pipeline_stages import parse_partition
from kv_mooncake.wire.connection import rank_port

CONNECTOR_NAME = "MooncakeConnectorV1"


class ParallelSizes(ConnectorConfig, frozen=True):  # frozen like its base (said for mypy)
    """vllm-ascend's ``prefill`` / ``decode`` keys: the parallel layout of that side.

    tp_size and pp_size are checked: at start-up against this instance's own layout (prefill
    sizes on a producer, decode sizes on a consumer), and on the decode against the sizes each
    prefill reports in its kv_transfer_params. A contradiction is refused naming both values.
    ``prefill.pp_layer_partition`` (the prefill's ``VLLM_PP_LAYER_PARTITION``, e.g. ``"32,29"``) tells
    a decode which layers each prefill stage holds (``kv_mooncake.pipeline_stages``); a prefill
    checks it against the partition it runs.
    """

    dp_size: int | None = None
    tp_size: int | None = None
    pp_size: int | None = None
    pp_layer_partition: str | None = None

    no_effect_keys: ClassVar[dict[str, str]] = {
        "dp_size": "each prefill DP rank is found through the kv_transfer_params of its requests",
    }

    def check(self) -> None:
        if self.pp_layer_partition is None:
            return
        from kv_mooncake.errors import StageError
        from kv_mooncake.pipeline_stages import parse_partition

        try:
            stages = len(parse_partition(self.pp_layer_partition))
        except StageError as exc:
            raise ConfigKeyError("pp_layer_partition", str(exc)) from None
        if self.pp_size is not None and stages != self.pp_size:
            raise ConfigKeyError("pp_layer_partition", f"{self.pp_layer_partition!r} has {stages} stages, "
                                 f"pp_size is {self.pp_size}")


class MooncakeConfig(ConnectorConfig, frozen=True):
    # The address peers are told (kv_transfer_params' remote_host). None: this machine's address as
    # vLLM finds it (VLLM_HOST_IP first), as vllm-ascend does; 127.0.0.1 reaches no other machine.
    side_channel_host: str | None = None
    # The address the side channel listens on. None: the advertised address itself, not every
    # interface ("0.0.0.0" opens the port to every network this machine is on).
    side_channel_bind_host: str | None = None
    # Base port of this instance's side channel (each worker rank listens on base + rank index).
    # None: vLLM's ``kv_port``. Instances that share a host need distinct bases.
    side_channel_port: int | None = None
    # Host the TransferEngine advertises to peers (it listens on every interface, Mooncake's choice).
    # None: the side channel's advertised address.
    te_host: str | None = None
    protocol: Literal["tcp", "rdma", "ascend", "nvlink"] = "tcp"
    device_name: str = ""
    pull_timeout_s: float = 30.0  # decode: a pull that is not done by then fails (load error)
    hold_timeout_s: float = 120.0  # prefill: blocks nobody pulled are freed after this
    lease_s: float = 10.0  # prefill: an in-flight pull keeps blocks this long past the hold, renewed
    handshake_timeout_s: float = 5.0
    # prefill: vLLM waits for held blocks instead of preempting a running request only while some
    # hold is younger than this (a healthy decode pulls by then); older holds wait for a slow or dead
    # decode and must not stall this prefill's scheduling.
    pending_free_window_s: float = 5.0
    # decode: a request accepted for a remote load keeps its prefill hold alive (a heartbeat every
    # lease_s / 3) while it waits for blocks or a pull thread, for at most this long; the prefill
    # caps a hold's keep-alive extension at the same value.
    keepalive_max_s: float = 600.0
    # One TransferEngine read attempt (Mooncake's MC_TRANSFER_TIMEOUT and TCP progress / status
    # timeouts, unless set in the environment): a stalled attempt fails after this and is retried
    # until pull_timeout_s.
    transfer_attempt_timeout_s: float = 10.0
    max_inflight_transfers: int = 512  # per peer; the TCP transport rejects more than 1024
    num_pull_threads: int = 4
    # A vLLM step that schedules no token (only transfers in flight: held blocks, pulls) waits up to
    # this long for one to end instead of spinning (kv_common.idle_step); 0: no wait. A request
    # arriving meanwhile starts up to this much later.
    idle_step_wait_ms: float = DEFAULT_IDLE_STEP_WAIT_MS
    max_message_bytes: int = 1 << 20
    # The environment variable holding the side channel's shared secret (never the secret itself:
    # configs get logged). None: KV_SECRET when set, else no secret (any peer is answered). Named
    # here, the variable must be set. See kv_mooncake.wire.seal and the README's "Safety".
    side_channel_secret_env: str | None = None
    # Decode ranks also listen on their side-channel port (base + rank index) and answer LeakQuery
    # (tests, operators). Off by default: a decode needs no open port otherwise.
    decode_side_channel: bool = False
    # TEST-ONLY fault injection: a decode pull sleeps this long after its lease is taken and after
    # every TE chunk (bounded by the pull deadline), so tests can kill the prefill mid-pull.
    # Never set it in production.
    debug_pull_chunk_delay_s: float = 0.0
    # Opt-in integrity check (needs xxhash: kv-mooncake[verify]): the prefill digests each block per
    # KV head when the request finishes, the decode checks what it read; a mismatch is a load error.
    verify_kv: bool = False
    # vllm-ascend's keys (values as its docs write them, strings included).
    prefill: ParallelSizes | None = None
    decode: ParallelSizes | None = None
    use_ascend_direct: bool | None = None
    ascend_local_comm_res_path: str | None = None

    no_effect_keys: ClassVar[dict[str, str]] = {
        "use_ascend_direct": "the TransferEngine transport is chosen by 'protocol' (tcp, rdma, ascend)",
        "ascend_local_comm_res_path": "an Ascend HCCL resource file; no NPU transport here",
    }

    def advertised_host(self) -> str:
        """The side-channel host peers are told (README "Addresses and ports")."""
        return self.side_channel_host or vllm_compat.host_ip()

    def bind_host(self) -> str:
        """The host the side channel listens on."""
        return self.side_channel_bind_host or self.advertised_host()

    def transfer_engine_host(self) -> str:
        """The host the TransferEngine advertises (in the handshake's ``te_address``)."""
        return self.te_host or self.advertised_host()

    def preflight(self, kv_transfer_config: Mapping[str, Any]) -> Any:
        return _preflight(self, kv_transfer_config)

    def __post_init__(self) -> None:
        if not 1 <= self.max_inflight_transfers <= 1024:
            raise ValueError("max_inflight_transfers must be in 1..1024 (Mooncake's per-peer TCP queue)")
        for name in ("pull_timeout_s", "hold_timeout_s", "lease_s", "handshake_timeout_s",
                     "transfer_attempt_timeout_s", "pending_free_window_s", "keepalive_max_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.debug_pull_chunk_delay_s < 0:
            raise ValueError("debug_pull_chunk_delay_s must be >= 0")
        if self.num_pull_threads < 1:
            raise ValueError("num_pull_threads must be >= 1")
        check_idle_step_wait_ms(self.idle_step_wait_ms)


def side_channel_base_port(config: MooncakeConfig, kv_port: int, dp_rank: int, world_size: int) -> int:
    """First side-channel port of this DP rank's workers (worker ``i`` listens on base + i)."""
    base = config.side_channel_port if config.side_channel_port is not None else kv_port
    return base + dp_rank * world_size


def _preflight(config: MooncakeConfig, ktc: Mapping[str, Any]) -> Any:
    from kv_common.doctor import Preflight

    role = ktc.get("kv_role") or "kv_both"
    producer = role in ("kv_producer", "kv_both")
    base = config.side_channel_port if config.side_channel_port is not None else int(ktc["kv_port"])
    # One side-channel port per worker rank, every pipeline stage's included (DP rank r adds
    # r * world size, not known here).
    ranks = (config.prefill.tp_size if producer and config.prefill and config.prefill.tp_size else 1)
    ranks *= (config.prefill.pp_size or 1) if producer and config.prefill else 1
    plan = Preflight(modules=[("mooncake.engine", "TransferEngine", "Mooncake TransferEngine")],
                     mooncake_build="Mooncake TransferEngine")
    from kv_mooncake.config import start_up_contradictions

    # Without the engine's own layout only the role-independent refusals can be known here.
    plan.problems.extend(start_up_contradictions(config, is_producer=False, is_consumer=False, tp_size=0, pp_size=0))
    if producer or config.decode_side_channel:
        plan.advertise.append((config.advertised_host(), "side channel (kv_transfer_params' remote_host)",
                               "side_channel_host"))
        for rank in range(ranks):
            plan.bind.append((config.bind_host(), rank_port(base, rank), f"side channel of worker rank {rank}"))
    else:
        plan.notes.append("decode: listens on no side-channel port (decode_side_channel is false)")
    plan.advertise.append((config.transfer_engine_host(), "TransferEngine (it listens on every interface)",
                           "te_host"))
    from kv_mooncake.wire.seal import secret_preflight

    secret_preflight(plan, config.side_channel_secret_env, [b for b in plan.bind if "side channel" in b[2]])
    if producer and not (config.prefill and config.prefill.tp_size):
        plan.notes.append("ports checked for one worker rank; set prefill.tp_size to check one per TP rank")
    return plan


def parse_config(extra: Mapping[str, Any] | None, connector: str = CONNECTOR_NAME) -> MooncakeConfig:
    """The connector's start-up parse (also ``python -m kv_common doctor``'s; no vLLM needed)."""
    return parse_extra_config(connector, MooncakeConfig, extra)


def load_config(extra: Mapping[str, Any] | None) -> MooncakeConfig:
    return parse_config(extra)


# ---- declared sizes against the running layouts ----
# vllm-ascend's ``prefill`` / ``decode`` sizes checked against the layouts that really run.
#
# Pure functions: they return what contradicts (empty / None when nothing does), the caller refuses.
# A size that is not declared is not checked.

def _own_side(side: str, declared: ParallelSizes | None, tp_size: int, pp_size: int) -> list[str]:
    if declared is None:
        return []
    out = []
    if declared.tp_size is not None and declared.tp_size != tp_size:
        out.append(f"{side}.tp_size is {declared.tp_size} but this {side} instance runs tensor_parallel_size {tp_size}")
    if declared.pp_size is not None and declared.pp_size != pp_size:
        out.append(f"{side}.pp_size is {declared.pp_size} but this {side} instance runs pipeline_parallel_size {pp_size}")
    return out


def start_up_contradictions(
    config: MooncakeConfig, *, is_producer: bool, is_consumer: bool, tp_size: int, pp_size: int,
    layer_partition: Sequence[int] | None = None,
) -> list[str]:
    """Declared sizes of this instance's own side(s) that differ from its actual layout
    (``layer_partition``: the layers per pipeline stage a producer runs, when it runs PP > 1)."""
    out = []
    if is_producer:
        out += _own_side("prefill", config.prefill, tp_size, pp_size)
        declared = config.prefill.pp_layer_partition if config.prefill is not None else None
        if declared is not None and layer_partition is not None and parse_partition(declared) != tuple(layer_partition):
            out.append(f"prefill.pp_layer_partition is {declared!r} but this prefill instance places its layers "
                       f"{','.join(map(str, layer_partition))} (VLLM_PP_LAYER_PARTITION, else vLLM's even split)")
    if is_consumer:
        out += _own_side("decode", config.decode, tp_size, pp_size)
    return out


def peer_layout_contradiction(config: MooncakeConfig, *, remote_tp_size: int, remote_pp_size: int = 1) -> str | None:
    """On the decode: the declared prefill tp_size / pp_size against the ones a prefill reports."""
    declared = config.prefill
    if declared is not None and declared.tp_size is not None and declared.tp_size != remote_tp_size:
        return f"prefill.tp_size is {declared.tp_size} but the prefill instance reports tensor_parallel_size {remote_tp_size}"
    if declared is not None and declared.pp_size is not None and declared.pp_size != remote_pp_size:
        return (f"prefill.pp_size is {declared.pp_size} but the prefill instance reports pipeline_parallel_size "
                f"{remote_pp_size}")
    return None
