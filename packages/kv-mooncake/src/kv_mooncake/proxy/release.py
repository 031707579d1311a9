"""Free a prefill's held blocks when no decode will pull them (client gone, decode refused).

Without this a prefill keeps a finished request's blocks until its ``hold_timeout_s``. The decode
instance frees them itself when vLLM aborts a request it has already scheduled, but not when the
request never reached it (the client left between the legs, the decode answered 4xx, every decode
was down). The proxy then sends MooncakeConnectorV1's ``FreeNow`` to each prefill rank's side
channel. FreeNow is idempotent and waits for reads under a current lease, so a late or duplicate
one never pulls blocks from under a decode. Prefills with a side-channel secret take it sealed with
``KV_SECRET`` from the proxy's environment (``kv_mooncake.wire.seal``).
"""

from __future__ import annotations

from kv_common.logging_utils import get_logger

from kv_mooncake.params import parse_transfer_params
from kv_mooncake.wire import client as side_channel
from kv_mooncake.wire import messages as P
from kv_mooncake.wire.seal import auth_from_env

logger = get_logger(__name__)

READER_ID = "kv-mooncake-proxy"


def side_channel_addresses(params: dict) -> list[str] | None:
    """Side-channel address of every prefill rank named by a MooncakeConnectorV1 prefill's
    ``kv_transfer_params``; None when the params come from another connector."""
    parsed = parse_transfer_params(params)
    return parsed.prefill_addresses() if parsed is not None else None


def release_prefill_blocks(params: dict, timeout_s: float) -> int:
    """Send FreeNow for the request in ``params`` to each prefill rank; returns how many ranks
    acknowledged. Blocking (run it in a thread); never raises."""
    parsed = parse_transfer_params(params)
    addresses = parsed.prefill_addresses() if parsed is not None else None
    if parsed is None or not addresses:
        return 0
    message = P.FreeNow(request_id=str(parsed.request_id), reader_id=READER_ID)
    try:
        auth = auth_from_env(None)
    except ValueError as exc:  # KV_SECRET too short: the prefills refuse it too
        logger.warning("kv-mooncake-proxy: FreeNow for %s not sent: %s", parsed.request_id, exc)
        return 0
    acked = 0
    for address in addresses:
        try:
            reply = side_channel.request(address, message, P.REPLY_TYPES, timeout_s, auth=auth)
        except Exception as exc:  # noqa: BLE001 - the hold expires anyway; report and go on
            logger.warning("kv-mooncake-proxy: FreeNow for %s to %s failed: %s", parsed.request_id, address, exc)
            continue
        acked += isinstance(reply, P.Ack)
    return acked
