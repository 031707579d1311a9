"""Free a prefill's held blocks when no decode will pull them (client gone, decode refused).

Without this a prefill keeps a finished request's blocks until its ``hold_timeout_s``. The decode
instance frees them itself when vLLM aborts a request it has already scheduled, but not when the
request never reached it (the client left between the legs, the decode answered 4xx, every decode
was down). The proxy then sends MooncakeConnectorV1's ``FreeNow`` to each prefill rank's side
channel. FreeNow is idempotent and waits for reads under a current lease, so a late or duplicate
one never pulls blocks from under a decode.
"""

from __future__ import annotations

from kv_common.logging_utils import get_logger

from kv_mooncake import protocol as P
from kv_mooncake import side_channel
from kv_mooncake.pull_plan import PrefillLayout

logger = get_logger(__name__)

READER_ID = "kv-mooncake-proxy"


def side_channel_addresses(params: dict) -> list[str] | None:
    """Side-channel address of every prefill rank named by a MooncakeConnectorV1 prefill's
    ``kv_transfer_params``; None when the params come from another connector."""
    host, port = params.get("remote_host"), params.get("remote_port")
    if not (isinstance(host, str) and host and isinstance(port, int) and port > 0
            and isinstance(params.get("remote_request_id"), str)):
        return None
    tp = int(params.get("remote_tp_size") or 1)
    pcp = int(params.get("remote_pcp_size") or 1)
    layout = PrefillLayout(tp_size=tp, total_kv_heads=max(tp, 1), pcp_size=pcp,
                           dcp_size=int(params.get("remote_dcp_size") or 1))
    return [f"{host}:{port + rank.index(layout)}" for rank in layout.ranks()]


def release_prefill_blocks(params: dict, timeout_s: float) -> int:
    """Send FreeNow for the request in ``params`` to each prefill rank; returns how many ranks
    acknowledged. Blocking (run it in a thread); never raises."""
    addresses = side_channel_addresses(params)
    if not addresses:
        return 0
    message = P.FreeNow(request_id=params["remote_request_id"], reader_id=READER_ID)
    acked = 0
    for address in addresses:
        try:
            reply = side_channel.request(address, message, P.REPLY_TYPES, timeout_s)
        except Exception as exc:  # noqa: BLE001 - the hold expires anyway; report and go on
            logger.warning("kv-mooncake-proxy: FreeNow for %s to %s failed: %s",
                           params["remote_request_id"], address, exc)
            continue
        acked += isinstance(reply, P.Ack)
    return acked
