"""One client request through its two legs: the prefill, then the decode relayed as it arrives.

Each leg goes to the instance with the least outstanding tokens and is tried once more on another
instance of its role when it fails in a way another may not (connect error, 5xx, timeout, no first
byte in time); a 4xx goes to the client as it is. Every leg has a deadline, and the whole request
one more. A request that ends before any decode produced a byte gets its prefill blocks freed at
once (:mod:`.release`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import httpx
from fastapi.responses import Response, StreamingResponse
from kv_common.retry import Retry
from starlette.types import Receive, Scope, Send

from kv_mooncake.proxy.balancer import Instance, requested_max_tokens
from kv_mooncake.proxy.bodies import (
    decode_request_body,
    error_response,
    prefill_request_body,
    sse_error_event,
)
from kv_mooncake.proxy.config import ProxyConfig
from kv_mooncake.proxy.exchange import (
    DeadlineExceeded,
    DecodeLeg,
    Exchange,
    LegFailed,
    PassThrough,
    Unavailable,
)
from kv_mooncake.proxy.metrics import ProxyMetrics
from kv_mooncake.proxy.prefix_index import PrefixIndex, PromptKeys, prefill_credit
from kv_mooncake.proxy.release import release_prefill_blocks
from kv_mooncake.proxy.routing import request_path, token_id_prompt
from kv_mooncake.proxy.upstreams import Upstreams

logger = logging.getLogger("kv_mooncake.proxy")

_MAX_ERROR_BODY = 64 << 10  # bytes of an upstream error answer kept (passed on or logged)
# A leg is tried once more, at once, on another instance of its role; the request's deadline
# (``Exchange.budget``) bounds both tries.
LEG_RETRY = Retry(total=2)


class RelayResponse(StreamingResponse):
    """A StreamingResponse that always runs ``on_close`` when it ends, also when Starlette cancels
    the body iterator because the client went away (the iterator's own ``finally`` may never run)."""

    def __init__(self, *args: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class Relay:
    """The legs of client requests, over one HTTP client kept open to every instance."""

    def __init__(self, config: ProxyConfig, upstreams: Upstreams, metrics: ProxyMetrics) -> None:
        self.config = config
        self.upstreams = upstreams
        self.metrics = metrics
        self._client: httpx.AsyncClient | None = None
        self._background: set[asyncio.Task] = set()
        self.indexes: dict[str, PrefixIndex] = {}  # instance URL -> its prefix index (KV events)

    # ---- lifecycle
    async def start(self) -> None:
        c = self.config
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=c.connect_timeout_s, read=None, write=c.connect_timeout_s,
                                  pool=c.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )

    async def stop(self) -> None:
        if self._background:  # releases in flight: each bounded by release_timeout_s
            await asyncio.wait(self._background, timeout=self.config.release_timeout_s * 2)
        if self._client is not None:
            await self._client.aclose()

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("proxy not started")
        return self._client

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- releasing a prefill's blocks
    def release_if_unpulled(self, ex: Exchange) -> None:
        """The request ends and no decode has the KV: free the prefill's blocks now (once)."""
        if ex.params is None or ex.first_byte or ex.released or not self.config.release_on_abort:
            return
        ex.released = True
        params = ex.params

        async def release() -> None:
            acked = await asyncio.to_thread(release_prefill_blocks, params, self.config.release_timeout_s)
            self.metrics.releases.labels("acked" if acked else "not_acked").inc()
            logger.info("request %s: prefill blocks released (%d rank(s) acknowledged)", ex.request_id, acked)

        self._spawn(release())

    # ---- one leg attempt
    async def _send(self, inst: Instance, path: str, body: dict, ex: Exchange) -> httpx.Response:
        request = self.client.build_request(
            "POST", inst.url + path, json=body, headers={**ex.headers, "X-Request-Id": ex.request_id})
        return await self.client.send(request, stream=True)

    @staticmethod
    async def _read_bounded(response: httpx.Response, limit: int = _MAX_ERROR_BODY) -> bytes:
        data = b""
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) >= limit:
                break
        return data[:limit]

    async def _raise_for_status(self, response: httpx.Response) -> None:
        """A 5xx fails the leg (retried elsewhere); a 4xx goes to the client as it is."""
        if response.status_code >= 500:
            detail = (await self._read_bounded(response)).decode("utf-8", "replace")[:500]
            raise LegFailed("5xx", f"{response.status_code} {detail}")
        if response.status_code >= 400:
            raise PassThrough(response.status_code, await self._read_bounded(response),
                              response.headers.get("content-type"))

    def _attempts(self, role: str, tokens: int, credit: dict[str, int] | None = None) -> Iterator[Instance]:
        """The instance for a leg, acquired for ``tokens`` (the caller releases it), and after each
        retry-worthy failure another one, as ``LEG_RETRY`` allows."""
        tried: list[str] = []
        while LEG_RETRY.allows(len(tried)):
            inst = self.upstreams.take(role, tokens, exclude=tried, credit=credit)
            if inst is None:
                return
            if tried:
                self.metrics.retries.labels(role).inc()
            tried.append(inst.url)
            yield inst

    def _attempt_failed(self, inst: Instance, exc: httpx.TransportError | LegFailed) -> str:
        """Take ``inst`` out for a failure another instance may not have; returns the reason."""
        if isinstance(exc, LegFailed):
            self.upstreams.failed(inst, exc.kind, exc.detail)
            return f"{inst.url}: {exc}"
        kind = "connect" if isinstance(exc, httpx.ConnectError) else "transport"
        self.upstreams.failed(inst, kind, f"{type(exc).__name__} {exc}")
        return f"{inst.url}: {kind} error"

    async def _prefill_once(self, inst: Instance, path: str, body: dict, ex: Exchange) -> dict:
        response = await self._send(inst, path, body, ex)
        try:
            await self._raise_for_status(response)
            content = await response.aread()
            try:
                params = json.loads(content).get("kv_transfer_params")
            except (ValueError, AttributeError) as exc:
                raise LegFailed("bad_answer", f"prefill answer is not a JSON object: {exc}") from exc
            if not isinstance(params, dict):
                raise LegFailed("bad_answer", "prefill answered without kv_transfer_params "
                                               "(is it started with a kv_producer / kv_both KV connector?)")
            # Known at once: a client leaving from here on gets these blocks freed (FreeNow).
            ex.params = params
        finally:
            await response.aclose()
        return params

    def _unhold(self, ex: Exchange) -> None:
        """The prefill's blocks are pulled (a decode's first byte) or never will be: a draining
        prefill may leave once nothing else of it is in flight."""
        if ex.prefill is not None:
            self.upstreams.unhold(ex.prefill)
            ex.prefill = None

    async def _prefill(self, path: str, body: dict, ex: Exchange, tokens: int, prompt: PromptKeys | None) -> dict:
        leg_body = prefill_request_body(body)
        reasons: list[str] = []
        credit = prefill_credit(self.indexes, prompt) if self.indexes else None
        for inst in self._attempts("prefill", tokens, credit):
            if credit is not None and prompt is not None:
                self.metrics.prefix_routed.labels("hit" if credit.get(inst.url) else "miss").inc()
            t0 = time.monotonic()
            try:
                params = await asyncio.wait_for(self._prefill_once(inst, path, leg_body, ex),
                                                ex.budget(self.config.prefill_timeout_s))
            except (asyncio.TimeoutError, TimeoutError):
                if ex.remaining() <= 0:
                    raise DeadlineExceeded(f"request {ex.request_id}: deadline passed in the prefill") from None
                self.upstreams.failed(inst, "timeout", f"no answer in {self.config.prefill_timeout_s:g} s")
                reasons.append(f"{inst.url}: timeout")
                continue
            except (httpx.TransportError, LegFailed) as exc:
                reasons.append(self._attempt_failed(inst, exc))
                continue
            finally:
                self.upstreams.release(inst, tokens)
            self.metrics.prefill_seconds.observe(time.monotonic() - t0)
            self.upstreams.succeeded(inst)
            self.upstreams.hold(inst)
            ex.prefill = inst
            return params
        raise Unavailable("prefill", reasons)

    async def _decode_once(self, inst: Instance, path: str, body: dict, ex: Exchange, tokens: int) -> DecodeLeg:
        """Headers and first body chunk of a decode leg (the caller bounds it by the first-byte deadline)."""
        response = await self._send(inst, path, body, ex)
        try:
            await self._raise_for_status(response)
            chunks = response.aiter_bytes()
            first = b""
            with contextlib.suppress(StopAsyncIteration):
                first = await chunks.__anext__()
        except BaseException:
            await response.aclose()
            raise
        return DecodeLeg(inst, tokens, response, chunks, first)

    def _prompt_keys(self, body: dict) -> PromptKeys | None:
        """The prompt's token ids (None: a text prompt), walked once per request, only for --kv-events."""
        if not self.indexes:
            return None
        token_ids = token_id_prompt(body)
        return None if token_ids is None else PromptKeys(token_ids)

    def _decode_credit(self, prompt: PromptKeys | None) -> dict[str, int]:
        """Per decode URL, prompt tokens it holds (KV events), when --decode-only-cached asks."""
        if not self.config.decode_only_cached or not self.indexes:
            return {}
        decodes = self.upstreams.urls("decode")
        return prefill_credit({u: x for u, x in self.indexes.items() if u in decodes}, prompt)

    async def _decode(self, path: str, body: dict, ex: Exchange, tokens: int, stream: bool,
                      credit: dict[str, int] | None = None) -> DecodeLeg:
        reasons: list[str] = []
        # A non-streamed answer arrives whole: its first byte is its last, bounded by the request.
        first_byte_timeout_s = self.config.first_byte_timeout_s if stream else self.config.request_timeout_s
        for inst in self._attempts("decode", tokens, credit):  # a retry keeps the kv_transfer_params
            try:
                first_byte_s = ex.budget(first_byte_timeout_s)  # past the deadline: released below
                leg = await asyncio.wait_for(self._decode_once(inst, path, body, ex, tokens), first_byte_s)
            except (asyncio.TimeoutError, TimeoutError):
                self.upstreams.release(inst, tokens)
                if ex.remaining() <= 0 or not stream:
                    raise DeadlineExceeded(f"request {ex.request_id}: deadline passed in the decode") from None
                self.upstreams.failed(inst, "timeout", f"no first byte in {first_byte_s:g} s")
                reasons.append(f"{inst.url}: no first byte in time")
                continue
            except (httpx.TransportError, LegFailed) as exc:
                self.upstreams.release(inst, tokens)
                reasons.append(self._attempt_failed(inst, exc))
                continue
            except BaseException:
                self.upstreams.release(inst, tokens)
                raise
            self.upstreams.succeeded(inst)
            return leg
        raise Unavailable("decode", reasons)

    def _close_leg(self, leg: DecodeLeg) -> None:
        """Give the decode leg back (sync: callable from a cancelled scope). Closing the connection
        of an unfinished stream makes vLLM abort the request."""
        if leg.closed:
            return
        leg.closed = True
        self.upstreams.release(leg.instance, leg.tokens)
        self._spawn(leg.response.aclose())

    async def _next_chunk(self, leg: DecodeLeg, ex: Exchange) -> bytes | None:
        try:
            return await asyncio.wait_for(leg.chunks.__anext__(), ex.budget(self.config.idle_timeout_s))
        except StopAsyncIteration:
            return None

    # ---- one client request
    async def handle(self, ex: Exchange, path: str, body: dict) -> Response:
        stream = bool(body.get("stream"))
        prompt = self._prompt_keys(body)
        decode_credit = self._decode_credit(prompt)
        chosen, prompt_tokens = request_path(body, self.config.decode_only_below,
                                             max(decode_credit.values(), default=0), self.config.decode_only_cached)
        route: str = chosen
        headers = {"X-Request-Id": ex.request_id}
        leg: DecodeLeg | None = None
        try:
            if route == "disaggregated":
                try:
                    ex.params = await self._prefill(path, body, ex, prompt_tokens, prompt)
                except Unavailable as exc:
                    if self.config.fallback != "decode-only":
                        return error_response(503, str(exc), "service_unavailable", ex.request_id)
                    logger.warning("request %s: %s; decode-only fallback", ex.request_id, exc)
                    self.metrics.fallbacks.inc()
                    route = "decode_only_fallback"
            self.metrics.requests_by_path.labels(route).inc()
            n = body.get("n")
            samples = n if isinstance(n, int) and n > 0 else 1
            decode_tokens = prompt_tokens + samples * requested_max_tokens(body, self.config.default_max_tokens)
            leg = await self._decode(path, decode_request_body(body, ex.params), ex, decode_tokens, stream,
                                     decode_credit if route == "decode_only_cached" else None)
            ex.first_byte = True
            self._unhold(ex)
            self.metrics.ttfb_seconds.observe(time.monotonic() - ex.t0)
            if stream:
                response = RelayResponse(self._relay(leg, ex), status_code=leg.response.status_code,
                                          media_type=leg.content_type, headers=headers,
                                          on_close=functools.partial(self._close_leg, leg))
                leg = None  # the response owns it now
                return response
            parts = [leg.first]
            while (chunk := await self._next_chunk(leg, ex)) is not None:
                parts.append(chunk)
            return Response(b"".join(parts), status_code=leg.response.status_code,
                            media_type=leg.content_type, headers=headers)
        except PassThrough as exc:
            return Response(exc.content, status_code=exc.status, media_type=exc.content_type, headers=headers)
        except Unavailable as exc:
            return error_response(503, str(exc), "service_unavailable", ex.request_id)
        except (DeadlineExceeded, asyncio.TimeoutError, TimeoutError) as exc:
            return error_response(504, f"request {ex.request_id} timed out: {exc or 'no answer in time'}",
                                  "timeout", ex.request_id)
        except httpx.TransportError as exc:  # the decode broke after its first byte (non-streamed)
            return error_response(502, f"decode connection failed: {type(exc).__name__} {exc}",
                                  "bad_gateway", ex.request_id)
        finally:
            if leg is not None:
                self._close_leg(leg)
            self.release_if_unpulled(ex)
            self._unhold(ex)

    async def _relay(self, leg: DecodeLeg, ex: Exchange) -> AsyncIterator[bytes]:
        if leg.first:
            yield leg.first
        while True:
            try:
                chunk = await self._next_chunk(leg, ex)
            except (asyncio.TimeoutError, TimeoutError, DeadlineExceeded):
                yield sse_error_event(504, f"decode stream of {ex.request_id} stalled or passed its deadline",
                                      "timeout")
                return
            except httpx.TransportError as exc:
                yield sse_error_event(502, f"decode stream of {ex.request_id} broke: {type(exc).__name__}",
                                      "bad_gateway")
                return
            if chunk is None:
                return
            yield chunk
