"""Subscriber of vLLM's KV events (``--kv-events-config`` with publisher ``zmq``), one per instance.

vLLM 0.32's ``ZmqEventPublisher`` sends multipart messages ``(topic, seq, payload)``: ``seq`` an
8-byte big-endian counter, ``payload`` a msgpack ``KVEventBatch`` ``[ts, [event, ...], dp_rank]``,
each event a map tagged by ``"type"``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
``token_ids``, ``block_size``, ``lora_id``, ``medium``, ...), ``BlockRemoved`` (``block_hashes``,
``medium``) or ``AllBlocksCleared``. Everything is checked before it touches the index; a bad
message is counted and skipped, never raised. A gap in ``seq`` (a missed message) or ``seq``
going back (the instance restarted) clears that instance's index: the proxy then balances on
load alone for it until new events arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from kv_mooncake.proxy.metrics import ProxyMetrics
from kv_mooncake.proxy.prefix_index import PrefixIndex

try:
    import zmq
    import zmq.asyncio
except ImportError as exc:  # pyzmq comes with the proxy's extra, never with the connector
    raise ImportError(f"{exc}: kv-mooncake-proxy's KV-event subscriber needs pyzmq, "
                      "install the proxy's extra: pip install 'kv-mooncake[proxy]'") from exc

logger = logging.getLogger("kv_mooncake.proxy")

MAX_MESSAGE_BYTES = 64 << 20


def _int_list(value: object, limit: int = 1 << 20) -> bool:
    return isinstance(value, list) and len(value) <= limit and all(isinstance(x, int) for x in value)


def _hash_list(value: object) -> bool:
    return isinstance(value, list) and len(value) <= 1 << 16 and all(isinstance(x, (int, bytes)) for x in value)


def _medium(value: object) -> str | None:
    """An event's medium (vLLM's values: GPU, CPU, STORAGE; others kept as they are), bounded."""
    return value if isinstance(value, str) and 0 < len(value) <= 32 else None


def apply_message(index: PrefixIndex, frames: list[bytes], last_seq: int | None) -> tuple[int | None, str]:
    """One ZMQ message into ``index``; returns (the sequence number now last, what it was):
    ``ok``, ``gap`` (index cleared first), ``bad`` (skipped)."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return last_seq, "bad"
    seq = int.from_bytes(frames[1], "big", signed=True)
    outcome = "ok"
    if last_seq is not None and seq != last_seq + 1:
        index.clear()
        outcome = "gap"
    try:
        batch = msgspec.msgpack.decode(frames[2])
    except msgspec.DecodeError:
        return seq, "bad"
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        return seq, "bad"
    for event in batch[1]:
        if not isinstance(event, dict):
            outcome = "bad" if outcome == "ok" else outcome
            continue
        kind = event.get("type")
        if kind == "AllBlocksCleared":
            index.clear()
        elif kind == "BlockRemoved" and _hash_list(event.get("block_hashes")):
            if event.get("group_idx") in (None, 0):
                index.removed(event["block_hashes"], _medium(event.get("medium")))
        elif (kind == "BlockStored" and _hash_list(event.get("block_hashes")) and _int_list(event.get("token_ids"))
              and isinstance(event.get("block_size"), int)
              and isinstance(event.get("parent_block_hash"), (int, bytes, type(None)))):
            # A LoRA's blocks are another model's KV; other groups (hybrid models) are not prompts' prefixes.
            if event.get("lora_id") is None and event.get("group_idx") in (None, 0):
                index.stored(event["block_hashes"], event["parent_block_hash"], event["token_ids"],
                             event["block_size"], _medium(event.get("medium")))
        elif outcome == "ok":
            outcome = "bad"
    return seq, outcome


class KvEventsSubscriber:
    """One SUB socket per instance with an endpoint; each feeds that instance's :class:`PrefixIndex`."""

    def __init__(self, endpoints: dict[str, str], max_blocks: int, metrics: ProxyMetrics) -> None:
        self.endpoints = endpoints
        self.indexes = {url: PrefixIndex(max_blocks) for url in endpoints}
        self.metrics = metrics
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        for url, endpoint in self.endpoints.items():
            self._tasks.append(asyncio.create_task(self._listen(url, endpoint), name=f"kv-events {url}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _listen(self, url: str, endpoint: str) -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)  # zmq reconnects by itself: a publisher that comes later is heard
        index, last_seq = self.indexes[url], None
        logger.info("KV events of %s from %s", url, endpoint)
        try:
            while True:
                try:
                    frames = await sock.recv_multipart()
                except zmq.ZMQError as exc:  # e.g. a message over MAX_MESSAGE_BYTES: skip it, go on
                    self.metrics.kv_event_messages.labels(url, "bad").inc()
                    logger.warning("KV events of %s: %s", url, exc)
                    await asyncio.sleep(1.0)
                    continue
                try:
                    last_seq, outcome = apply_message(index, frames, last_seq)
                except Exception:  # noqa: BLE001 - a message no check foresaw: never the subscriber's end
                    logger.exception("KV events of %s: message skipped", url)
                    index.clear()
                    outcome = "bad"
                self.metrics.kv_event_messages.labels(url, outcome).inc()
                self.metrics.prefix_index_blocks.labels(url).set(len(index))
                if outcome == "gap":
                    logger.warning("KV events of %s: a gap in the sequence, its prefix index was cleared", url)
        finally:
            sock.close(0)
