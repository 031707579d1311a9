"""The proxy: an OpenAI-compatible front for disaggregated prefill (FastAPI + httpx).

One client request becomes two legs with the same ``X-Request-Id``:

1. prefill leg: the request with ``max_tokens=1``, not streamed, ``kv_transfer_params=
   {"do_remote_decode": true}`` on the prefill instance with the least outstanding tokens. A connect
   error, 5xx, timeout or an answer without ``kv_transfer_params`` takes that instance out and the
   leg is tried once on another prefill; then 503 (or, only with ``--fallback decode-only``, the
   decode prefills the request itself). A 4xx goes to the client as it is.
2. decode leg: the client's request plus the prefill's ``kv_transfer_params``, relayed as it
   arrives. A failure before the decode's first byte (connect error, 5xx, no first byte in time)
   is tried once on another decode with the same parameters: the prefill still holds the blocks.

Every leg has a deadline, and the whole request one more. When a request ends before any decode
produced a byte (client gone, decode 4xx, every decode failed) the prefill's blocks are freed at
once through its side channel (:mod:`kv_mooncake.proxy.release`) instead of at hold expiry; a
client leaving closes the running leg's connection, which makes vLLM abort that request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kv_mooncake.proxy.balancer import Instance, InstancePool, estimate_prompt_tokens, requested_max_tokens
from kv_mooncake.proxy.config import ProxyConfig
from kv_mooncake.proxy.metrics import ProxyMetrics
from kv_mooncake.proxy.release import release_prefill_blocks

logger = logging.getLogger("kv_mooncake.proxy")

_MAX_ERROR_BODY = 64 << 10  # bytes of an upstream error answer kept (passed on or logged)
_FORWARDED_HEADERS = ("authorization",)


# ---------------------------------------------------------------------------------------- requests
def prefill_request_body(body: dict) -> dict:
    """The prefill leg: the client's request, one token, not streamed, asking the prefill to keep
    its blocks for a remote decode (extra ``kv_transfer_params`` of the client kept)."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    for key in ("stream_options", "min_tokens"):  # invalid without streaming / above max_tokens
        out.pop(key, None)
    client_params = body.get("kv_transfer_params")
    if not isinstance(client_params, dict):
        client_params = {}
    out["kv_transfer_params"] = {
        **client_params,
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return out


def decode_request_body(body: dict, params: dict | None) -> dict:
    out = dict(body)
    if params is not None:
        out["kv_transfer_params"] = params
    else:
        out.pop("kv_transfer_params", None)
    return out


def error_body(status: int, message: str, kind: str) -> dict:
    """OpenAI's error object (what vLLM answers too)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_response(status: int, message: str, kind: str, request_id: str | None = None) -> JSONResponse:
    headers = {"X-Request-Id": request_id} if request_id else None
    return JSONResponse(error_body(status, message, kind), status_code=status, headers=headers)


def sse_error_event(status: int, message: str, kind: str) -> bytes:
    """A stream that broke after its first byte cannot change its status: tell the client in-band
    (the ``openai`` package raises an APIError on it)."""
    return b"data: " + json.dumps(error_body(status, message, kind)).encode() + b"\n\n"


# ---------------------------------------------------------------------------------------- outcomes
class PassThrough(Exception):  # noqa: N818 - an outcome, not a failure of the proxy
    """An upstream answered 4xx: the client gets that answer as it is."""

    def __init__(self, status: int, content: bytes, content_type: str | None) -> None:
        super().__init__(f"upstream answered {status}")
        self.status, self.content, self.content_type = status, content, content_type


class Unavailable(Exception):  # noqa: N818
    """No instance of a role could serve the leg (after the retry)."""

    def __init__(self, role: str, reasons: list[str]) -> None:
        super().__init__(f"no {role} instance could serve the request: " + ("; ".join(reasons) or "none configured"))
        self.role = role


class DeadlineExceeded(Exception):  # noqa: N818
    pass


class _LegFailed(Exception):  # noqa: N818
    """One attempt on one instance failed in a way another instance may not (retry-worthy)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


@dataclass
class Exchange:
    """One client request across its legs."""

    request_id: str
    endpoint: str
    deadline: float
    headers: dict[str, str]
    params: dict | None = None  # the prefill's kv_transfer_params, once known
    first_byte: bool = False  # a decode produced a byte: it has the KV, nothing left to release
    released: bool = False
    t0: float = field(default_factory=time.monotonic)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def budget(self, leg_timeout_s: float) -> float:
        left = self.remaining()
        if left <= 0:
            raise DeadlineExceeded(f"request {self.request_id} passed its deadline")
        return min(leg_timeout_s, left)


@dataclass
class DecodeLeg:
    instance: Instance
    tokens: int
    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first: bytes
    closed: bool = False

    @property
    def content_type(self) -> str | None:
        return self.response.headers.get("content-type")


class _RelayResponse(StreamingResponse):
    """A StreamingResponse that always runs ``on_close`` when it ends, also when Starlette cancels
    the body iterator because the client went away (the iterator's own ``finally`` may never run)."""

    def __init__(self, *args: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---------------------------------------------------------------------------------------- the proxy
class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefills = InstancePool("prefill", config.prefill_urls)
        self.decodes = InstancePool("decode", config.decode_urls)
        self.metrics = ProxyMetrics()
        self._client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        for pool in (self.prefills, self.decodes):
            for inst in pool.instances:
                self._publish(inst)

    # ---- lifecycle
    async def start(self) -> None:
        c = self.config
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=c.connect_timeout_s, read=None, write=c.connect_timeout_s,
                                  pool=c.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self._health_task = asyncio.create_task(self._health_loop(), name="kv-proxy-health")

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
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

    # ---- instance state
    def _publish(self, inst: Instance) -> None:
        self.metrics.healthy.labels(inst.role, inst.url).set(1 if inst.healthy else 0)
        self.metrics.outstanding.labels(inst.role, inst.url).set(inst.outstanding_tokens)

    def _pool(self, inst: Instance) -> InstancePool:
        return self.prefills if inst.role == "prefill" else self.decodes

    def _acquire(self, inst: Instance, tokens: int) -> None:
        self._pool(inst).acquire(inst, tokens)
        self._publish(inst)

    def _release(self, inst: Instance, tokens: int) -> None:
        self._pool(inst).release(inst, tokens)
        self._publish(inst)

    def _failed(self, inst: Instance, kind: str, detail: str) -> None:
        self.metrics.leg_failures.labels(inst.role, inst.url, kind).inc()
        if self._pool(inst).mark_down(inst, f"{kind}: {detail}"):
            logger.warning("%s %s taken out (%s: %s)", inst.role, inst.url, kind, detail)
        self._publish(inst)

    def _succeeded(self, inst: Instance) -> None:
        if self._pool(inst).mark_up(inst):
            logger.info("%s %s back in (served a request)", inst.role, inst.url)
            self._publish(inst)

    async def _health_loop(self) -> None:
        while True:
            insts = [*self.prefills.instances, *self.decodes.instances]
            await asyncio.gather(*(self._probe(i) for i in insts))
            await asyncio.sleep(self.config.health_interval_s)

    async def _probe(self, inst: Instance) -> None:
        try:
            r = await self.client.get(f"{inst.url}/health", timeout=self.config.health_timeout_s)
            ok, reason = r.status_code == 200, f"health check answered {r.status_code}"
        except httpx.HTTPError as exc:
            ok, reason = False, f"health check failed: {type(exc).__name__} {exc}"
        if ok:
            if self._pool(inst).mark_up(inst):
                logger.info("%s %s back in (health check)", inst.role, inst.url)
        elif self._pool(inst).mark_down(inst, reason):
            logger.warning("%s %s taken out (%s)", inst.role, inst.url, reason)
        self._publish(inst)

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
            raise _LegFailed("5xx", f"{response.status_code} {detail}")
        if response.status_code >= 400:
            raise PassThrough(response.status_code, await self._read_bounded(response),
                              response.headers.get("content-type"))

    async def _prefill_once(self, inst: Instance, path: str, body: dict, ex: Exchange) -> dict:
        response = await self._send(inst, path, body, ex)
        try:
            await self._raise_for_status(response)
            content = await response.aread()
            try:
                params = json.loads(content).get("kv_transfer_params")
            except (ValueError, AttributeError) as exc:
                raise _LegFailed("bad_answer", f"prefill answer is not a JSON object: {exc}") from exc
            if not isinstance(params, dict):
                raise _LegFailed("bad_answer", "prefill answered without kv_transfer_params "
                                               "(is it started with a kv_producer / kv_both KV connector?)")
            # Known at once: a client leaving from here on gets these blocks freed (FreeNow).
            ex.params = params
        finally:
            await response.aclose()
        return params

    async def _prefill(self, path: str, body: dict, ex: Exchange, tokens: int) -> dict:
        leg_body = prefill_request_body(body)
        tried: list[str] = []
        reasons: list[str] = []
        for attempt in range(2):  # once more on another prefill
            inst = self.prefills.pick(exclude=tried)
            if inst is None:
                break
            if attempt:
                self.metrics.retries.labels("prefill").inc()
            tried.append(inst.url)
            self._acquire(inst, tokens)
            t0 = time.monotonic()
            try:
                params = await asyncio.wait_for(self._prefill_once(inst, path, leg_body, ex),
                                                ex.budget(self.config.prefill_timeout_s))
            except (asyncio.TimeoutError, TimeoutError):
                if ex.remaining() <= 0:
                    raise DeadlineExceeded(f"request {ex.request_id}: deadline passed in the prefill") from None
                self._failed(inst, "timeout", f"no answer in {self.config.prefill_timeout_s:g} s")
                reasons.append(f"{inst.url}: timeout")
                continue
            except httpx.TransportError as exc:
                kind = "connect" if isinstance(exc, httpx.ConnectError) else "transport"
                self._failed(inst, kind, f"{type(exc).__name__} {exc}")
                reasons.append(f"{inst.url}: {kind} error")
                continue
            except _LegFailed as exc:
                self._failed(inst, exc.kind, exc.detail)
                reasons.append(f"{inst.url}: {exc}")
                continue
            finally:
                self._release(inst, tokens)
            self.metrics.prefill_seconds.observe(time.monotonic() - t0)
            self._succeeded(inst)
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

    async def _decode(self, path: str, body: dict, ex: Exchange, tokens: int, stream: bool) -> DecodeLeg:
        tried: list[str] = []
        reasons: list[str] = []
        for attempt in range(2):  # once more on another decode, same kv_transfer_params
            inst = self.decodes.pick(exclude=tried)
            if inst is None:
                break
            if attempt:
                self.metrics.retries.labels("decode").inc()
            tried.append(inst.url)
            # A non-streamed answer arrives whole: its first byte is its last, bounded by the request.
            first_byte_s = ex.budget(self.config.first_byte_timeout_s if stream else self.config.request_timeout_s)
            self._acquire(inst, tokens)
            try:
                leg = await asyncio.wait_for(self._decode_once(inst, path, body, ex, tokens), first_byte_s)
            except (asyncio.TimeoutError, TimeoutError):
                self._release(inst, tokens)
                if ex.remaining() <= 0 or not stream:
                    raise DeadlineExceeded(f"request {ex.request_id}: deadline passed in the decode") from None
                self._failed(inst, "timeout", f"no first byte in {first_byte_s:g} s")
                reasons.append(f"{inst.url}: no first byte in time")
                continue
            except httpx.TransportError as exc:
                self._release(inst, tokens)
                kind = "connect" if isinstance(exc, httpx.ConnectError) else "transport"
                self._failed(inst, kind, f"{type(exc).__name__} {exc}")
                reasons.append(f"{inst.url}: {kind} error")
                continue
            except _LegFailed as exc:
                self._release(inst, tokens)
                self._failed(inst, exc.kind, exc.detail)
                reasons.append(f"{inst.url}: {exc}")
                continue
            except BaseException:
                self._release(inst, tokens)
                raise
            self._succeeded(inst)
            return leg
        raise Unavailable("decode", reasons)

    def _close_leg(self, leg: DecodeLeg) -> None:
        """Give the decode leg back (sync: callable from a cancelled scope). Closing the connection
        of an unfinished stream makes vLLM abort the request."""
        if leg.closed:
            return
        leg.closed = True
        self._release(leg.instance, leg.tokens)
        self._spawn(leg.response.aclose())

    async def _next_chunk(self, leg: DecodeLeg, ex: Exchange) -> bytes | None:
        try:
            return await asyncio.wait_for(leg.chunks.__anext__(), ex.budget(self.config.idle_timeout_s))
        except StopAsyncIteration:
            return None

    # ---- one client request
    async def handle(self, ex: Exchange, path: str, body: dict) -> Response:
        stream = bool(body.get("stream"))
        prompt_tokens = estimate_prompt_tokens(body)
        headers = {"X-Request-Id": ex.request_id}
        leg: DecodeLeg | None = None
        try:
            try:
                ex.params = await self._prefill(path, body, ex, prompt_tokens)
            except Unavailable as exc:
                if self.config.fallback != "decode-only":
                    return error_response(503, str(exc), "service_unavailable", ex.request_id)
                logger.warning("request %s: %s; decode-only fallback", ex.request_id, exc)
                self.metrics.fallbacks.inc()
            decode_tokens = prompt_tokens + requested_max_tokens(body, self.config.default_max_tokens)
            leg = await self._decode(path, decode_request_body(body, ex.params), ex, decode_tokens, stream)
            ex.first_byte = True
            self.metrics.ttfb_seconds.observe(time.monotonic() - ex.t0)
            if stream:
                response = _RelayResponse(self._relay(leg, ex), status_code=leg.response.status_code,
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

    async def serve(self, request: Request, path: str, endpoint: str) -> Response:
        """A client request, raced against its client leaving: a client gone cancels the legs."""
        t0 = time.monotonic()
        try:
            body = await request.json()
        except ValueError:
            return self._count(endpoint, error_response(400, "request body is not valid JSON", "invalid_request_error"))
        if not isinstance(body, dict):
            return self._count(endpoint, error_response(400, "request body must be a JSON object",
                                                        "invalid_request_error"))
        if body.get("n") not in (None, 1):
            return self._count(endpoint, error_response(
                400, "n > 1 is not supported by disaggregated prefill (one prefill serves one sequence)",
                "invalid_request_error"))
        ex = Exchange(
            request_id=request.headers.get("x-request-id") or uuid.uuid4().hex,
            endpoint=endpoint,
            deadline=t0 + self.config.request_timeout_s,
            headers={h: v for h in _FORWARDED_HEADERS if (v := request.headers.get(h))},
        )
        work = asyncio.create_task(self.handle(ex, path, body))
        gone = asyncio.create_task(_wait_for_disconnect(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            gone.cancel()
            response = work.result()
            if not isinstance(response, StreamingResponse):
                self.metrics.request_seconds.observe(time.monotonic() - t0)
            return self._count(endpoint, response)
        work.cancel()  # closes the running leg's connection: vLLM aborts that request
        with contextlib.suppress(asyncio.CancelledError):
            response = await work
            if isinstance(response, _RelayResponse):  # finished just as the client left
                response._on_close()
        self.metrics.disconnects.inc()
        self.release_if_unpulled(ex)
        logger.info("request %s: client disconnected, legs aborted", ex.request_id)
        return self._count(endpoint, Response(status_code=499))

    def _count(self, endpoint: str, response: Response) -> Response:
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    # ---- passthrough GETs
    async def models(self) -> Response:
        reasons = []
        for inst in sorted([*self.decodes.instances, *self.prefills.instances], key=lambda i: not i.healthy):
            try:
                r = await self.client.get(f"{inst.url}/v1/models", timeout=self.config.health_timeout_s)
            except httpx.HTTPError as exc:
                reasons.append(f"{inst.url}: {type(exc).__name__}")
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return error_response(503, "no instance answered /v1/models: " + "; ".join(reasons), "service_unavailable")

    def health(self) -> JSONResponse:
        def states(pool: InstancePool) -> list[dict]:
            return [{"url": i.url, "healthy": i.healthy, "outstanding_tokens": i.outstanding_tokens,
                     "in_flight": i.in_flight, "last_error": i.last_error} for i in pool.instances]

        can_prefill = self.prefills.any_healthy() or self.config.fallback == "decode-only"
        ok = can_prefill and self.decodes.any_healthy()
        body = {"status": "ok" if ok else "unavailable", "prefill": states(self.prefills),
                "decode": states(self.decodes)}
        return JSONResponse(body, status_code=200 if ok else 503)


def build_app(config: ProxyConfig) -> FastAPI:
    proxy = Proxy(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    app = FastAPI(title="kv-mooncake-proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.serve(request, "/v1/completions", "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.serve(request, "/v1/chat/completions", "chat")

    @app.get("/v1/models")
    async def models() -> Response:
        return await proxy.models()

    @app.get("/health")
    async def health() -> Response:
        return proxy.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(proxy.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
